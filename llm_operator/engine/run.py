"""One run of a plan: per-request state, and the loop every backend shares.

A backend is a step runner (nano-vllm style). ``backend.start(run)`` returns its steps
for this run; each ``steps.step()`` schedules what runs, runs the model and hands the
tokens back through ``run.sample`` / ``run.append`` (or, for an engine that returns
whole completions, ``run.replay``). The run owns everything else once: each request's
sampling parameters, sampling seed and stop tracking (``RowDecoder``), the outputs, error
rows, progress and the token counts.

    run = Run(plan, params, tokenizer=..., eos_token_ids=..., max_context=...)
    result = run_plan(backend, run)       # BackendResult, one output per planned request

Request index map: ``run.requests[request_id]`` is ``plan.requests[request_id]``'s state.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from llm_operator.engine.base import BackendResult, ProgressCallback, RequestOutput
from llm_operator.engine.sampler import row_seed, row_step_key, sample_tokens
from llm_operator.engine.stopping import RowDecoder
from llm_operator.planner import Plan, PlannedRequest
from llm_operator.sampling import SamplingParams


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


@dataclass(eq=False, slots=True)
class Request:
    """A planned request's state: what it samples with, what it has produced."""

    planned: PlannedRequest
    params: SamplingParams
    seed: int | None  # sampled rows only: derived from seed and prompt (``request_seeds``)
    decoder: RowDecoder
    constraint: Any = None  # constraints.ChoiceState | GrammarState | None
    forced: tuple[int, ...] | None = None  # scoring requests: the tokens to feed (and score)
    logprob: float = 0.0  # unconstrained log-probability of the tokens so far
    output: RequestOutput | None = None
    jumped: list[int] = field(default_factory=list)  # jump-forward's, after the last sample
    # no constraint, forced tokens, logprobs or stop strings: ``Run.append_plain`` applies
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain = not self.special and not self.params.stop

    @property
    def special(self) -> bool:
        """Whether sampling needs more than the sampler: a mask, forced tokens, logprobs."""
        return self.constraint is not None or self.forced is not None or self.params.logprobs

    @property
    def request_id(self) -> int:
        return self.planned.request_id

    @property
    def done(self) -> bool:
        return self.output is not None


class Run:
    """The requests of one plan and their outputs.

    params: one ``SamplingParams`` per planned request (``plan.requests`` order).
    seeds: one per planned request (None: derived with ``request_seeds``).
    progress(finished_rows, new_output_tokens) is called as tokens and rows come in.
    constraints: compiles ``choices``/``regex``/``json_schema`` (needed when any row has one).
    forced: request_id -> tokens a scoring request feeds instead of sampling; its output's
        ``logprob`` is their log-probability after the prompt.
    sources: the prompt (text or chat messages) of each planned request, for a backend
        that sends prompts rather than token ids (``openai`` with api="chat").
    """

    def __init__(
        self,
        plan: Plan,
        params: Sequence[SamplingParams],
        *,
        tokenizer,
        eos_token_ids: Collection[int],
        max_context: int,
        seeds: Sequence[int | None] | None = None,
        progress: ProgressCallback | None = None,
        constraints=None,
        forced: dict[int, tuple[int, ...]] | None = None,
        sources: Sequence | None = None,
    ) -> None:
        assert len(params) == len(plan.requests), "one SamplingParams per planned request"
        if seeds is None:
            seeds = request_seeds(plan, params)
        self.plan = plan
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.progress = progress
        forced = forced or {}
        self.requests = [
            Request(
                planned,
                p,
                seed,
                RowDecoder(tokenizer, p, self.eos_token_ids, len(planned.token_ids), max_context),
                None if constraints is None else constraints.start(p, ignore_eos=p.ignore_eos),
                forced.get(planned.request_id),
            )
            for planned, p, seed in zip(plan.requests, params, seeds)
        ]
        assert constraints is not None or all(p.constraint is None for p in params), (
            "constrained rows need a Constraints"
        )
        self.unanswered = len(self.requests)
        self.all_plain = all(request.plain for request in self.requests)  # see append_plain
        self.all_greedy = self.all_plain and all(r.params.greedy for r in self.requests)
        self.prefill_tokens = 0  # prompt tokens run through the model (backends add to it)
        self.output_tokens = 0
        self.forced_tokens = 0  # output tokens appended without sampling (jump-forward)
        self.usage: dict[str, int] | None = None  # a model server's token counts (openai)
        # the prompt each planned request came from (a backend sending messages reads them)
        self.sources = sources

    @property
    def done(self) -> bool:
        """Every request has an output."""
        return self.unanswered == 0

    # -- what backends call ------------------------------------------------------------
    def sample(self, logits: torch.Tensor, request_ids: Sequence[int]) -> list[int]:
        """One next token per request from its logits row (logits: [len(request_ids), vocab]),
        sampled on the logits' device with one host sync (``sampler.sample_tokens``)."""
        if self.all_greedy:  # every row plain and greedy: the argmax, one copy
            return torch.argmax(logits, dim=-1).tolist()
        requests = [self.requests[i] for i in request_ids]
        special = [k for k, r in enumerate(requests) if r.special]
        keys = [
            None if r.seed is None else row_step_key(r.seed, len(r.decoder.token_ids))
            for r in requests
        ]
        if not special:
            return sample_tokens(logits, [r.params for r in requests], keys).tolist()
        logits = logits.float().clone()  # masked in place below
        # the unconstrained distribution, for logprobs and scoring
        scored = [k for k in special if requests[k].params.logprobs or requests[k].forced]
        log_probs = torch.log_softmax(logits[scored], dim=-1) if scored else None
        for k in special:
            if requests[k].constraint is not None:
                requests[k].constraint.mask(logits[k])
        tokens = sample_tokens(logits, [r.params for r in requests], keys).tolist()
        for k in special:
            request = requests[k]
            if request.forced is not None:
                tokens[k] = request.forced[len(request.decoder.token_ids)]
        for j, k in enumerate(scored):
            requests[k].logprob += float(log_probs[j, tokens[k]])
        return tokens

    def append_plain(self, request_ids: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """``append`` for many requests at once, where every one is ``plain`` (no
        constraint, forced tokens, logprobs or stop strings; the caller checks): whether
        each finished. Progress is reported once."""
        finished_flags = []
        finished_rows = 0
        requests = self.requests
        for request_id, token in zip(request_ids, tokens):
            request = requests[request_id]
            finished = request.decoder.append(token)
            if finished:
                finished_rows += self._answer(request, self._output(request))
            finished_flags.append(finished)
        self.output_tokens += len(finished_flags)
        if finished_flags:
            self._report(finished_rows, len(finished_flags))
        return finished_flags

    def append(self, request_id: int, token: int) -> bool:
        """Add a sampled token; True when the request has finished (its output is set).

        A constrained row may then have tokens appended without sampling (jump-forward,
        ``jumped``): the backend feeds them to the model with ``token`` before the row's
        next sample."""
        request = self.requests[request_id]
        request.jumped = []
        self.output_tokens += 1
        finished = request.decoder.append(token)
        if request.constraint is not None:
            request.constraint.accept(token)
            if not finished:
                finished = self._jump_forward(request)
        if not finished:
            self._report(0, 1 + len(request.jumped))
            return False
        self._set(request, self._output(request), new_tokens=1 + len(request.jumped))
        return True

    def jumped(self, request_id: int) -> list[int]:
        """The tokens jump-forward appended after the request's last sampled token (already
        in its output): the backend computes them, after that token, before sampling the
        row again (in one step where it can, like a small prefill chunk)."""
        return self.requests[request_id].jumped

    def _jump_forward(self, request: Request) -> bool:
        """Append the tokens a constrained row's constraint forces, without sampling; True
        when the row then ends. Not with logprobs: every returned token is then scored by
        a step (only a finished grammar, which needs no token, still ends the row).

        - decided to the end (all of a choice's tokens, a grammar's end): the row ends;
        - forced inside (``constraint.forced``: a lone trie child, the grammar's forced
          text): the tokens go through the stop rules one by one (``max_tokens`` cuts
          them), then the row samples on, or ends if it is decided."""
        constraint, decoder = request.constraint, request.decoder
        if not request.params.logprobs:
            room = decoder.max_tokens - len(decoder.token_ids)
            for token in constraint.forced(room):
                request.jumped.append(token)
                self.forced_tokens += 1
                self.output_tokens += 1
                finished = decoder.append(token)
                constraint.accept(token)
                if finished:
                    return True
        tokens = constraint.remaining()
        if tokens is None or (tokens and request.params.logprobs):
            return False
        room = decoder.max_tokens - len(decoder.token_ids)
        appended = tokens[:room]
        decoder.token_ids.extend(appended)
        decoder.finish_reason = "stop" if len(appended) == len(tokens) else "length"
        request.constraint.complete(appended if len(appended) == len(tokens) else [])
        request.jumped.extend(appended)
        self.forced_tokens += len(appended)
        self.output_tokens += len(appended)
        return True

    def replay(
        self,
        request_id: int,
        token_ids: Sequence[int],
        reason: str,
        text: str,
        logprob: float | None = None,
    ) -> None:
        """A whole completion from an engine that stopped by itself (``reason``: its
        finish reason, ``text``: its text, ``logprob``: its tokens' log-probability);
        our stop rules cut it where they end it."""
        request = self.requests[request_id]
        decoder = request.decoder
        for token in token_ids:
            finished = decoder.append(token)
            if request.constraint is not None:
                request.constraint.accept(token)
            if finished:
                break
        self.output_tokens += len(decoder.token_ids)
        request.logprob = logprob or 0.0
        if decoder.finish_reason is None:  # the engine stopped first (its EOS, its context)
            decoder.end_with(reason, text)
        self._set(request, self._output(request), new_tokens=len(decoder.token_ids))

    def _output(self, request: Request) -> RequestOutput:
        """The finished request's output: its text, and for a constrained row the choice it
        made or why its output is not valid (the partial text is kept)."""
        decoder = request.decoder
        text = decoder.final_text()
        error = None
        if request.constraint is not None:
            chosen, error = request.constraint.result(text)
            text = chosen if chosen is not None else text
        logprob = request.logprob if (request.params.logprobs or request.forced) else None
        return RequestOutput(tuple(decoder.token_ids), text, decoder.finish_reason, error, logprob)

    def fail(self, request_id: int, message: str) -> None:
        """The request cannot run: its rows become error rows with ``message``."""
        request = self.requests[request_id]
        self._set(request, RequestOutput((), "", "error", message), new_tokens=0)

    def result(self) -> BackendResult:
        unanswered = [r.request_id for r in self.requests if r.output is None]
        assert not unanswered, f"requests {unanswered[:10]} have no output"
        return BackendResult(
            [r.output for r in self.requests], self.prefill_tokens, self.output_tokens, self.usage
        )

    def _set(self, request: Request, output: RequestOutput, *, new_tokens: int) -> None:
        self._report(self._answer(request, output), new_tokens)

    def _answer(self, request: Request, output: RequestOutput) -> int:
        """Set the request's output; returns the user's rows it finishes."""
        assert request.output is None, f"request {request.request_id} answered twice"
        request.output = output
        self.unanswered -= 1
        # a scoring request (a choice fed to score it) finishes no row of the user's
        return 0 if request.forced is not None else len(request.planned.rows)

    def _report(self, finished_rows: int, new_tokens: int) -> None:
        if self.progress is not None:
            self.progress(finished_rows, new_tokens)


def run_plan(backend: Backend, run: Run) -> BackendResult:
    """Step the backend until every request of the run has an output."""
    if not run.done:
        # The objects alive now (the model, the plan, the prompts) are left out of the
        # garbage collector's scans for the run: a step over a thousand rows allocates
        # enough to trigger collections, which would walk them all every time.
        gc.freeze()
        try:
            steps = backend.start(run)
            try:
                while not run.done:
                    if not steps.step():
                        raise AssertionError(
                            f"backend {backend.name!r} stopped with {run.unanswered} requests "
                            "unanswered"
                        )
            finally:
                steps.close()
        finally:
            gc.unfreeze()
    return run.result()


def request_seeds(plan: Plan, params: Sequence[SamplingParams]) -> list[int | None]:
    """A sampling seed per planned request (None for greedy ones): a seeded request's
    derives from its seed, its prompt and which occurrence of that (seed, prompt) it is
    among the plan's rows in input order, so it samples the same tokens in any batch or
    partition; an unseeded sampled request draws one from torch's global generator."""
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
    seeds: list[int | None] = []
    for request, p in zip(plan.requests, params):
        if p.greedy:
            seeds.append(None)
        elif p.seed is None:
            seeds.append(int(torch.randint(0, 2**62, ()).item()))
        else:
            seeds.append(row_seed(p.seed, request.token_ids, occurrence[request.rows[0]]))
    return seeds
