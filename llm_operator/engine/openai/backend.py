"""The ``openai`` backend: rows sent to an OpenAI-compatible server (vLLM, SGLang, a
hosted endpoint) in plan order, so the server's prefix cache hits.

The server brings the model; the plan brings the order (``request_order="plan"``):

- each prefix group's first row goes first, alone, streamed: its prefill puts the shared
  prefix in the server's cache, and once its first token arrives (the prefill is done)
  the rest of the group follows, concurrently;
- decode-first: rows of a group whose prefix is cached (its first row answered) go before
  new groups, and new groups start in the plan's order (most decode work first);
- at most ``max_concurrency`` requests are in flight per operator (per Spark or Dask
  worker), the slots a waiting group leaves filled by the next groups;
- waves, where the server says its KV cache size (a vLLM server's ``/metrics``): a new
  group starts only while the prefixes of the groups in flight, its own and every
  request in flight (its prompt past the prefix and its ``max_tokens``) fit the cache,
  so the server's LRU does not evict a prefix whose group has not ended (without that,
  groups started together evict each other's prefixes in a small cache).

``request_order="table"`` sends the rows in the table's order at the same concurrency,
as SynapseML's ``OpenAIPrompt`` and ``ai_query`` do (an ablation, for comparison).

Requests (``requests.completion_body``): with ``api="completions"`` (the default for a
vLLM server) the prompt goes as the token ids the plan was built from (chat template
applied here), so the server computes exactly the planned tokens; vLLM returns the
completion's token ids, and its structured outputs (``choices``, ``regex``, ``json_schema``
as its grammar) and log-probabilities are asked for as the ``vllm`` backend asks its
engine. ``api="chat"`` sends the rows' messages to ``/chat/completions`` (a string prompt
as one user message) for servers without the completions API; there ``json_schema``
becomes OpenAI's ``response_format`` and the tokens are the text's tokenization.

Faults (``client.Endpoint``): retries with backoff and ``Retry-After``; a row that still
fails gets an error naming the status and the server's message; no other row is touched.
Usage (prompt, cached and completion tokens) adds up into the run's ``usage`` and so
into ``RunStats``.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any, NamedTuple

from llm_operator.config import EngineConfig
from llm_operator.engine.completions import read_completion
from llm_operator.engine.openai import requests as bodies
from llm_operator.engine.openai.client import RequestFailed, endpoint_for
from llm_operator.engine.run import Request, Run

PREFILLED = object()  # on the answers queue with a request id: its first chunk arrived


class _Flight(NamedTuple):
    """A request in flight: its run request, and what it scores (None: its generation;
    else (tokens, the generated row's (tokens, reason, text) or None))."""

    request_id: int
    scoring: tuple[tuple[int, ...], tuple[list[int], str, str] | None] | None = None


class OpenAIBackend:
    """Runs plans against one server (probed when built: a wrong address, key or model
    fails here, before any row is sent)."""

    name = "openai"

    def __init__(self, config: EngineConfig, tokenizer, *, max_context: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.endpoint = endpoint_for(config)
        try:
            self.served = self.endpoint.probe(config.server_model)
        except BaseException:
            self.endpoint.close()
            raise
        api = config.api
        if api == "auto":
            api = "completions" if self.served.kind == "vllm" else "chat"
        self.api = api
        # the server's KV cache in tokens, where it says (waves; module doc)
        self.cache_tokens = self.endpoint.cache_tokens() if self.served.kind == "vllm" else None
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
        self.limit = backend.config.max_concurrency
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight = 0
        self.futures: set = set()  # the requests in flight (cancelled if the run stops early)
        self.released: deque[int] = deque()  # rows free to go (cached groups' first)
        self.followers: dict[int, list[int]] = {}  # a group's first row -> the rest
        requests = run.requests
        if backend.config.request_order == "table":
            order = sorted(range(len(requests)), key=lambda i: requests[i].planned.rows[0])
            self.released.extend(order)
            self.groups: deque = deque()
        else:
            self.groups = deque(run.plan.groups)
        self.plan_order = backend.config.request_order == "plan"
        self.capacity = backend.cache_tokens if self.plan_order else None
        self.held = 0  # tokens of the groups' prefixes and the requests in flight
        # the groups started and not ended: their requests not answered
        self.group_left: dict[int, int] = {}
        self.started = time.perf_counter()
        self.retries_before = backend.endpoint.retries
        self.failures_before = dict(backend.endpoint.failures)
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
        if self.in_flight == 0:
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
        self.profile.update(
            seconds=time.perf_counter() - self.started,
            retries=self.endpoint.retries - self.retries_before,
            retried={k: n - self.failures_before.get(k, 0) for k, n in failures.items()},
            usage=dict(self.usage),
        )
        self.backend.last_profile = self.profile

    # -- sending -----------------------------------------------------------------------
    def _submit(self) -> None:
        requests = self.run.requests
        while self.in_flight < self.limit:
            if self.released:
                request_id = self.released[0]
                if requests[request_id].done:
                    self.released.popleft()
                elif self._fits(self._own_tokens(request_id)):
                    self.released.popleft()
                    self._send(_Flight(request_id))
                else:
                    return
                continue
            if not self.groups:
                return
            group = self.groups[0]
            members = [i for i in group.request_ids if not requests[i].done]
            if (
                members
                and self.group_left
                and not self._fits(group.prefix_length + self._own_tokens(members[0]))
            ):
                return  # the next wave starts when a group ends
            self.groups.popleft()
            self.held += group.prefix_length
            self.group_left[group.group_id] = len(members)
            self.profile["max_groups_in_flight"] = max(
                self.profile["max_groups_in_flight"], len(self.group_left)
            )
            if group.prefix_length > 0 and len(members) > 1:
                self.followers[members[0]] = members[1:]
                self.profile["first_rows"] += 1
                self._send(_Flight(members[0]))
            else:
                self.released.extend(members)
            if not members:
                self._group_done(group.group_id)

    def _fits(self, tokens: int) -> bool:
        return self.capacity is None or self.in_flight == 0 or self.held + tokens <= self.capacity

    def _own_tokens(self, request_id: int) -> int:
        """A request's tokens beyond its group's prefix: its prompt's rest and its growth."""
        planned = self.run.requests[request_id].planned
        growth = self.run.requests[request_id].params.max_tokens
        return len(planned.token_ids) - planned.group_prefix_length + growth

    def _answered(self, group_id: int) -> None:
        self.group_left[group_id] -= 1
        if self.group_left[group_id] == 0:
            self._group_done(group_id)

    def _group_done(self, group_id: int) -> None:
        del self.group_left[group_id]
        self.held -= self.run.plan.groups[group_id].prefix_length

    def _send(self, flight: _Flight) -> None:
        request = self.run.requests[flight.request_id]
        backend = self.backend
        tokens = _scored(flight, request)
        if tokens is not None:
            path, body = (
                "/completions",
                bodies.scoring_body(backend.served.model, request.planned.token_ids, tokens),
            )
            self.profile["scoring_requests"] += 1
        else:
            path, body = bodies.request_body(
                backend.api,
                backend.served.model,
                request,
                self.run,
                kind=backend.served.kind,
                max_context=backend.max_context,
            )
        self.in_flight += 1
        self.held += self._own_tokens(flight.request_id)
        self.profile["requests"] += 1

        def answered(future, flight=flight) -> None:
            self.answers.put((flight, future))

        first = None
        if flight.request_id in self.followers and flight.scoring is None:  # a group's first

            def first(request_id=flight.request_id) -> None:  # its prompt is in the cache
                self.answers.put((PREFILLED, request_id))

        future = self.endpoint.run(self.endpoint.post(path, body, first))
        self.futures.add(future)
        future.add_done_callback(answered)

    # -- reading answers ---------------------------------------------------------------
    def _read(self, item) -> None:
        flight, future = item
        if flight is PREFILLED:  # a group's first row is computing its tokens: the rest go
            self.released.extendleft(reversed(self.followers.pop(future, ())))
            return
        self.in_flight -= 1
        self.futures.discard(future)
        request_id = flight.request_id
        self.held -= self._own_tokens(request_id)
        error = future.exception()
        if error is None:
            answer = future.result()
            self._count_usage(answer)
            try:
                self._answer(flight, self.run.requests[request_id], answer)
            except bodies.BadAnswer as bad:
                self.run.fail(request_id, f"model server: {bad}")
        elif isinstance(error, RequestFailed):
            self.run.fail(request_id, str(error))
        else:  # nothing the retries know: still this row's error, not the run's
            self.run.fail(request_id, f"model server: {type(error).__name__}: {error}")
        self.released.extendleft(reversed(self.followers.pop(request_id, ())))
        if self.plan_order and self.run.requests[request_id].done:
            self._answered(self.run.requests[request_id].planned.group_id)

    def _count_usage(self, answer: dict[str, Any]) -> None:
        usage = answer.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.usage["prompt_tokens"] += prompt
        self.usage["cached_tokens"] += cached
        self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        self.run.prefill_tokens += prompt - cached
        self.run.usage = dict(self.usage)

    def _answer(self, flight: _Flight, request: Request, answer: dict[str, Any]) -> None:
        run = self.run
        tokens = _scored(flight, request)
        if tokens is not None:
            logprob = bodies.scored_logprob(answer, len(request.planned.token_ids), tokens)
            if flight.scoring is None or flight.scoring[1] is None:
                run.replay(request.request_id, tokens, "length", "", logprob)
            else:
                run.replay(request.request_id, *flight.scoring[1], logprob)
            return
        completion = bodies.read_answer(answer, self.backend.api, self.backend.tokenizer)
        tokens, reason, text = read_completion(
            run, request, completion.token_ids, completion.finish_reason, completion.text
        )
        logprob = None
        if request.params.logprobs and request.constraint is None:
            logprob = bodies.sum_logprobs(completion, len(tokens))
        elif request.params.logprobs and tokens:  # renormalized under the mask: score it
            self._send(_Flight(request.request_id, (tuple(tokens), (tokens, reason, text))))
            return
        elif request.params.logprobs:
            logprob = 0.0
        run.replay(request.request_id, tokens, reason, text, logprob)


def _scored(flight: _Flight, request: Request) -> tuple[int, ...] | None:
    """The tokens a flight scores (a constrained row's after its generation, a choice's),
    or None for a generation."""
    return flight.scoring[0] if flight.scoring else request.forced
