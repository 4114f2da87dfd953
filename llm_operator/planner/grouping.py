"""BatchLLM groups and the execution order of requests.

Groups. Each first-level segment ``c`` starts a *family*. A child segment ``g`` of ``c`` is
lifted into a group of its own, with prefix ``c + g``, when

    (requests below g - 1) * len(g) > len(c)

(a single-level backend then prefills ``c`` once more but ``g`` once instead of once per
request). What stays under ``c`` forms one more group with prefix ``c``; when that is a single
child segment ``h``, the group prefix extends to the end of ``h``, and when it is a single
request, the group shares nothing (prefix 0). A request outside every segment is a group of
its own with prefix 0. Lifting changes groups only: request chains always follow the full
segment tree.

Order. A request's rank is its decode/prompt ratio ``max_tokens / len(prompt)`` (larger
first), ties broken by its first input row; a set of requests ranks by its largest ratio and
smallest row. With ``decode_first=False`` the rank is the first input row alone. Families
run in rank order, the groups of a family in rank order, and inside a group the children of
every segment run in rank order, depth first. So a family's requests are contiguous, and so
are every group's and every segment's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from llm_operator.planner.segment_tree import ROOT_SEGMENT, SegmentTree

_REQUEST = 0
_SEGMENT = 1
_NO_ROW = sys.maxsize  # larger than every input row

Rank = tuple[float, ...]
Item = tuple[Rank, int, int]  # (rank, _REQUEST or _SEGMENT, request or segment id)
Member = tuple[int, tuple[int, ...]]  # (request, internal segment chain, outermost first)


@dataclass(frozen=True)
class OrderedGroup:
    """One group in execution order; its members in execution order."""

    prefix_length: int
    members: list[Member]


class _Orderer:
    """Ranks requests and segments and emits them depth first in rank order."""

    def __init__(
        self,
        tree: SegmentTree,
        request_ratio: Sequence[float],
        request_first_row: Sequence[int],
        decode_first: bool,
    ) -> None:
        self.tree = tree
        self.decode_first = decode_first
        self.request_ratio = request_ratio
        self.request_first_row = request_first_row
        self.request_rank = [
            self.rank(ratio, row) for ratio, row in zip(request_ratio, request_first_row)
        ]
        # Aggregate per segment; children have larger ids than their parents.
        best_ratio = [float("-inf")] * len(tree)
        first_row = [_NO_ROW] * len(tree)
        for segment in reversed(range(len(tree))):
            for request in tree.direct_requests[segment]:
                best_ratio[segment] = max(best_ratio[segment], request_ratio[request])
                first_row[segment] = min(first_row[segment], request_first_row[request])
            parent = tree.parent[segment]
            if parent >= 0:
                best_ratio[parent] = max(best_ratio[parent], best_ratio[segment])
                first_row[parent] = min(first_row[parent], first_row[segment])
        self.segment_ratio = best_ratio
        self.segment_first_row = first_row
        self.segment_rank = [self.rank(r, f) for r, f in zip(best_ratio, first_row)]

    def rank(self, ratio: float, first_row: int) -> Rank:
        """Sort key of a request or a set of requests: smaller runs first."""
        return (-ratio, first_row) if self.decode_first else (first_row,)

    def items(self, segment: int) -> list[Item]:
        """The child segments and direct requests of ``segment``, in rank order."""
        tree = self.tree
        found: list[Item] = [
            (self.request_rank[request], _REQUEST, request)
            for request in tree.direct_requests[segment]
        ]
        found.extend(
            (self.segment_rank[child], _SEGMENT, child) for child in tree.child_segments[segment]
        )
        found.sort()
        return found

    def items_rank(self, items: list[Item]) -> Rank:
        """Rank of the requests below ``items`` together."""
        ratio, first_row = float("-inf"), _NO_ROW
        for _, kind, ident in items:
            request = kind == _REQUEST
            ratio = max(ratio, (self.request_ratio if request else self.segment_ratio)[ident])
            rows = self.request_first_row if request else self.segment_first_row
            first_row = min(first_row, rows[ident])
        return self.rank(ratio, first_row)

    def emit(self, items: list[Item], chain: tuple[int, ...]) -> list[Member]:
        """Requests below ``items`` depth first in rank order, each with its chain."""
        members: list[Member] = []
        pending: list[tuple[Iterator[Item], tuple[int, ...]]] = [(iter(items), chain)]
        while pending:
            iterator, current_chain = pending[-1]
            item = next(iterator, None)
            if item is None:
                pending.pop()
                continue
            _, kind, ident = item
            if kind == _REQUEST:
                members.append((ident, current_chain))
            else:
                pending.append((iter(self.items(ident)), (*current_chain, ident)))
        return members


def order_groups(
    tree: SegmentTree,
    request_ratio: Sequence[float],
    request_first_row: Sequence[int],
    *,
    decode_first: bool,
) -> list[OrderedGroup]:
    """Groups in execution order (see the module docstring for the rules).

    ``request_ratio[r]`` is request r's max_tokens / prompt length and ``request_first_row[r]``
    its smallest input row (distinct across requests).
    """
    orderer = _Orderer(tree, request_ratio, request_first_row, decode_first)
    groups: list[OrderedGroup] = []
    for _, kind, ident in orderer.items(ROOT_SEGMENT):
        if kind == _REQUEST:
            groups.append(OrderedGroup(0, [(ident, ())]))
        else:
            groups.extend(_family_groups(orderer, ident))
    return groups


def _family_groups(orderer: _Orderer, family: int) -> list[OrderedGroup]:
    """The groups under first-level segment ``family``, in rank order."""
    tree = orderer.tree
    family_length = tree.length(family)
    lifted = [
        child
        for child in tree.child_segments[family]
        if (tree.num_requests[child] - 1) * tree.length(child) > family_length
    ]
    lifted_set = set(lifted)
    remaining = [
        item
        for item in orderer.items(family)
        if not (item[1] == _SEGMENT and item[2] in lifted_set)
    ]
    # (rank, prefix length, items, chain)
    candidates: list[tuple[Rank, int, list[Item], tuple[int, ...]]] = []
    if remaining:
        if len(remaining) == 1 and remaining[0][1] == _SEGMENT:
            prefix_length = tree.end[remaining[0][2]]  # merge the family into its only child
        elif len(remaining) == 1:
            prefix_length = 0  # a single request left: nothing to share within the group
        else:
            prefix_length = tree.end[family]
        candidates.append((orderer.items_rank(remaining), prefix_length, remaining, (family,)))
    for child in lifted:
        candidates.append(
            (orderer.segment_rank[child], tree.end[child], orderer.items(child), (family, child))
        )
    candidates.sort(key=lambda candidate: candidate[0])
    return [
        OrderedGroup(prefix_length, orderer.emit(items, chain))
        for _, prefix_length, items, chain in candidates
    ]
