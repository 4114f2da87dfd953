"""The ``openai`` backend: rows sent to an OpenAI-compatible server (vLLM, SGLang, a
hosted endpoint) in plan order, so the server's prefix cache hits.

With ``request_order="plan"``:

- each prefix group's first row goes first, alone, streamed; once its first token arrives
  (its prefill put the prefix in the server's cache) the rest of the group follows;
- decode-first: rows of a group whose prefix is cached go before new groups, and new
  groups start in the plan's order;
- at most ``max_concurrency`` requests are in flight per operator (per Spark or Dask
  worker);
- waves, where the server says its KV cache size (a vLLM server's ``/metrics``): a new
  group starts only while the prefixes of the groups in flight, its own and every request
  in flight (its prompt past the prefix and its ``max_tokens``) fit the cache, so the
  server's LRU does not evict a prefix whose group has not ended.

``request_order="table"`` sends the rows in the table's order at the same concurrency, as
SynapseML's ``OpenAIPrompt`` and ``ai_query`` do (an ablation, for comparison).

The bodies are ``requests``'; retries and a row's error are ``client.Endpoint``'s (no other
row is touched). Constrained rows with ``logprobs`` and choice scores are scored as the
``vllm`` backend scores them. Usage (prompt, cached and completion tokens) adds up into the
run's ``usage`` and so into ``RunStats``.
"""

from __future__ import annotations

import functools
import queue
import time
from collections import deque
from typing import Any, NamedTuple

from llm_operator.config import EngineConfig
from llm_operator.engine.completions import read_completion
from llm_operator.engine.openai import requests as bodies
from llm_operator.engine.openai.client import Endpoint, RequestFailed
from llm_operator.engine.run import Run

PREFILLED = object()  # on the answers queue with a request id: its first chunk arrived


class _Flight(NamedTuple):
    """A request in flight: its run request, the tokens it scores (None: its generation)
    and, scoring a generated row, that row's (tokens, reason, text)."""

    request_id: int
    scored: tuple[int, ...] | None
    generated: tuple[list[int], str, str] | None


class OpenAIBackend:
    """Runs plans against one server (probed when built: a wrong address, key or model
    fails here, before any row is sent)."""

    name = "openai"

    def __init__(self, config: EngineConfig, tokenizer, *, max_context: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.endpoint = Endpoint(config)
        try:
            self.served = self.endpoint.probe(config.server_model)
        except BaseException:
            self.endpoint.close()
            raise
        vllm = self.served.kind == "vllm"
        self.api = ("completions" if vllm else "chat") if config.api == "auto" else config.api
        # the server's KV cache in tokens, where it says (waves; module doc)
        self.cache_tokens = self.endpoint.cache_tokens() if vllm else None
        self.last_profile: dict[str, Any] = {}

    def start(self, run: Run) -> _Steps:
        bodies.check_run(run, self.served.kind, self.api, self.endpoint.base_url)
        return _Steps(self, run)

    def close(self) -> None:
        self.endpoint.close()


class _Steps:
    """One run: groups waiting, rows released, requests in flight, answers come back on a
    queue and are read into the run on the caller's thread."""

    def __init__(self, backend: OpenAIBackend, run: Run) -> None:
        self.backend = backend
        self.endpoint = backend.endpoint
        self.run = run
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: set = set()  # the requests in flight (cancelled if the run stops early)
        self.released: deque[int] = deque()  # rows free to go (cached groups' first)
        self.followers: dict[int, list[int]] = {}  # a group's first row -> the rest
        self.plan_order = backend.config.request_order == "plan"
        self.groups = deque(run.plan.groups if self.plan_order else ())
        if not self.plan_order:  # the table's order
            rows = [request.planned.rows[0] for request in run.requests]
            self.released.extend(sorted(range(len(rows)), key=rows.__getitem__))
        self.capacity = backend.cache_tokens if self.plan_order else None
        self.held = 0  # tokens of the groups' prefixes and the requests in flight
        self.group_left: dict[int, int] = {}  # groups started and not ended: requests left
        self.started = time.perf_counter()
        self.failures_before = dict(self.endpoint.failures)
        self.usage = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        self.profile: dict[str, Any] = {
            "requests": 0,
            "first_rows": 0,
            "scoring_requests": 0,
            "cache_tokens": self.capacity,
            "max_groups_in_flight": 0,
        }

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> bool:
        unanswered = self.run.unanswered
        self._submit()
        if not self.futures:
            return self.run.unanswered < unanswered
        self._read(self.answers.get())
        while True:  # whatever else came back meanwhile
            try:
                self._read(self.answers.get_nowait())
            except queue.Empty:
                return True

    def close(self) -> None:
        for future in list(self.futures):  # stopped early: the server need not finish them
            future.cancel()
        failures = dict(self.endpoint.failures)
        retried = {k: n - self.failures_before.get(k, 0) for k, n in failures.items()}
        self.profile.update(
            seconds=time.perf_counter() - self.started,
            retries=sum(retried.values()),
            retried=retried,
            usage=dict(self.usage),
        )
        self.backend.last_profile = self.profile

    # -- sending -----------------------------------------------------------------------
    def _submit(self) -> None:
        requests = self.run.requests
        while len(self.futures) < self.backend.config.max_concurrency:
            if self.released:
                request_id = self.released[0]
                if requests[request_id].done:
                    self.released.popleft()
                elif self._fits(self._own_tokens(request_id)):
                    self.released.popleft()
                    self._send(request_id)
                else:
                    return
                continue
            if not self.groups:
                return
            group = self.groups[0]
            members = [i for i in group.request_ids if not requests[i].done]
            if members and not self._fits(group.prefix_length + self._own_tokens(members[0])):
                return  # the next wave starts when a group ends (none in flight: it fits)
            self.groups.popleft()
            self.held += group.prefix_length
            self.group_left[group.group_id] = len(members)
            self.profile["max_groups_in_flight"] = max(
                self.profile["max_groups_in_flight"], len(self.group_left)
            )
            if group.prefix_length > 0 and len(members) > 1:
                self.followers[members[0]] = members[1:]
                self.profile["first_rows"] += 1
                self._send(members[0])
            else:
                self.released.extend(members)
            self._group_answered(group.group_id, 0)  # ends a group with nothing to send

    def _fits(self, tokens: int) -> bool:
        return self.capacity is None or not self.futures or self.held + tokens <= self.capacity

    def _own_tokens(self, request_id: int) -> int:
        """A request's tokens beyond its group's prefix: its prompt's rest and its growth."""
        request = self.run.requests[request_id]
        planned = request.planned
        return len(planned.token_ids) - planned.group_prefix_length + request.params.max_tokens

    def _group_answered(self, group_id: int, answered: int = 1) -> None:
        """Count a group's answered requests; its prefix leaves ``held`` when none is left."""
        self.group_left[group_id] -= answered
        if self.group_left[group_id] == 0:
            del self.group_left[group_id]
            self.held -= self.run.plan.groups[group_id].prefix_length

    def _send(self, request_id: int, generated: tuple[list[int], str, str] | None = None) -> None:
        """Send a row's request: its generation, or the score of its ``forced`` tokens (a
        choice's) or of ``generated`` (a constrained row's completion, with logprobs)."""
        request = self.run.requests[request_id]
        backend = self.backend
        scored = tuple(generated[0]) if generated else request.forced
        flight = _Flight(request_id, scored, generated)
        if scored is not None:
            path = "/completions"
            body = bodies.scoring_body(backend.served.model, request.planned.token_ids, scored)
            self.profile["scoring_requests"] += 1
        else:
            path, body = bodies.request_body(
                backend.served, backend.api, request, self.run, backend.max_context
            )
        self.held += self._own_tokens(request_id)
        self.profile["requests"] += 1
        first = None  # a group's first row: its first chunk (its prompt is cached) frees the rest
        if request_id in self.followers and generated is None:
            first = functools.partial(self.answers.put, (PREFILLED, request_id))
        future = self.endpoint.run(self.endpoint.post(path, body, first))
        self.futures.add(future)
        future.add_done_callback(lambda future: self.answers.put((flight, future)))

    # -- reading answers ---------------------------------------------------------------
    def _read(self, item) -> None:
        flight, future = item
        if flight is PREFILLED:  # a group's first row is computing its tokens: the rest go
            self.released.extendleft(reversed(self.followers.pop(future, ())))
            return
        self.futures.discard(future)
        request_id = flight.request_id
        self.held -= self._own_tokens(request_id)
        error = future.exception()
        if error is None:
            answer = future.result()
            self._count_usage(answer)
            try:
                self._answer(flight, answer)
            except bodies.BadAnswer as bad:
                self.run.fail(request_id, f"model server: {bad}")
        elif isinstance(error, RequestFailed):
            self.run.fail(request_id, str(error))
        else:  # nothing the retries know: still this row's error, not the run's
            self.run.fail(request_id, f"model server: {type(error).__name__}: {error}")
        self.released.extendleft(reversed(self.followers.pop(request_id, ())))
        if self.plan_order and self.run.requests[request_id].done:
            self._group_answered(self.run.requests[request_id].planned.group_id)

    def _count_usage(self, answer: dict[str, Any]) -> None:
        usage = answer.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.usage["prompt_tokens"] += prompt
        self.usage["cached_tokens"] += cached
        self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        self.run.prefill_tokens += prompt - cached
        self.run.usage = dict(self.usage)

    def _answer(self, flight: _Flight, answer: dict[str, Any]) -> None:
        run = self.run
        request = run.requests[flight.request_id]
        if flight.scored is not None:
            prompt_length = len(request.planned.token_ids)
            logprob = bodies.scored_logprob(answer, prompt_length, flight.scored)
            completion = flight.generated or (flight.scored, "length", "")  # else: a choice's
            run.replay(request.request_id, *completion, logprob)
            return
        completion = bodies.read_answer(answer, self.backend.api, self.backend.tokenizer)
        tokens, reason, text = read_completion(run, request, *completion[:3])
        logprob = None
        if request.params.logprobs and request.constraint is None:
            logprob = bodies.sum_logprobs(completion, len(tokens))
        elif request.params.logprobs and tokens:  # renormalized under the mask: score it
            self._send(request.request_id, (tokens, reason, text))
            return
        elif request.params.logprobs:
            logprob = 0.0
        run.replay(request.request_id, tokens, reason, text, logprob)
