"""The Plan: shared token segments, planned requests, prefix groups and statistics.

A Plan is what the planner hands a backend. Index map:

    Plan.requests[request_id]   execution order; each request lists the input rows it serves
    Plan.segments[segment_id]   nodes of the compressed prefix tree shared by >= 2 requests;
                                a parent always has a smaller id than its children
    Plan.groups[group_id]       execution order; a group's members are a contiguous run of
                                Plan.requests

All classes are frozen; build them with ``build_plan`` rather than by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A token run shared by >= 2 planned requests: one node of the compressed prefix tree."""

    segment_id: int
    """Index into ``Plan.segments``."""
    parent_id: int | None
    """The enclosing shared segment, None at the first level."""
    start: int
    """Token offset in the prompt where it begins (the parent's end, 0 at the first level)."""
    token_ids: tuple[int, ...]
    """This segment's own tokens only."""
    num_requests: int
    """Planned requests whose chain contains this segment."""

    @property
    def end(self) -> int:
        """Token offset just past this segment: ``start + len(token_ids)``."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class PlannedRequest:
    """One prompt to run; identical prompts merged by the planner share one request."""

    request_id: int
    """Index into ``Plan.requests`` (which is in execution order)."""
    rows: tuple[int, ...]
    """Input positions that receive this request's output, ascending."""
    token_ids: Sequence[int]
    """The whole prompt: the sequence the caller passed for ``rows[0]``, not a copy."""
    chain: tuple[int, ...]
    """Segment ids, outermost first; their tokens concatenated == ``token_ids[:prefix_length]``."""
    prefix_length: int
    """Tokens covered by the chain (0 when nothing is shared); may equal ``len(token_ids)``."""
    group_id: int
    group_prefix_length: int
    """Tokens of this request's first-level group prefix; the end of a chain segment, or 0."""
    max_tokens: int

    @property
    def suffix(self) -> Sequence[int]:
        """The tokens this request prefills on its own: ``token_ids[prefix_length:]``."""
        return self.token_ids[self.prefix_length :]


@dataclass(frozen=True)
class PrefixGroup:
    """BatchLLM's single-level group: requests that share one first-level prefix."""

    group_id: int
    """Index into ``Plan.groups`` (execution order)."""
    prefix_length: int
    """First-level shared prefix length (0 for a request that shares nothing)."""
    request_ids: tuple[int, ...]
    """Members in execution order (a contiguous run of ``Plan.requests``)."""


@dataclass(frozen=True)
class PlanStats:
    """Token accounting of a plan; see the field comments for the exact definitions."""

    rows: int
    """Input prompts."""
    requests: int
    """Planned requests after merging identical prompts."""
    prompt_tokens: int
    """Sum of all rows' prompt lengths."""
    unique_tokens: int
    """Tokens of the prefix tree over all rows: the theoretical minimum prefill."""
    prefill_tokens: int
    """Prefill with full multi-level sharing: segment lengths + suffix lengths."""
    single_level_prefill_tokens: int
    """Prefill of a backend that shares only each group's first-level prefix."""
    groups: int
    shared_groups: int
    """Groups with ``prefix_length > 0``."""
    segments: int
    saving_ratio: float
    """``(prompt_tokens - prefill_tokens) / prompt_tokens``; 0.0 when there are no tokens."""
    seconds: float
    """Wall time spent planning."""

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-ready)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    """Requests in execution order, the shared segments they use, and their groups."""

    requests: tuple[PlannedRequest, ...]
    segments: tuple[Segment, ...]
    groups: tuple[PrefixGroup, ...]
    stats: PlanStats

    def report(self) -> str:
        """A short human-readable prefix-sharing report, one figure per line."""
        s = self.stats
        single_saved = s.prompt_tokens - s.single_level_prefill_tokens
        single_ratio = single_saved / s.prompt_tokens if s.prompt_tokens else 0.0
        lines = [
            "prefix-sharing plan",
            f"  rows               {s.rows:>12,}",
            f"  requests           {s.requests:>12,}  (after merging identical prompts)",
            f"  groups             {s.groups:>12,}  ({s.shared_groups:,} share a prefix)",
            f"  segments           {s.segments:>12,}",
            f"  prompt tokens      {s.prompt_tokens:>12,}",
            f"  unique tokens      {s.unique_tokens:>12,}  (minimum prefill)",
            f"  prefill tokens     {s.prefill_tokens:>12,}  (multi-level sharing)",
            f"  single-level       {s.single_level_prefill_tokens:>12,}"
            f"  (saving {single_ratio:.1%})",
            f"  saving ratio       {s.saving_ratio:>12.1%}",
            f"  planning seconds   {s.seconds:>12.3f}",
        ]
        return "\n".join(lines)
