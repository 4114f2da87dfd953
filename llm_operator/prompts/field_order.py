"""Choosing the field order that shares the most prompt prefix over a whole table.

The cost model: with global prefix sharing the rows' prompts form a prefix tree, and
every piece of text is computed once per distinct value of everything before it and
itself. A prompt's pieces (``TablePrompt.pieces``) in order cost, in characters,

    literal text   len(text)       x D(fields before it)
    {field}        mean_chars(f)   x D(fields before it, and f)

where D(S) is the number of distinct value combinations of the field set S over the
table (D of no fields is 1). Their sum is the estimated prefill; without sharing it
is rows x the mean prompt length. Only distinct counts of field *sets* and mean
lengths are needed: aggregates a cluster computes without collecting rows (distinct
value hashes per field set counted in one job on Spark and Dask, an Arrow group-by here).

Choosing: each block of movable lines (``TablePrompt.blocks``) is ordered on its own,
after the fixed part before it, by an exact dynamic program over the subsets of its
fields (Held-Karp style: best(S) = min over f in S of best(S - f) + the cost of f's
line placed after S - f), which needs D of (fields before the block) + S for every
subset S: 2^k sets for k movable fields, all in the same pass. Blocks of more than
``EXHAUSTIVE_FIELDS`` fields are ordered greedily instead (Liu et al.'s GGR in spirit:
the field that adds the fewest distinct combinations first, longer values on ties),
one pass per position. Ties keep the user's order. One order serves every row, so
every prompt has the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Protocol

from llm_operator.prompts.table import Field, TablePrompt, field_texts

EXHAUSTIVE_FIELDS = 8
"""Blocks of up to this many movable fields are ordered exactly (2^k distinct counts)."""


class FieldStatistics(Protocol):
    """What choosing an order needs to know about a table (per engine). ``rows`` and
    ``mean_chars`` may be filled by the first ``distinct`` call (one pass for all)."""

    rows: int
    mean_chars: Mapping[str, float]  # mean length of each field's rendered text
    exact: bool  # distinct counts exact (else sketches, within a few per cent)

    def distinct(self, sets: Sequence[frozenset[str]]) -> Mapping[frozenset[str], int]:
        """D(S) for each set (one pass over the data per call)."""


@dataclass
class FieldPlan:
    """The order chosen for a table, and the estimates that chose it."""

    given: TablePrompt
    chosen: TablePrompt
    rows: int
    distinct_prompts: int  # D(all fields): what dedupe computes
    given_chars: float  # estimated prefill characters, given order
    chosen_chars: float  # ... chosen order
    total_chars: float  # rows x mean prompt length: the prefill without any sharing
    exact: bool
    passes: int  # passes over the data the statistics took

    @property
    def given_fields(self) -> tuple[str, ...]:
        return self.given.fields

    @property
    def chosen_fields(self) -> tuple[str, ...]:
        return self.chosen.fields

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "distinct_prompts": self.distinct_prompts,
            "given_fields": list(self.given_fields),
            "chosen_fields": list(self.chosen_fields),
            "movable_fields": list(self.given.movable),
            "estimated_prefill_chars": {
                "none_shared": round(self.total_chars),
                "given_order": round(self.given_chars),
                "chosen_order": round(self.chosen_chars),
            },
            "statistics": "exact" if self.exact else "approximate (HyperLogLog)",
            "passes": self.passes,
        }

    def report(self) -> str:
        def share(chars: float) -> str:
            return f"{1 - chars / self.total_chars:.1%}" if self.total_chars else "n/a"

        approx = "" if self.exact else "~"
        return "\n".join(
            [
                f"table: {self.rows} rows, {approx}{self.distinct_prompts} distinct prompts",
                f"given order:  {', '.join(self.given_fields)}  "
                f"(estimated prefix sharing {share(self.given_chars)})",
                f"chosen order: {', '.join(self.chosen_fields)}  "
                f"(estimated prefix sharing {share(self.chosen_chars)})",
            ]
        )


@dataclass
class _Counts:
    """D(S) cache over one statistics source; counts passes."""

    stats: FieldStatistics
    known: dict[frozenset[str], int] = field(default_factory=dict)
    passes: int = 0

    def fetch(self, sets: Sequence[frozenset[str]]) -> None:
        wanted = list(dict.fromkeys(s for s in sets if s and s not in self.known))
        if wanted:
            counts = self.stats.distinct(wanted)
            self.passes += 1
            for s in wanted:
                self.known[s] = max(1, min(int(counts[s]), self.stats.rows))
            self._monotone()
        self.known[frozenset()] = 1

    def _monotone(self) -> None:
        """A set has at least as many distinct combinations as any of its subsets (so an
        approximate count cannot make a field look cheaper after more fields)."""
        for fields in sorted(self.known, key=len):
            for name in fields:
                smaller = fields - {name}
                if smaller in self.known and self.known[smaller] > self.known[fields]:
                    self.known[fields] = self.known[smaller]

    def __getitem__(self, fields: frozenset[str]) -> int:
        return 1 if not fields else self.known[fields]


def plan_fields(prompt: TablePrompt, stats: FieldStatistics, *, reorder: bool = True) -> FieldPlan:
    """Estimate the given order and (with ``reorder``) choose the best one."""
    counts = _Counts(stats)
    fields = prompt.fields
    sets = [frozenset(fields[: i + 1]) for i in range(len(fields))]  # the given order's
    blocks = _blocks(prompt) if reorder else []
    for base, names in blocks:
        if len(names) <= EXHAUSTIVE_FIELDS:  # every subset of the block, after its base
            sets += [base | frozenset(c) for k in range(1, len(names) + 1)
                     for c in combinations(names, k)]  # fmt: skip
    counts.fetch(sets)
    order = [n for base, names in blocks for n in _order(prompt, base, names, counts, stats)]
    chosen = prompt.reordered(order) if reorder else prompt
    total = stats.rows * sum(
        len(p) if isinstance(p, str) else stats.mean_chars[p.name] for p in prompt.pieces()
    )
    return FieldPlan(
        given=prompt,
        chosen=chosen,
        rows=stats.rows,
        distinct_prompts=counts[frozenset(fields)] if stats.rows else 0,
        given_chars=estimate(prompt, counts, stats),
        chosen_chars=estimate(chosen, counts, stats),
        total_chars=total,
        exact=stats.exact,
        passes=counts.passes,
    )


def estimate(prompt: TablePrompt, counts: Any, stats: FieldStatistics) -> float:
    """Estimated prefill characters of ``prompt`` under global prefix sharing."""
    seen: frozenset[str] = frozenset()
    chars = 0.0
    for piece in prompt.pieces():
        if isinstance(piece, str):
            chars += len(piece) * counts[seen]
        else:
            seen = seen | {piece.name}
            chars += stats.mean_chars[piece.name] * counts[seen]
    return chars


def _blocks(prompt: TablePrompt) -> list[tuple[frozenset[str], tuple[str, ...]]]:
    """(fields before the block, the block's fields in given order) per block."""
    return [
        (
            frozenset(TablePrompt(prompt.lines[: block[0]], ()).fields),
            tuple(prompt._line_field(i) for i in block),
        )
        for block in prompt.blocks
    ]


def _line_costs(prompt: TablePrompt, name: str, stats: FieldStatistics) -> tuple[float, float]:
    """(chars before the field: the newline and label; chars with it: the value and the
    trailing text) of the first block line holding ``name``."""
    index = next(i for block in prompt.blocks for i in block if prompt._line_field(i) == name)
    line = prompt.lines[index]
    at = next(i for i, p in enumerate(line) if isinstance(p, Field))
    before = 1 + sum(len(p) for p in line[:at])  # 1: the line's newline
    return before, stats.mean_chars[name] + sum(len(p) for p in line[at + 1 :])


def _order(
    prompt: TablePrompt,
    base: frozenset[str],
    fields: tuple[str, ...],
    counts: _Counts,
    stats: FieldStatistics,
) -> list[str]:
    """The block's fields in their cheapest order after ``base``: exact for up to
    ``EXHAUSTIVE_FIELDS`` fields (a dynamic program over subsets), greedy beyond."""
    if len(fields) > EXHAUSTIVE_FIELDS:
        placed: list[str] = []
        while len(placed) < len(fields):
            now = base | frozenset(placed)
            remaining = [name for name in fields if name not in placed]
            counts.fetch([now | {name} for name in remaining])
            placed.append(
                min(
                    remaining,
                    key=lambda n: (counts[now | {n}], -stats.mean_chars[n], fields.index(n)),
                )
            )
        return placed
    costs = {name: _line_costs(prompt, name, stats) for name in fields}
    position = {name: i for i, name in enumerate(fields)}
    # best[S]: (cost, positions of the order) of placing exactly the fields of S first
    best: dict[frozenset[str], tuple[float, tuple[int, ...]]] = {frozenset(): (0.0, ())}
    for size in range(1, len(fields) + 1):
        for chosen in combinations(fields, size):
            subset = frozenset(chosen)
            options = []
            for name in chosen:
                rest = subset - {name}
                before, after = costs[name]
                cost = best[rest][0] + before * counts[base | rest] + after * counts[base | subset]
                options.append((round(cost, 6), best[rest][1] + (position[name],)))
            best[subset] = min(options)
    return [fields[i] for i in best[frozenset(fields)][1]]


# -- statistics of an in-memory Arrow table (the CLI): exact -------------------------
class ArrowStatistics:
    """Exact statistics of a pyarrow Table's rendered fields (group-by counts)."""

    exact = True

    def __init__(self, table: Any, prompt: TablePrompt) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        texts = field_texts(table, prompt)
        self.rows = table.num_rows
        self._table = pa.table(texts)
        self.mean_chars = {
            name: (pc.sum(pc.utf8_length(text)).as_py() or 0) / max(self.rows, 1)
            for name, text in texts.items()
        }

    def distinct(self, sets: Sequence[frozenset[str]]) -> dict[frozenset[str], int]:
        return {s: self._table.group_by(sorted(s)).aggregate([]).num_rows for s in sets}
