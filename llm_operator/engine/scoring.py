"""Choice scores: rows asking for ``choices`` with ``logprobs`` get one scoring request per
choice, planned with the rows (they share the row's prompt), that feeds the choice's tokens
instead of sampling; their log-probabilities become the row's ``choice_logprobs``.

``add_scoring`` extends a batch's token ids and parameters with those requests (after the
user's rows); ``forced_tokens`` says what each planned scoring request feeds;
``row_results`` reads the outputs back into one ``GenerationResult`` per user row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from llm_operator.engine.base import BackendResult
from llm_operator.planner import Plan
from llm_operator.prompts.encode import PreparedPrompts
from llm_operator.results import GenerationResult
from llm_operator.sampling import SamplingParams


class Scoring(NamedTuple):
    row: int  # the user's row
    choice: str
    token_ids: tuple[int, ...]  # the choice's tokens


def add_scoring(prepared: PreparedPrompts, constraints) -> tuple[list, list, list[Scoring]]:
    """(token ids, params, scorings): the user's rows, then one scoring request per choice
    of each valid row asking for choices and logprobs (``constraints``: the operator's
    ``Constraints``, or None when no row is constrained)."""
    scoring: list[Scoring] = []
    if constraints is not None:
        for row, (ids, p) in enumerate(zip(prepared.token_ids, prepared.params)):
            if ids is not None and p.choices is not None and p.logprobs:
                trie = constraints.trie(p.choices)
                tokens = constraints.choice_tokens(p.choices)
                scoring.extend(Scoring(row, c, tuple(t)) for c, t in zip(trie.choices, tokens))
    token_ids = [*prepared.token_ids, *(prepared.token_ids[s.row] for s in scoring)]
    params = [
        *prepared.params,
        *(SamplingParams(max_tokens=len(s.token_ids), ignore_eos=True) for s in scoring),
    ]
    return token_ids, params, scoring


def forced_tokens(plan: Plan, valid: Sequence[int], scoring: Sequence[Scoring], rows: int):
    """request_id -> the tokens a planned scoring request feeds (plan rows map to input
    rows through ``valid``; input rows from ``rows`` on are the scoring requests)."""
    return {
        r.request_id: scoring[valid[r.rows[0]] - rows].token_ids
        for r in plan.requests
        if valid[r.rows[0]] >= rows
    }


def row_results(
    prepared: PreparedPrompts,
    plan: Plan,
    valid: Sequence[int],
    outputs: BackendResult,
    scoring: Sequence[Scoring],
) -> list[GenerationResult]:
    """One result per user row, in input order: error rows, generated rows, and the
    choice scores of rows that asked for them."""
    rows = len(prepared.token_ids)
    results: list[GenerationResult | None] = [None] * rows
    scores: dict[int, dict[str, float]] = {}
    for row, message in prepared.errors.items():
        results[row] = GenerationResult.failed(message)
    for request, output in zip(plan.requests, outputs.outputs):
        for plan_row in request.rows:
            row = valid[plan_row]
            if row >= rows:
                source = scoring[row - rows]
                scores.setdefault(source.row, {})[source.choice] = output.logprob
            else:
                results[row] = GenerationResult.of(output, len(request.token_ids))
    for row, choice_logprobs in scores.items():
        results[row] = results[row]._replace(choice_logprobs=choice_logprobs)
    assert all(r is not None for r in results), "every row has a result"
    return results
