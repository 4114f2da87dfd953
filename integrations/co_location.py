"""Co-location: rows that share a prefix meet in one partition (``co_locate``).

Lexicographic order is the depth-first order of the prefix tree, but a plain range
partitioning on the prompt cuts a group of rows sharing a prefix wherever a range boundary
falls. Instead, a sample of the prompts is sorted and cut where it branches: runs of
sampled prompts that share at least ``min_prefix_chars`` characters are the groups, each
named by its shared prefix. Every row goes to the partition of the longest group prefix it
starts with (a row of no sampled group goes by a hash of its first ``min_prefix_chars``
characters), and groups are packed into partitions largest first, so each group stays
whole while partition sizes stay balanced.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class PrefixPartitioner:
    """Maps a prompt to a partition so that rows sharing a sampled group prefix meet.

    routes: prefix -> the partitions its rows may go to. A prompt follows the longest
    prefix it starts with: a group prefix names one partition; the prefix of a group
    too big for one partition names the partitions its pieces went to, and a row is
    spread over them by a hash of its next ``min_prefix_chars`` characters. A prompt of
    no known prefix goes by a hash of its first ``min_prefix_chars`` characters. Either
    way, rows that share that much more than a known prefix meet.
    """

    routes: Mapping[str, tuple[int, ...]]
    num_partitions: int
    min_prefix_chars: int

    def __post_init__(self) -> None:
        lengths = sorted({len(p) for p in self.routes}, reverse=True)
        object.__setattr__(self, "_lengths", tuple(lengths))

    def __call__(self, prompt: Any) -> int:
        if not isinstance(prompt, str):
            return 0
        for length in self._lengths:
            if len(prompt) < length:
                continue
            partitions = self.routes.get(prompt[:length])
            if partitions is not None:
                if len(partitions) == 1:
                    return partitions[0]
                head = prompt[: length + self.min_prefix_chars]
                return partitions[_hash(head) % len(partitions)]
        return _hash(prompt[: self.min_prefix_chars]) % self.num_partitions


def build_partitioner(
    sample: Sequence[Any], num_partitions: int, *, min_prefix_chars: int = 32
) -> PrefixPartitioner:
    """Group a sample of prompts by shared prefix and pack the groups into partitions.

    The sorted sample is one segment. A segment holding more than its share of the
    sample (len(sample) / num_partitions), or whose rows share fewer than
    ``min_prefix_chars`` characters, is cut at its shallowest branch points (the
    adjacent pairs with the shortest common prefix: cutting there loses the least
    sharing) until every piece fits and shares enough. A piece of two or more sampled rows sharing at
    least ``min_prefix_chars`` characters is a group; groups are packed largest first into
    the least loaded partition. When whole groups cannot be packed evenly (3 groups of 40
    rows on 2 partitions give 80 and 40), the pieces are halved (the share halves) until
    no partition gets more than ``BALANCE`` times the mean, keeping the most even packing
    found: a split group computes its prefix once per partition it lands in, far less
    than a partition left waiting.
    """
    if (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or num_partitions < 1
    ):
        raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
    ordered = sorted(s for s in sample if isinstance(s, str))
    share = max(1, len(ordered) // num_partitions)
    # whole groups first; smaller pieces only while packing leaves a partition skewed
    best, loads = _pack(ordered, num_partitions, share, min_prefix_chars)
    busiest, limit = max(loads), BALANCE * len(ordered) / num_partitions
    while busiest > limit and share > 1:
        share //= 2
        candidate, loads = _pack(ordered, num_partitions, share, min_prefix_chars)
        if max(loads) < busiest:  # ties keep the bigger pieces
            best, busiest = candidate, max(loads)
    return best


BALANCE = 1.25
"""co_locate splits groups into smaller pieces while its busiest partition would hold more
than this times the mean (each split costs the group's prefix once more per partition)."""


def _pack(
    ordered: list[str], num_partitions: int, share: int, min_prefix_chars: int
) -> tuple[PrefixPartitioner, list[int]]:
    """build_partitioner with pieces of at most ``share`` sampled rows: the partitioner
    and the sampled rows each partition gets (rows of no group are not counted)."""
    # common[i]: common prefix length of ordered[i] and ordered[i + 1]
    common = [_common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:])]
    groups: list[tuple[str, int]] = []  # (shared prefix, sampled rows)
    # split segments: (shared prefix, index range into `groups` of the pieces under it)
    split: list[tuple[str, int]] = []
    pending: list[tuple[int, int, int]] = [(0, len(ordered), -1)] if ordered else []
    parents_of: list[int] = []  # per group: index into `split` of its nearest split parent
    split_parents: list[int] = []
    while pending:
        begin, end, parent = pending.pop()
        inner = common[begin : end - 1]
        shared = min(inner) if inner else len(ordered[begin])
        if inner and (end - begin > share or shared < min_prefix_chars):
            own = parent
            if shared >= min_prefix_chars:
                split.append((ordered[begin][:shared], len(groups)))
                split_parents.append(parent)
                own = len(split) - 1
            cuts = [begin + i + 1 for i, c in enumerate(inner) if c == shared]
            bounds = [begin, *cuts, end]
            pending.extend((b, e, own) for b, e in zip(bounds, bounds[1:]))
        elif end - begin >= 2 and shared >= min_prefix_chars:
            groups.append((ordered[begin][:shared], end - begin))
            parents_of.append(parent)
    loads = [0] * num_partitions
    routes: dict[str, tuple[int, ...]] = {}
    spread: list[set[int]] = [set() for _ in split]
    for index in sorted(range(len(groups)), key=lambda g: (-groups[g][1], groups[g][0])):
        prefix, count = groups[index]
        if prefix not in routes:
            target = min(range(num_partitions), key=lambda p: (loads[p], p))
            loads[target] += count
            routes[prefix] = (target,)
        parent = parents_of[index]
        while parent >= 0:  # every split ancestor may route its unsampled rows here too
            spread[parent].update(routes[prefix])
            parent = split_parents[parent]
    for (prefix, _), partitions in zip(split, spread):
        if partitions and prefix not in routes:
            routes[prefix] = tuple(sorted(partitions))
    partitioner = PrefixPartitioner(routes, num_partitions, min_prefix_chars)
    counts = [0] * num_partitions
    for prompt in ordered:  # where the sample goes, ungrouped rows included
        counts[partitioner(prompt)] += 1
    return partitioner, counts


def _hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- whether it helps ----------------------------------------------------------------
MIN_GAIN = 0.02
"""Co-location by default runs only when one plan over a sample of the frame would skip at
least this much more of the prompts' text than the frame's own partitions do."""


class CoLocation(NamedTuple):
    """What co-location would do to a frame, from a sample of its rows
    (``plan_co_location``). Savings are the share of the prompts' characters a plan would
    not compute: every prompt's characters less those a prefix tree over them shares
    (characters stand in for tokens: the driver needs no tokenizer)."""

    partitioner: PrefixPartitioner
    partitions: int
    sampled: int  # prompts in the sample
    rows: int | None  # the frame's rows, where counted
    moved: float  # share of the sampled rows whose partition would change
    saving: float  # one plan over all the sampled rows
    saving_as_is: float  # each partition of the frame planning its sampled rows alone
    skipped: str | None  # why co-locating cannot help (None: it runs)
    seconds: float = 0.0  # sampling the frame and planning: what a skipped one costs

    def report(self) -> str:
        """One line for the job's log and the CLI summary."""
        rows = f"{self.rows:,}" if self.rows is not None else "the"
        sample = f"a sample of {self.sampled:,} of {rows} rows, {self.seconds:.2f} s"
        savings = (
            f"one plan over the frame shares {self.saving:.0%} of the prompt text, the "
            f"frame's {self.partitions} partitions as they came {self.saving_as_is:.0%}"
        )
        if self.skipped is not None:
            return f"co-location skipped ({self.skipped}): {savings} ({sample})"
        moved = f"{self.moved:.0%} of the rows"
        if self.rows is not None:
            moved = f"about {round(self.moved * self.rows):,} rows ({self.moved:.0%})"
        return f"co-location: {moved} moved to share prefixes; {savings} ({sample})"


def plan_co_location(
    sample: Sequence[tuple[Any, int]],
    num_partitions: int,
    *,
    rows: int | None = None,
    min_prefix_chars: int = 32,
    force: bool = False,
) -> CoLocation:
    """The partitioner for ``sample`` (each sampled row's prompt and the partition it came
    from) and whether it helps: it is skipped (``skipped`` says why) when one plan over the
    sample would share less than ``MIN_GAIN`` more of the prompt text than the frame's own
    partitions do: no shared prefixes, or groups already whole in their partitions.
    ``force``: never skipped (``dedupe`` and ``reorder_fields`` need the rows to meet)."""
    prompts = [(p, part) for p, part in sample if isinstance(p, str)]
    partitioner = build_partitioner([p for p, _ in prompts], num_partitions,
                                    min_prefix_chars=min_prefix_chars)  # fmt: skip
    total = sum(len(p) for p, _ in prompts)
    by_partition: dict[int, list[str]] = {}
    for p, part in prompts:
        by_partition.setdefault(part, []).append(p)
    shared = _shared_characters([p for p, _ in prompts], min_prefix_chars)
    shared_as_is = sum(_shared_characters(ps, min_prefix_chars) for ps in by_partition.values())
    saving = shared / total if total else 0.0
    saving_as_is = shared_as_is / total if total else 0.0
    moved = sum(partitioner(p) != part for p, part in prompts) / len(prompts) if prompts else 0.0
    skipped = None
    if not force:
        if len(prompts) < 2:
            skipped = "fewer than two prompts in the sample"
        elif saving < MIN_GAIN:
            skipped = "the prompts share no prefixes"
        elif saving - saving_as_is < MIN_GAIN:
            skipped = "the frame's partitions already keep its shared prefixes together"
    return CoLocation(
        partitioner, num_partitions, len(prompts), rows, moved, saving, saving_as_is, skipped
    )


def _shared_characters(prompts: Sequence[str], min_prefix_chars: int) -> int:
    """Characters a prefix tree over ``prompts`` saves: in sorted order, each prompt shares
    its common prefix with the one before it (when at least ``min_prefix_chars`` long)."""
    ordered = sorted(prompts)
    shared = (_common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(length for length in shared if length >= min_prefix_chars)
