"""The ``native`` backend: our Llama-family forward over a paged KV cache (BatchLLM).

One iteration (``_NativeSteps.step``) is three calls, nano-vllm style:
  1. ``scheduler.schedule()``: every running decode, then prefill chunks in plan order,
     within the token budget (memory-centric token batching, BATON-style insertion);
  2. ``model(...)``: one token-packed forward over all chunks; per layer the attention
     stores the new K/V and merges, by log-sum-exp, each row's attention over its own K/V
     (causal) with one batched call per shared segment over all rows that read it;
     (where ``paths.forward`` is "compiled", the C++ decoder runs all layers in one call:
     ``models.cpu_decoder.CompiledDecoder``);
  3. sample the rows that reached their last token (``Run.sample``), hand each token to the
     run (``Run.append`` applies the stop rules), then ``finish`` or ``append_token``; a
     constrained row's jump-forward tokens (``Run.jumped``) go in with the sampled token,
     so its next step computes them all as one chunk (a small prefill) and samples once.

How a step runs (kernels, forward, GEMM, graphs, overlap, invariance) is the
``EnginePaths`` the factory resolved (``engine.factory.native_paths``); nothing here
chooses again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llm_operator import kernels
from llm_operator.config import EngineConfig
from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.decode_graphs import DecodeGraphs
from llm_operator.engine.native.op_profile import OpProfile, TimedOps
from llm_operator.engine.native.overlap import OverlappedSteps, patch_input_ids
from llm_operator.engine.native.paths import EnginePaths
from llm_operator.engine.native.scheduler import (
    KVSequence,
    ScheduledChunk,
    Scheduler,
    blocks_needed,
)
from llm_operator.engine.native.step_builder import HostStep, LayerAttention, StepBatch, StepBuilder
from llm_operator.engine.run import Run
from llm_operator.models.cpu_decoder import TIMED_KINDS, CompiledDecoder
from llm_operator.models.fused import EAGER_OPS, FusedOps
from llm_operator.models.gemm import ATEN_GEMM, packed_gemm
from llm_operator.models.llama import Linear, LlamaModel
from llm_operator.planner import Plan


@dataclass
class RunProfile:
    """Where one native run's time went (``NativeBackend.last_profile``)."""

    num_blocks: int  # KV blocks this run may use
    paths: str = ""  # how the engine ran its steps (``EnginePaths.describe``)
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
    """With ``profile_ops=True``: each iteration's seconds by kind of work."""
    graph_steps: int = 0  # decode steps run through DecodeGraphs (CUDA graphs)
    preemptions: int = 0
    segment_evictions: int = 0
    peak_blocks: int = 0  # most KV blocks in use at once (SchedulerStats)
    window_freed_blocks: int = 0  # blocks freed for having left every sliding window
    max_running: int = 0
    decode_tokens: int = 0  # one-token decode chunks run (SchedulerStats)
    jump_chunk_tokens: int = 0  # sampled + jump-forward tokens run as one chunk (SchedulerStats)
    tail_copies: int = 0  # KV blocks copied instead of computing their tokens (SchedulerStats)
    copied_tokens: int = 0  # the tokens those copies carried

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# the SchedulerStats a RunProfile copies
SCHEDULER_COUNTS = """preemptions segment_evictions peak_blocks window_freed_blocks max_running
    decode_tokens jump_chunk_tokens tail_copies copied_tokens""".split()


class NativeBackend:
    """Runs a plan on a ``LlamaModel`` with paged KV, pinned prefixes and token batching."""

    name = "native"

    def __init__(
        self,
        model: LlamaModel,
        engine_config: EngineConfig,
        paths: EnginePaths,
        *,
        kv_cache_bytes: int,
    ) -> None:
        """engine_config: its ``kv_block_size``, ``prefill_batch_tokens`` (tokens per
        iteration), ``max_batch_size`` (running requests), ``share_prefixes`` and
        ``token_batching`` apply here. paths: how steps run (``factory.native_paths``).
        kv_cache_bytes: the KV budget in bytes (``kv_cache_memory`` resolved for the
        device)."""
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
        self.paths = paths
        self.gemm = ATEN_GEMM
        if paths.gemm == "packed":
            assert model.pack_weights(), "the packed GEMM needs every weight packed"
            self.gemm = packed_gemm(paths.onednn_rows)
        model.use_gemm(self.gemm)
        self.decoder = CompiledDecoder(model) if paths.forward == "compiled" else None
        self.ops: FusedOps = EAGER_OPS
        if paths.elementwise == "triton":
            from llm_operator.models.triton_ops import TRITON_OPS

            self.ops = TRITON_OPS
        # profile_ops: each iteration's seconds by kind of work (op_profile.py)
        self.op_profile: OpProfile | None = None
        if paths.profile_ops:
            self.op_profile = OpProfile()
            self.op_profile.watch_linears(model, Linear)

    # -- memory ------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element

    def _num_blocks(self, plan: Plan) -> int:
        """The budget's blocks, but no more than this plan could ever hold at once
        (``scheduler.blocks_needed``)."""
        budget = self.kv_cache_bytes // self.bytes_per_block()
        need = blocks_needed(plan, self.block_size, self.engine_config.share_prefixes)
        blocks = min(budget, need)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {self.kv_cache_bytes} bytes holds no KV block "
                f"({self.bytes_per_block()} bytes each)"
            )
        return blocks

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
                capture=self.paths.graphs == "capture",
                ops=self.ops,
                fused_store=self.paths.fused_store,
                invariant=self.paths.invariant,
            )
        return self._graphs

    # -- a run -----------------------------------------------------------------------
    def start(self, run: Run) -> _NativeSteps | OverlappedSteps:
        steps = _NativeSteps(self, run)
        if self.paths.overlap and run.all_greedy and self.op_profile is None:
            return OverlappedSteps(steps)  # the next step scheduled while this one runs
        return steps


class _NativeSteps:
    """One run on the native backend: its attention kernels, its view of the KV pool (the
    pool outlives the run), its scheduler and its profile. Nothing of it stays on the
    backend but the profile, published as ``backend.last_profile``."""

    @torch.inference_mode()
    def __init__(self, backend: NativeBackend, run: Run) -> None:
        self.backend, self.run = backend, run
        plan = run.plan
        num_blocks = backend._num_blocks(plan)
        paths = backend.paths
        self.implementation = paths.attention
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
            # the invariant kernels read keys in whole blocks from position 0
            copy_tails=paths.invariant,
        )
        self.builder = StepBuilder(
            block_size=backend.block_size,
            pool_blocks=self.pool_blocks,
            device=backend.device,
            implementation=self.implementation,
            segment_blocks=self.scheduler.segment_blocks,
            segment_length=self.scheduler.segment_length,
            invariant=paths.invariant,  # the compiled CPU attention's mode (others ignore it)
            window=backend.config.sliding_window,
            softcap=backend.config.attn_softcap,
        )
        backend.model.use_gemm(backend.gemm)  # another backend may share the model
        self.upload_seconds = 0.0  # of the last step's eager device tensors (``logits``)
        self.graphs = None  # DecodeGraphs for decode-only steps (paths.graphs)
        if paths.graphs != "off":
            self.graphs = backend.decode_graphs(self.k_cache, self.v_cache)
        self.reported = 0  # scheduler.rejected already failed in the run
        self.profile = backend.last_profile = RunProfile(num_blocks, paths.describe())

    # -- one iteration's tensors -------------------------------------------------------
    def _attention(
        self, step: kernels.AttentionStep, window_step: kernels.AttentionStep | None = None
    ) -> Callable:
        """The eager forward's attention callback over this step's layout: store K/V, attend
        over the own K/V and the shared segments, merge (timed by kind with op profiling)."""
        config = self.backend.config
        scale, k_caches, v_caches = config.scale, self.k_cache, self.v_cache
        sliding = [window is not None for window in config.layer_windows]
        attention = LayerAttention(step, k_caches, v_caches, scale, window_step, sliding)
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
            regions = TimedOps(backend.ops, ops)
        started = step_started = time.perf_counter()
        chunks = scheduler.schedule()
        plan = self.builder.plan(chunks, scheduler.copies)
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
        if plan.copies is not None:  # tail copies: before any layer reads or writes them
            copies = kernels.device_tensor(plan.copies, self.backend.device)
            kernels.copy_blocks(self.implementation, [*self.k_cache, *self.v_cache], copies)
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
        decoder, onednn_rows = backend.decoder, backend.paths.onednn_rows
        # the compiled decoder runs one layout for every layer: the windowed one where
        # every layer slides (it does not run models that mix the two)
        step = batch.step if batch.window_step is None else batch.window_step
        if decoder is not None and (onednn_rows is None or batch.num_tokens < onednn_rows):
            seconds = None if ops is None else torch.zeros(len(TIMED_KINDS), dtype=torch.float64)
            hidden = decoder(
                batch.input_ids, batch.positions, step, self.k_cache, self.v_cache, seconds
            )
            if ops is not None:
                for kind, value in zip(TIMED_KINDS, seconds.tolist()):
                    ops.add(kind, value)
            return hidden
        attention = self._attention(batch.step, batch.window_step)
        fused_store = backend.paths.fused_store and ops is None
        return backend.model(
            batch.input_ids, batch.positions, attention, regions or backend.ops, fused_store
        )

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
        self.k_cache = self.v_cache = []  # the pool stays on the backend for the next run
        for name in SCHEDULER_COUNTS:
            setattr(self.profile, name, getattr(self.scheduler.stats, name))
