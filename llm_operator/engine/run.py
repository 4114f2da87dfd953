"""One run of a plan: per-request state, and the loop every backend shares.

A backend is a step runner (nano-vllm style). ``backend.start(run)`` returns its steps
for this run; each ``steps.step()`` schedules what runs, runs the model and hands the
tokens back through ``run.sample`` / ``run.append`` (or, for an engine that returns
whole completions, ``run.replay``). The run owns everything else once: each request's
sampling parameters, generator and stop tracking (``RowDecoder``), the outputs, error
rows, progress and the token counts.

    run = Run(plan, params, tokenizer=..., eos_token_ids=..., max_context=...)
    result = run_plan(backend, run)       # BackendResult, one output per planned request

Request index map: ``run.requests[request_id]`` is ``plan.requests[request_id]``'s state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from llm_operator.engine.base import BackendResult, ProgressCallback, RequestOutput
from llm_operator.engine.stopping import RowDecoder
from llm_operator.planner import Plan, PlannedRequest
from llm_operator.sampling import SamplingParams, row_seed, sample_next_tokens


class Request:
    """A planned request's state: what it samples with, what it has produced."""

    __slots__ = ("planned", "params", "generator", "decoder", "output")

    def __init__(
        self,
        planned: PlannedRequest,
        params: SamplingParams,
        generator: torch.Generator | None,
        decoder: RowDecoder,
    ) -> None:
        self.planned = planned
        self.params = params
        self.generator = generator  # seeded rows only: derived from seed and prompt
        self.decoder = decoder
        self.output: RequestOutput | None = None

    @property
    def request_id(self) -> int:
        return self.planned.request_id

    @property
    def done(self) -> bool:
        return self.output is not None


class Run:
    """The requests of one plan and their outputs.

    params: one ``SamplingParams`` per planned request (``plan.requests`` order).
    generators: one per planned request (None: derived with ``request_generators``).
    progress(finished_rows, new_output_tokens) is called as tokens and rows come in.
    """

    def __init__(
        self,
        plan: Plan,
        params: Sequence[SamplingParams],
        *,
        tokenizer,
        eos_token_ids: Collection[int],
        max_context: int,
        generators: Sequence[torch.Generator | None] | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        assert len(params) == len(plan.requests), "one SamplingParams per planned request"
        if generators is None:
            generators = request_generators(plan, params)
        self.plan = plan
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.progress = progress
        self.requests = [
            Request(
                planned,
                p,
                generator,
                RowDecoder(tokenizer, p, self.eos_token_ids, len(planned.token_ids), max_context),
            )
            for planned, p, generator in zip(plan.requests, params, generators)
        ]
        self.unanswered = len(self.requests)
        self.prefill_tokens = 0  # prompt tokens run through the model (backends add to it)
        self.output_tokens = 0

    @property
    def done(self) -> bool:
        """Every request has an output."""
        return self.unanswered == 0

    # -- what backends call ------------------------------------------------------------
    def sample(self, logits: torch.Tensor, request_ids: Sequence[int]) -> list[int]:
        """One next token per request from its logits row (logits: [len(request_ids), vocab])."""
        requests = [self.requests[i] for i in request_ids]
        return sample_next_tokens(
            logits, [r.params for r in requests], [r.generator for r in requests]
        ).tolist()

    def append(self, request_id: int, token: int) -> bool:
        """Add a generated token; True when the request has finished (its output is set)."""
        request = self.requests[request_id]
        self.output_tokens += 1
        if not request.decoder.append(token):
            self._report(0, 1)
            return False
        decoder = request.decoder
        self._set(request, RequestOutput(tuple(decoder.token_ids), decoder.final_text(),
                                         decoder.finish_reason), new_tokens=1)  # fmt: skip
        return True

    def replay(self, request_id: int, token_ids: Sequence[int], reason: str, text: str) -> None:
        """A whole completion from an engine that stopped by itself (``reason``: its
        finish reason, ``text``: its text); our stop rules cut it where they end it."""
        request = self.requests[request_id]
        decoder = request.decoder
        for token in token_ids:
            if decoder.append(token):
                break
        self.output_tokens += len(decoder.token_ids)
        if decoder.finish_reason is None:  # the engine stopped first (its EOS, its context)
            output = RequestOutput(tuple(decoder.token_ids), text, reason)
        else:
            output = RequestOutput(
                tuple(decoder.token_ids), decoder.final_text(), decoder.finish_reason
            )
        self._set(request, output, new_tokens=len(decoder.token_ids))

    def fail(self, request_id: int, message: str) -> None:
        """The request cannot run: its rows become error rows with ``message``."""
        request = self.requests[request_id]
        self._set(request, RequestOutput((), "", "error", message), new_tokens=0)

    def result(self) -> BackendResult:
        unanswered = [r.request_id for r in self.requests if r.output is None]
        assert not unanswered, f"requests {unanswered[:10]} have no output"
        return BackendResult(
            [r.output for r in self.requests], self.prefill_tokens, self.output_tokens
        )

    def _set(self, request: Request, output: RequestOutput, *, new_tokens: int) -> None:
        assert request.output is None, f"request {request.request_id} answered twice"
        request.output = output
        self.unanswered -= 1
        self._report(len(request.planned.rows), new_tokens)

    def _report(self, finished_rows: int, new_tokens: int) -> None:
        if self.progress is not None:
            self.progress(finished_rows, new_tokens)


class Steps(Protocol):
    """A backend's work on one run."""

    def step(self) -> bool:
        """One iteration; False when there was nothing left to run."""
        ...

    def close(self) -> None:
        """Free what the run held (KV pools, in-flight engine requests)."""
        ...


class Backend(Protocol):
    name: str

    def start(self, run: Run) -> Steps: ...


def run_plan(backend: Backend, run: Run) -> BackendResult:
    """Step the backend until every request of the run has an output."""
    if not run.done:
        steps = backend.start(run)
        try:
            while not run.done:
                if not steps.step():
                    raise AssertionError(
                        f"backend {backend.name!r} stopped with {run.unanswered} requests unanswered"
                    )
        finally:
            steps.close()
    return run.result()


def request_generators(
    plan: Plan, params: Sequence[SamplingParams]
) -> list[torch.Generator | None]:
    """A generator per planned request: a seeded, sampled request draws from one derived
    from its seed, its prompt and which occurrence of that (seed, prompt) it is among the
    plan's rows in input order, so it samples the same tokens in any batch or partition."""
    row_request: dict[int, PlannedRequest] = {}
    for request in plan.requests:
        for row in request.rows:
            row_request[row] = request
    seen: Counter = Counter()
    occurrence: dict[int, int] = {}  # first plan row of a seeded request -> occurrence
    for row in sorted(row_request):
        request = row_request[row]
        seed = params[request.request_id].seed
        if seed is not None:
            key = (seed, tuple(request.token_ids))
            occurrence[row] = seen[key]
            seen[key] += 1
    generators: list[torch.Generator | None] = []
    for request, p in zip(plan.requests, params):
        if p.seed is None or p.greedy:
            generators.append(None)
            continue
        generator = torch.Generator()
        generator.manual_seed(row_seed(p.seed, request.token_ids, occurrence[request.rows[0]]))
        generators.append(generator)
    return generators
