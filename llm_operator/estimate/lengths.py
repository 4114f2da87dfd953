"""Output lengths for the replay: known (EOS ignored), measured (sampled rows) or drawn
from the sampled rows of the same prefix group.

A request's *samples* are the model steps that end in a sampled token: its output tokens
(``token_ids`` keep the end-of-sequence token that stopped a row). Groups are matched by
their first-level shared prefix (``group_key``), so lengths measured on a sample carry
over to another plan of the same job (another partition, the whole table).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llm_operator.planner import Plan, PlannedRequest


@dataclass(frozen=True)
class Observed:
    """One sampled row's outcome."""

    samples: int  # steps that sampled a token: its output tokens (the EOS included)
    cut: bool  # ended by max_tokens: its natural length is at least max_tokens
    max_tokens: int


def observed(completion_tokens: int, finish_reason: str, max_tokens: int) -> Observed:
    """What a finished row tells about the lengths of its kind of row."""
    return Observed(
        max(1, min(completion_tokens, max_tokens)), finish_reason == "length", max_tokens
    )


def group_key(request: PlannedRequest) -> str:
    """The request's first-level shared prefix, as a short digest ("" when it shares none)."""
    if not request.group_prefix_length:
        return ""
    prefix = request.token_ids[: request.group_prefix_length]
    return hashlib.sha1(",".join(map(str, prefix)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LengthModel:
    """Sampled rows' outcomes by prefix group (``group_key``) and all together."""

    by_group: Mapping[str, tuple[Observed, ...]] = field(default_factory=dict)
    everything: tuple[Observed, ...] = ()

    @classmethod
    def of(cls, sampled: Sequence[tuple[str, Observed]]) -> LengthModel:
        by_group: dict[str, tuple[Observed, ...]] = {}
        for key, o in sampled:
            by_group[key] = (*by_group.get(key, ()), o)
        return cls(by_group, tuple(o for _, o in sampled))

    @property
    def spread(self) -> float:
        """The relative standard error of the sampled rows' mean length (1.0 without rows)."""
        values = [o.samples for o in self.everything]
        if len(values) < 2:
            return 0.0 if values else 1.0
        mean = statistics.fmean(values)
        return statistics.stdev(values) / mean / math.sqrt(len(values)) if mean > 0 else 0.0

    def samples(
        self,
        plan: Plan,
        ignore_eos: Sequence[bool],
        *,
        scale: float = 1.0,
        known: Mapping[int, int] | None = None,
    ) -> list[int]:
        """Samples per planned request: its max_tokens with EOS ignored, ``known[i]`` for a
        request measured already, else drawn (the ``i``-th, cycling) from its group's sampled
        rows (all of them for a group without one): a row cut at its max_tokens says the row
        runs to its own max_tokens; ``scale`` moves every natural length (the range's ends).
        With no sampled row at all, max_tokens (an upper bound)."""
        known = known or {}
        result = []
        for request in plan.requests:
            i, max_tokens = request.request_id, request.max_tokens
            if ignore_eos[i]:
                result.append(max_tokens)
            elif i in known:
                result.append(known[i])
            else:
                pool = self.by_group.get(group_key(request)) or self.everything
                seen = pool[i % len(pool)] if pool else None
                natural = max_tokens if seen is None or seen.cut else round(seen.samples * scale)
                result.append(max(1, min(max_tokens, natural)))
        return result
