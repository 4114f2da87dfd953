"""The ``vllm`` backend: vLLM's offline engine with prefix caching, fed in plan order.

vLLM brings the kernels and the model coverage; the plan brings what vLLM cannot know
from one request at a time: which rows share a prefix, and when a prefix is needed again.
Each step of a run (``start(run).step()``):

  1. admits the next groups of the plan (decode-first order) while their footprint fits
     the KV cache: a group's full prefix blocks plus, per member, the blocks of its
     prompt suffix and of its max_tokens of growth (a group bigger than the cache runs
     alone), so vLLM's LRU never evicts a prefix whose group has not ended. A group's
     members are added at once, in plan order: vLLM caches a block when it allocates it,
     so the first member prefills the prefix and the others, even in its step, hit it;
  2. runs one ``LLMEngine.step``; each finished completion goes to ``run.replay`` (read
     by ``engine.completions.read_completion``), and a group's footprint frees when its
     last member ends.

Rows vLLM rejects (longer than ``max_model_len``) become error rows; ``run.prefill_tokens``
grows by the prompt tokens less ``num_cached_tokens`` of every vLLM request. ``logprobs``:
an unconstrained row sums vLLM's sampled-token log-probabilities; a constrained row's are
renormalized under its mask, so once it ends a second request (prompt + its tokens,
``driver.scoring_*``) scores it. A choice's scoring request (``run.requests[i].forced``)
is scored the same way, as a member of its row's group; where vLLM's prefix-cache hit
covered a scored position, a score runs again without reading the cache.

The engine starts on the first run and serves every later one (its ``max_model_len`` is
the model's context capped by the KV budget); ``vllm_options`` override its defaults.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from llm_operator.config import EngineConfig
from llm_operator.engine.completions import read_completion
from llm_operator.engine.run import Request, Run
from llm_operator.engine.vllm.driver import (
    HOW_TO_GET_VLLM,
    VLLMEngine,
    engine_input,
    engine_max_model_len,
    llm_kwargs,
    request_seed,
    require_vllm,
    sampling_params,
    scored_logprob,
    scoring_params,
    scoring_prompt,
    start_engine,
    vllm_available,
)
from llm_operator.planner import PrefixGroup

__all__ = ["HOW_TO_GET_VLLM", "VLLMBackend", "require_vllm", "vllm_available"]


class _Flight(NamedTuple):
    """A vLLM request: its group, its run request, the tokens it scores after the request's
    prompt (None: its generation), scoring a generated row that row's (tokens, reason,
    text), and whether it may read vLLM's prefix cache."""

    group_id: int
    request_id: int
    scored: tuple[int, ...] | None = None
    generated: tuple[list[int], str, str] | None = None
    read_cache: bool = True


@dataclass(slots=True)
class _Group:
    """A group in flight: its members, those still running and the KV blocks it holds."""

    group_id: int
    members: list[int]  # request ids
    blocks: int  # prefix blocks + each member's suffix and growth blocks
    running: int = 0


class VLLMBackend:
    """Runs plans on ``vllm.LLM`` (built once, on the first run, and reused)."""

    name = "vllm"

    def __init__(
        self, model_path: str, tokenizer, engine_config: EngineConfig, *, max_context: int
    ) -> None:
        """engine_config: its ``dtype``, ``kv_cache_memory``, ``max_batch_size`` (vLLM's
        ``max_num_seqs``), ``trust_remote_code``, ``tensor_parallel_size``,
        ``pipeline_parallel_size``, ``gpu_share`` and ``vllm_options`` apply here.
        max_context: the model's context length (caps ``max_model_len``)."""
        require_vllm()
        self.model_path = str(model_path)
        self.tokenizer = tokenizer
        # batch sizes left to the engine: the CPU's, unless build_backend sized them for a GPU
        self.engine_config = engine_config.with_batch_defaults(None)
        self.max_context = max_context
        self._engine: VLLMEngine | None = None
        self.engine_builds = 0  # engines started over this backend's life
        self.last_profile: dict[str, Any] = {}
        self._runs = 0

    # -- the engine --------------------------------------------------------------------
    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM``: batch-job defaults, then ``vllm_options``; the
        ``max_model_len`` fitted to the context and the KV budget unless they fix it."""
        config = self.engine_config
        kwargs = llm_kwargs(
            self.model_path,
            dtype=config.dtype,
            kv_cache_bytes=config.kv_cache_bytes,
            trust_remote_code=config.trust_remote_code,
            max_num_seqs=config.max_batch_size,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            gpu_share=config.gpu_share,
            options=dict(config.vllm_options),
        )
        if kwargs.get("max_model_len") is None:
            kwargs["max_model_len"] = engine_max_model_len(
                self.model_path,
                kwargs,
                max_context=self.max_context,
                trust_remote_code=config.trust_remote_code,
            )
        return kwargs

    def engine(self) -> VLLMEngine:
        """The started engine (built here on first use, then kept)."""
        if self._engine is None:
            self._engine = start_engine(self.engine_options())
            self.engine_builds += 1
        return self._engine

    @property
    def llm(self):
        """The ``vllm.LLM`` once started, else None."""
        return None if self._engine is None else self._engine.llm

    @property
    def max_model_len(self) -> int:
        """The longest row (prompt + output) the engine serves; 0 before it starts."""
        return 0 if self._engine is None else min(self._engine.max_model_len, self.max_context)

    def cache_blocks(self) -> tuple[int, int]:
        """(KV blocks, tokens per block) the engine allocated (read after start-up)."""
        engine = self.engine()
        return int(engine.kv_blocks or 0), engine.block_size

    def close(self) -> None:
        """Shut the engine down and free its memory (a later run builds a new one)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # -- a run -------------------------------------------------------------------------
    def start(self, run: Run) -> _Steps:
        engine = self.engine()
        if engine.engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine still has requests from another caller")
        self._runs += 1
        return _Steps(self, engine, run, tag=f"lo{self._runs}")


class _Steps:
    """One run on the engine: groups waiting, groups in flight, vLLM ids in flight."""

    def __init__(self, backend: VLLMBackend, engine: VLLMEngine, run: Run, tag: str):
        self.backend = backend
        self.llm = engine.llm
        self.engine = engine.engine
        self.run = run
        self.tag = tag
        self.block_size = engine.block_size
        self.capacity = max(1, (engine.kv_blocks or 1) - 1)  # vLLM keeps one null block
        self.max_model_len = backend.max_model_len
        self.waiting: deque[PrefixGroup] = deque(run.plan.groups)
        self.in_flight: dict[int, _Group] = {}
        self._head: _Group | None = None  # waiting[0], prepared
        self.used_blocks = 0
        self.owner: dict[str, _Flight] = {}  # vLLM id -> what it runs for
        self._submitted = 0  # vLLM requests added (their ids' serial numbers)
        self.started = time.perf_counter()
        self.profile: dict[str, Any] = {
            "steps": 0,
            "max_groups_in_flight": 0,
            "cache_blocks": self.capacity,
            "cached_tokens": [0] * len(run.requests),  # vLLM's num_cached_tokens per request
            "scoring_requests": 0,  # vLLM requests that scored tokens (logprobs)
            "rescored_uncached": 0,  # of which ran again without reading the prefix cache
        }

    def step(self) -> bool:
        unanswered = self.run.unanswered
        self.admit()
        if not self.in_flight:  # False when nothing ran: no group left, none failed here
            return self.run.unanswered < unanswered
        for output in self.engine.step():
            if output.finished:
                self.finished(output)
        self.profile["steps"] += 1
        return True

    def close(self) -> None:
        if self.owner:  # stopped early: leave the engine empty for the next run
            self.engine.abort_request(list(self.owner))
            self.owner.clear()
        self.profile["seconds"] = time.perf_counter() - self.started
        self.backend.last_profile = self.profile

    # -- admission ---------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting:
            if self._head is None:
                self._head = self._prepare(self.waiting[0])
            group = self._head
            if self.in_flight and self.used_blocks + group.blocks > self.capacity:
                return
            self.waiting.popleft()
            self._head = None
            self.in_flight[group.group_id] = group
            self.used_blocks += group.blocks
            self.profile["max_groups_in_flight"] = max(
                self.profile["max_groups_in_flight"], len(self.in_flight)
            )
            for request_id in group.members:  # a choice's scoring request scores its tokens
                forced = self.run.requests[request_id].forced
                group.running += self._add(_Flight(group.group_id, request_id, forced))
            if group.running == 0:
                self._end(group)

    def _prepare(self, group: PrefixGroup) -> _Group:
        requests = self.run.requests
        members = [i for i in group.request_ids if not requests[i].done]
        prefix = group.prefix_length // self.block_size
        blocks = prefix + sum(max(1, self._blocks(requests[i]) - prefix) for i in members)
        return _Group(group.group_id, members, blocks)

    def _room(self, request: Request) -> int:
        """The tokens a request may generate: its max_tokens, within ``max_model_len``."""
        prompt = len(request.planned.token_ids)
        return max(1, min(request.params.max_tokens, self.max_model_len - prompt))

    def _blocks(self, request: Request) -> int:
        """The KV blocks of a request's prompt and growth (a scored one's: its tokens)."""
        return -(-(len(request.planned.token_ids) + self._room(request)) // self.block_size)

    def _add(self, flight: _Flight) -> bool:
        """Add a vLLM request; False (and the run request failed) when vLLM rejects it."""
        request = self.run.requests[flight.request_id]
        if flight.scored is None:
            prompt = request.planned.token_ids
            params = sampling_params(
                request.params,
                max_tokens=self._room(request),
                seed=request_seed(request),
                eos_token_ids=self.run.eos_token_ids,
            )
        else:
            self.profile["scoring_requests"] += 1
            prompt = scoring_prompt(request.planned.token_ids, flight.scored)
            params = scoring_params(flight.scored, read_cache=flight.read_cache)
        self._submitted += 1
        vllm_id = f"{self.tag}-r{request.request_id}n{self._submitted}"
        try:
            self.engine.add_request(vllm_id, engine_input(self.llm, prompt), params)
        except Exception as error:  # noqa: BLE001 - vLLM rejects with several types
            self.run.fail(request.request_id, f"vLLM rejected: {error}")
            return False
        self.owner[vllm_id] = flight
        return True

    # -- completion --------------------------------------------------------------------
    def finished(self, output) -> None:
        vllm_id = output.request_id
        if vllm_id not in self.owner:  # a vLLM that reports its internal id
            vllm_id = vllm_id.rsplit("-", 1)[0]
        flight = self.owner.pop(vllm_id)
        request = self.run.requests[flight.request_id]
        cached = int(output.num_cached_tokens or 0)
        self.run.prefill_tokens += len(output.prompt_token_ids) - cached
        if flight.scored is None or (request.forced is not None and flight.read_cache):
            self.profile["cached_tokens"][flight.request_id] = cached  # its first request's
        completion = output.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            self.run.fail(flight.request_id, f"vLLM ended the row: {completion.finish_reason}")
            follow_up = None
        elif flight.scored is None:
            follow_up = self._generated(flight, request, completion)
        else:
            follow_up = self._scored(flight, request, output)
        if follow_up is None or not self._add(follow_up):
            group = self.in_flight[flight.group_id]
            group.running -= 1
            if group.running == 0:
                self._end(group)

    def _generated(self, flight: _Flight, request: Request, completion) -> _Flight | None:
        """Answer a generated row, or the scoring it waits for (module doc)."""
        tokens, reason, text = read_completion(
            self.run, request, completion.token_ids, completion.finish_reason, completion.text
        )
        logprob = None
        if request.params.logprobs and request.constraint is None:
            entries = completion.logprobs  # per token: {token: its Logprob}
            logprob = sum(float(entry[token].logprob) for token, entry in zip(tokens, entries))
        elif request.params.logprobs and tokens:  # renormalized: score it unconstrained
            return flight._replace(scored=tuple(tokens), generated=(tokens, reason, text))
        elif request.params.logprobs:
            logprob = 0.0
        self.run.replay(request.request_id, tokens, reason, text, logprob)
        return None

    def _scored(self, flight: _Flight, request: Request, output) -> _Flight | None:
        """Answer a finished scoring request, or run it again without the cache."""
        logprob = scored_logprob(output, len(request.planned.token_ids), flight.scored)
        if logprob is None:  # the cache hit covered a scored position
            assert flight.read_cache, "an uncached scoring request has every position"
            self.profile["rescored_uncached"] += 1
            return flight._replace(read_cache=False)
        completion = flight.generated or (flight.scored, "length", "")  # else: a choice's
        self.run.replay(request.request_id, *completion, logprob)
        return None

    def _end(self, group: _Group) -> None:
        del self.in_flight[group.group_id]
        self.used_blocks -= group.blocks
