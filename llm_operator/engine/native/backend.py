"""The ``native`` backend: our Llama-family forward over a paged KV cache (BatchLLM).

One iteration (``_NativeSteps.step``) is three calls, nano-vllm style:
  1. ``scheduler.schedule()``: every running decode, then prefill chunks in plan order,
     within the token budget (memory-centric token batching, BATON-style insertion);
  2. ``model(...)``: one token-packed forward over all chunks; per layer the attention
     stores the new K/V and merges, by log-sum-exp, each row's attention over its own K/V
     (causal) with one batched call per shared segment over all rows that read it;
     (on a CPU with every projection packed, the compiled decoder runs all layers in one
     C++ call: ``models.cpu_decoder.CompiledDecoder``);
  3. sample the rows that reached their last token (``Run.sample``), hand each token to the
     run (``Run.append`` applies the stop rules), then ``finish`` or ``append_token``; a
     constrained row's jump-forward tokens (``Run.jumped``) go in with the sampled token,
     so its next step computes them all as one chunk (a small prefill) and samples once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llm_operator import kernels
from llm_operator.config import EngineConfig
from llm_operator.engine.factory import invariant_kernels
from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.decode_graphs import DecodeGraphs
from llm_operator.engine.native.op_profile import OpProfile, TimedOps, profiling_requested
from llm_operator.engine.native.overlap import OverlappedSteps, overlap_mode, patch_input_ids
from llm_operator.engine.native.scheduler import KVSequence, ScheduledChunk, Scheduler
from llm_operator.engine.native.step_builder import HostStep, StepAttention, StepBatch, StepBuilder
from llm_operator.engine.run import Run
from llm_operator.models import fused
from llm_operator.models.cpu_decoder import TIMED_KINDS, CompiledDecoder
from llm_operator.models.gemm import DEFAULT_GEMM, INVARIANT_GEMM
from llm_operator.models.llama import Linear, LlamaModel
from llm_operator.planner import Plan


@dataclass
class RunProfile:
    """Where one native run's time went (``NativeBackend.last_profile``)."""

    num_blocks: int  # KV blocks this run may use
    schedule: float = 0.0  # seconds scheduling and building each step's batch
    forward: float = 0.0  # seconds in the model (and the output head)
    sample: float = 0.0  # seconds sampling and handing tokens to the run
    iterations: int = 0
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    """(tokens, rows sampled, seconds) of each iteration: decode-only when the first two
    are equal."""
    host: list[float] = field(default_factory=list)
    """Each iteration's host seconds: scheduling, building its batch and handing the
    sampled tokens over (the model, the head and sampling on the device excluded)."""
    ops: list[dict[str, float]] | None = None
    """With ``LLM_OPERATOR_PROFILE_OPS=1``: each iteration's seconds by kind of work."""
    graph_steps: int = 0  # decode steps run through DecodeGraphs (CUDA graphs)
    preemptions: int = 0
    segment_evictions: int = 0
    peak_blocks: int = 0  # most KV blocks in use at once (SchedulerStats)
    window_freed_blocks: int = 0  # blocks freed for having left every sliding window
    max_running: int = 0
    decode_tokens: int = 0  # one-token decode chunks run (SchedulerStats)
    jump_chunk_tokens: int = 0  # sampled + jump-forward tokens run as one chunk (SchedulerStats)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NativeBackend:
    """Runs a plan on a ``LlamaModel`` with paged KV, pinned prefixes and token batching."""

    name = "native"

    def __init__(
        self,
        model: LlamaModel,
        engine_config: EngineConfig,
        *,
        kv_cache_bytes: int,
    ) -> None:
        """engine_config: its ``kv_block_size``, ``prefill_batch_tokens`` (tokens per
        iteration), ``max_batch_size`` (running requests), ``share_prefixes`` and
        ``token_batching`` apply here. kv_cache_bytes: the KV budget in bytes
        (``kv_cache_memory`` resolved for the device)."""
        # batch sizes left to the engine: the CPU's, unless build_backend sized them for a GPU
        self.engine_config = engine_config = engine_config.with_batch_defaults(None)
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_cache_bytes = kv_cache_bytes
        self.block_size = engine_config.kv_block_size
        self.last_profile: RunProfile | None = None  # of the last run
        # (implementation, num_blocks, k caches, v caches): the KV pool, kept across runs
        self._pool: tuple[str, int, list, list] | None = None
        self._graphs: DecodeGraphs | None = None  # of the pool's caches (decode_graphs)
        self.decoder: CompiledDecoder | None = None
        # deterministic: batch-invariant GEMMs and attention (the CPU's compiled kernels)
        self.invariant = invariant_kernels(engine_config, "native")
        self.gemm = INVARIANT_GEMM if self.invariant else DEFAULT_GEMM
        if self.device.type == "cpu":  # pack the weights, time each linear shape's GEMMs once
            max_batched_tokens = engine_config.prefill_batch_tokens
            self.gemm.tune(model.pack_weights(), max_rows=max_batched_tokens)
            # the head runs on the sampled rows only: at most one per running request
            max_sampled = min(max_batched_tokens, engine_config.max_batch_size)
            self.gemm.tune([(model.head_weight, model.head_packed)], max_rows=max_sampled)
            model.use_gemm(self.gemm)
            self.decoder = CompiledDecoder(model)
            warm_eager_path(model)
        if engine_config.deterministic:  # asked for: say where it cannot hold
            warn_unless_invariant(self)
        # LLM_OPERATOR_PROFILE_OPS: each iteration's seconds by kind of work (op_profile.py)
        self.op_profile: OpProfile | None = None
        if profiling_requested():
            self.op_profile = OpProfile()
            self.op_profile.watch_linears(model, Linear)

    # -- memory ------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element

    def _num_blocks(self, plan: Plan) -> int:
        """The budget's blocks, but no more than this plan could ever hold at once."""
        budget = self.kv_cache_bytes // self.bytes_per_block()
        need = sum(-(-len(s.token_ids) // self.block_size) for s in plan.segments)
        need += sum(
            -(-(len(r.token_ids) + r.max_tokens) // self.block_size) + 1 for r in plan.requests
        )
        blocks = min(budget, need)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {self.kv_cache_bytes} bytes holds no KV block "
                f"({self.bytes_per_block()} bytes each)"
            )
        return blocks

    def _implementation(self) -> str:
        """The attention kernels of this backend's device and dtype
        (``kernels.step_implementation``); the torch kernels for soft-capped attention
        scores (Gemma 2), which the others do not compute."""
        if self.config.attn_softcap is not None:
            return "torch"
        return kernels.step_implementation(torch.empty(0, device=self.device, dtype=self.dtype))

    def _kv_pool(self, implementation: str, num_blocks: int) -> tuple[list, list]:
        """Per-layer K and V caches of at least ``num_blocks`` blocks in ``implementation``'s
        layout. Allocated zeroed (its pages touched now, not in the steps) and kept for
        later runs: a run that needs no more blocks reuses them; a larger one replaces them."""
        pool = self._pool
        if pool is None or pool[0] != implementation or pool[1] < num_blocks:
            self._pool = None  # free the smaller pool before allocating the larger
            c = self.config
            k_shape, v_shape = kernels.kv_cache_shapes(
                implementation, num_blocks, self.block_size, c.num_kv_heads, c.head_dim
            )
            options = {"dtype": self.dtype, "device": self.device}
            k_cache = [torch.zeros(k_shape, **options) for _ in range(c.num_layers)]
            v_cache = [torch.zeros(v_shape, **options) for _ in range(c.num_layers)]
            self._pool = pool = (implementation, num_blocks, k_cache, v_cache)
        return pool[2], pool[3]

    def release_kv_pool(self) -> None:
        """Free the KV pool kept between runs (the next run allocates its own)."""
        self._pool = None
        self._graphs = None

    # -- decode graphs ----------------------------------------------------------------
    def graphs_wanted(self, implementation: str) -> bool:
        """Whether decode steps go through ``DecodeGraphs``: ``cuda_graphs`` "auto" on
        CUDA, "on" anywhere the Triton kernels run (on the CPU, under the interpreter:
        the static buffers replayed eagerly, a test of the graph path). Never with op
        profiling. ValueError for "on" without the Triton kernels."""
        mode = self.engine_config.cuda_graphs
        if mode == "off" or self.op_profile is not None:
            return False
        if self.config.sliding_window is not None or self.config.attn_softcap is not None:
            if mode == "on":
                raise ValueError(
                    "cuda_graphs='on': decode graphs do not run sliding-window or soft-capped "
                    f"attention yet (model_type={self.config.model_type!r}); use "
                    "cuda_graphs='auto' or 'off'"
                )
            return False
        if implementation != "triton":
            if mode == "on":
                raise ValueError(
                    f"cuda_graphs='on' needs the Triton kernels (a CUDA device; or, for "
                    f"tests, LLM_OPERATOR_KERNELS=triton with TRITON_INTERPRET=1), but "
                    f"{self.device} runs the {implementation!r} kernels; use "
                    "cuda_graphs='auto' or 'off'"
                )
            return False
        return mode == "on" or self.device.type == "cuda"

    def decode_graphs(self, k_cache: list, v_cache: list) -> DecodeGraphs:
        """The graphs of the current KV pool (recorded graphs outlive a run; a new pool
        starts new ones)."""
        if self._graphs is None or self._graphs.k_cache is not k_cache:
            config = self.engine_config
            self._graphs = DecodeGraphs(
                self.model,
                k_cache,
                v_cache,
                max_rows=min(config.max_batch_size, config.prefill_batch_tokens),
                block_size=self.block_size,
                pool_blocks=self._pool[1],
                capture=self.device.type == "cuda",
            )
        return self._graphs

    # -- a run -----------------------------------------------------------------------
    def start(self, run: Run) -> _NativeSteps | OverlappedSteps:
        steps = _NativeSteps(self, run)
        mode = overlap_mode()
        if (
            run.all_greedy
            and self.op_profile is None
            and (mode == "on" or (mode == "auto" and self.device.type == "cuda"))
        ):
            return OverlappedSteps(steps)  # the next step scheduled while this one runs
        return steps


def warn_unless_invariant(backend: NativeBackend) -> None:
    """deterministic=True holds where the compiled CPU kernels run the attention and every
    projection; elsewhere say so once (the run goes on, batch-dependent). Left unset, the
    mode is the default where it can hold: nothing more to say (a kernel that failed its
    proof has warned already)."""
    import warnings

    implementation = backend._implementation()
    model = backend.model
    packed = all(
        INVARIANT_GEMM.packs(m.weight, m.packed) for m in model.modules() if isinstance(m, Linear)
    ) and INVARIANT_GEMM.packs(model.head_weight, model.head_packed)
    if implementation == "cpp" and packed:
        return
    where = (
        f"{backend.device} runs the {implementation!r} attention kernels"
        if implementation != "cpp"
        else "some projections have no packed copy for the compiled CPU GEMM"
    )
    warnings.warn(
        f"llm_operator: deterministic=True makes outputs batch-invariant with the compiled CPU "
        f"kernels only, but {where}: a row's tokens may still depend on its batch",
        RuntimeWarning,
        stacklevel=3,
    )


@torch.inference_mode()
def warm_eager_path(model: LlamaModel) -> None:
    """Run the eager forward once, on one row and on enough rows for the multi-threaded
    builds (``fused.PARALLEL_MIN_ELEMENTS``), with a stand-in attention: the elementwise
    regions' packages load now, with the model, rather than in a job's first prefill step
    that takes the eager path (the first load in a process costs ~1.5 s on a 2-core CPU)."""
    device = next(model.parameters()).device
    rows = -(-fused.PARALLEL_MIN_ELEMENTS // model.config.hidden_size) + 1

    def attention(layer: int, q, k, v):
        return torch.zeros_like(q)

    for count in (1, rows):
        ids = torch.zeros(count, dtype=torch.int64, device=device)
        model(ids, torch.arange(count, device=device), attention)


class _NativeSteps:
    """One run on the native backend: its attention kernels, its view of the KV pool (the
    pool outlives the run), its scheduler and its profile. Nothing of it stays on the
    backend but the profile, published as ``backend.last_profile``."""

    @torch.inference_mode()
    def __init__(self, backend: NativeBackend, run: Run) -> None:
        self.backend, self.run = backend, run
        plan = run.plan
        num_blocks = backend._num_blocks(plan)
        self.implementation = backend._implementation()
        self.k_cache, self.v_cache = backend._kv_pool(self.implementation, num_blocks)
        self.pool_blocks = backend._pool[1]  # >= num_blocks: a larger run may have built it
        windows = set(backend.config.layer_windows)
        self.scheduler = Scheduler.from_config(
            plan,
            BlockManager(num_blocks, backend.block_size),
            backend.engine_config,
            # every layer slides: blocks that left the window go back to the pool (a model
            # that also has full-attention layers keeps every block for those)
            window=windows.pop() if len(windows) == 1 else None,
        )
        self.builder = StepBuilder(
            block_size=backend.block_size,
            pool_blocks=self.pool_blocks,
            device=backend.device,
            implementation=self.implementation,
            segment_blocks=self.scheduler.segment_blocks,
            segment_length=self.scheduler.segment_length,
            invariant=backend.invariant,  # the compiled CPU attention's mode (others ignore it)
            window=backend.config.sliding_window,
            softcap=backend.config.attn_softcap,
        )
        if backend.device.type == "cpu":
            backend.model.use_gemm(backend.gemm)  # another backend may share the model
        self.upload_seconds = 0.0  # of the last step's eager device tensors (``logits``)
        self.graphs = None  # DecodeGraphs for decode-only steps (backend.graphs_wanted)
        if backend.graphs_wanted(self.implementation):
            self.graphs = backend.decode_graphs(self.k_cache, self.v_cache)
        self.reported = 0  # scheduler.rejected already failed in the run
        self.profile = backend.last_profile = RunProfile(num_blocks=num_blocks)

    # -- one iteration's tensors -------------------------------------------------------
    def _attention(
        self, step: kernels.AttentionStep, window_step: kernels.AttentionStep | None = None
    ) -> Callable:
        """The eager forward's attention callback over this step's layout: store K/V, attend
        over the own K/V and the shared segments, merge (timed by kind with op profiling)."""
        config = self.backend.config
        scale, k_caches, v_caches = config.scale, self.k_cache, self.v_cache
        sliding = [window is not None for window in config.layer_windows]
        attention = StepAttention(step, k_caches, v_caches, scale, window_step, sliding)
        op_profile = self.backend.op_profile
        if op_profile is None:
            return attention
        store = op_profile.timed("kv_store", kernels.AttentionStep.store)
        attend = op_profile.timed("attention", kernels.AttentionStep.attend)

        def timed_attention(layer: int, q, k, v):
            layer_step = attention._step(layer)
            k_cache, v_cache = k_caches[layer], v_caches[layer]
            store(layer_step, k, v, k_cache, v_cache)
            return attend(layer_step, q, k_cache, v_cache, scale)

        return timed_attention

    @torch.inference_mode()
    def step(self) -> bool:
        scheduler, run, backend = self.scheduler, self.run, self.backend
        if scheduler.done:
            return False
        profile, ops = self.profile, backend.op_profile
        model, sample = backend.model, run.sample
        compute_logits = model.compute_logits
        regions = None
        if ops is not None:
            ops.begin()
            compute_logits = ops.timed("linear", compute_logits)
            sample = ops.timed("sampling", sample)
            regions = TimedOps(fused.fused_ops(backend.device, backend.dtype), ops)
        started = step_started = time.perf_counter()
        chunks = scheduler.schedule()
        plan = self.builder.plan(chunks)
        host = time.perf_counter() - started
        profile.schedule += host
        started = time.perf_counter()
        sampled, tokens = plan.sampled, plan.num_tokens
        logits = self.logits(plan, regions=regions, compute_logits=compute_logits)
        if sampled:
            ids = [c.seq.ref for c in sampled]
            next_tokens = sample(logits, ids)  # on the device, one copy to the host
        host += self.upload_seconds
        profile.schedule += self.upload_seconds
        profile.forward += time.perf_counter() - started - self.upload_seconds
        started = time.perf_counter()
        scheduler.complete(chunks)
        if sampled:
            self._hand_over(sampled, ids, next_tokens)
        self.report_rejections()
        handed_over = time.perf_counter() - started
        profile.sample += handed_over
        profile.host.append(host + handed_over)
        profile.iterations += 1
        # (tokens, rows sampled, seconds) of this iteration: decode-only when they are equal
        seconds = time.perf_counter() - step_started
        profile.steps.append((tokens, len(sampled), seconds))
        if ops is not None:
            if profile.ops is None:
                profile.ops = []
            profile.ops.append(ops.end(seconds))
        return True

    def logits(self, plan: HostStep, patch=None, *, regions=None, compute_logits=None):
        """The step on the device: [sampled, vocab] float32 logits of its sampled rows
        (None when none samples), through a decode graph where one takes the step, else
        the eager (or compiled CPU) forward. ``patch``: the guessed rows' input ids to copy
        on the device (``overlap.patch_input_ids``). Building the eager step's device
        tensors is host work: its seconds are left in ``upload_seconds`` for the caller."""
        graphs = self.graphs
        self.upload_seconds = 0.0  # building the eager step's device tensors (host work)
        if graphs is not None and graphs.accepts(plan):  # a decode step: replayed
            self.profile.graph_steps += 1
            return graphs.logits(plan, patch)
        started = time.perf_counter()
        batch = self.builder.to_device(plan)
        self.upload_seconds = time.perf_counter() - started
        if patch is not None:
            patch_input_ids(batch.input_ids, patch)
        hidden = self._forward(batch, regions)
        if not batch.sampled:
            return None
        compute_logits = compute_logits or self.backend.model.compute_logits
        return compute_logits(hidden[batch.last_rows])

    def report_rejections(self) -> None:
        """Requests the scheduler rejected since the last call become error rows; the
        run's prefill count follows the scheduler's."""
        scheduler, run = self.scheduler, self.run
        for request_id, message in scheduler.rejected[self.reported :]:
            run.fail(request_id, message)
        self.reported = len(scheduler.rejected)
        run.prefill_tokens = scheduler.stats.prefill_tokens

    def _forward(self, batch: StepBatch, regions) -> torch.Tensor:
        """The model on the step's tokens (the compiled CPU decoder where it runs): the
        final-normed hidden states [tokens, hidden]."""
        backend, ops = self.backend, self.backend.op_profile
        decoder = backend.decoder
        # the compiled decoder runs one layout for every layer: the windowed one where
        # every layer slides (it does not run models that mix the two)
        step = batch.step if batch.window_step is None else batch.window_step
        if decoder is not None and decoder.runs(batch.num_tokens, step):
            seconds = None if ops is None else torch.zeros(len(TIMED_KINDS), dtype=torch.float64)
            hidden = decoder(
                batch.input_ids, batch.positions, step, self.k_cache, self.v_cache, seconds
            )
            if ops is not None:
                for kind, value in zip(TIMED_KINDS, seconds.tolist()):
                    ops.add(kind, value)
            return hidden
        attention = self._attention(batch.step, batch.window_step)
        return backend.model(batch.input_ids, batch.positions, attention, regions)

    def _hand_over(self, sampled: list[ScheduledChunk], ids: list[int], tokens: list[int]) -> None:
        """Give each sampled token to the run (stop rules), then to the scheduler: the row
        finishes, or decodes on (with any tokens jump-forward appended: the next step
        computes them). Rows without constraints, logprobs or stop strings go through in
        one batch (``Run.append_plain``, ``Scheduler.append_tokens``)."""
        run, scheduler = self.run, self.scheduler
        if run.all_plain:
            going_on, going_on_tokens = [], []
            for chunk, token, finished in zip(sampled, tokens, run.append_plain(ids, tokens)):
                if finished:
                    self.finish(chunk.seq)
                else:
                    going_on.append(chunk.seq)
                    going_on_tokens.append(token)
            scheduler.append_tokens(going_on, going_on_tokens)
            return
        for chunk, request_id, token in zip(sampled, ids, tokens):
            if run.append(request_id, token):
                self.finish(chunk.seq)
            else:
                scheduler.append_token(chunk.seq, token, run.jumped(request_id))

    def finish(self, seq: KVSequence) -> None:
        """The request is done: the scheduler frees its blocks, the builder its table row."""
        self.scheduler.finish(seq)
        self.builder.release(seq)

    def close(self) -> None:
        stats, profile = self.scheduler.stats, self.profile
        self.k_cache = self.v_cache = []  # the pool stays on the backend for the next run
        profile.preemptions = stats.preemptions
        profile.segment_evictions = stats.segment_evictions
        profile.peak_blocks = stats.peak_blocks
        profile.window_freed_blocks = stats.window_freed_blocks
        profile.max_running = stats.max_running
        profile.decode_tokens = stats.decode_tokens
        profile.jump_chunk_tokens = stats.jump_chunk_tokens
