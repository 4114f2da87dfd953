"""Shared segments: the prefix-tree nodes that >= 2 requests share and that are long enough.

A trie node shared by fewer than two requests is never a segment. A shared node shorter than
``min_shared_tokens`` is dissolved: its tokens are prepended to each of its children (which
are then measured again with those tokens included) and to the suffixes of the requests that
end in it. Segment 0 is a pseudo-segment for the root: it has no tokens and holds the
first-level segments and the requests that share nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_operator.planner.prefix_tree import ROOT, PrefixTree

ROOT_SEGMENT = 0
"""Internal id of the root pseudo-segment (not a real Segment, never in a chain)."""


@dataclass(frozen=True)
class SegmentTree:
    """Internal segment ids 1.. are real segments, numbered parents before children.

    ``direct_requests[s]`` lists the requests whose deepest segment is ``s`` (for the root:
    the requests that share nothing). Every request appears there exactly once.
    """

    start: list[int]
    end: list[int]
    parent: list[int]
    """Enclosing segment; ``ROOT_SEGMENT`` at the first level, -1 for the root itself."""
    child_segments: list[list[int]]
    direct_requests: list[list[int]]
    num_requests: list[int]
    """Requests at or below the segment (for the root: all requests)."""
    source_request: list[int]
    """Some request below the segment, to read its tokens from (root: -1)."""

    def __len__(self) -> int:
        return len(self.start)

    def length(self, segment: int) -> int:
        """The segment's own token count."""
        return self.end[segment] - self.start[segment]


def _new_root(num_requests: int) -> SegmentTree:
    return SegmentTree(
        start=[0],
        end=[0],
        parent=[-1],
        child_segments=[[]],
        direct_requests=[[]],
        num_requests=[num_requests],
        source_request=[-1],
    )


def unshared_segment_tree(num_requests: int) -> SegmentTree:
    """A tree without segments: every request shares nothing (``share_prefixes=False``)."""
    tree = _new_root(num_requests)
    tree.direct_requests[ROOT_SEGMENT].extend(range(num_requests))
    return tree


def derive_segment_tree(trie: PrefixTree, min_shared_tokens: int) -> SegmentTree:
    """Keep the trie nodes shared by >= 2 requests and at least ``min_shared_tokens`` long.

    A node's length is measured from the end of its nearest kept ancestor, so the tokens of
    dissolved ancestors count towards it.
    """
    assert min_shared_tokens >= 1, "min_shared_tokens must be validated by the caller"
    nodes = trie.preorder()
    below = [len(prompts) for prompts in trie.terminals]
    for node in reversed(nodes):
        if node != ROOT:
            below[trie.parent[node]] += below[node]

    tree = _new_root(below[ROOT])
    node_count = len(trie.depth)
    owner = [ROOT_SEGMENT] * node_count  # deepest kept segment at or above the node
    uncovered_from = [0] * node_count  # first token below the node not yet in a segment
    tree.direct_requests[ROOT_SEGMENT].extend(trie.terminals[ROOT])
    for node in nodes:
        if node == ROOT:
            continue
        parent = trie.parent[node]
        start = uncovered_from[parent]
        depth = trie.depth[node]
        if below[node] >= 2 and depth - start >= min_shared_tokens:
            segment = len(tree.start)
            tree.start.append(start)
            tree.end.append(depth)
            tree.parent.append(owner[parent])
            tree.child_segments.append([])
            tree.direct_requests.append([])
            tree.num_requests.append(below[node])
            tree.source_request.append(trie.first_prompt[node])
            tree.child_segments[owner[parent]].append(segment)
            owner[node] = segment
            uncovered_from[node] = depth
        else:
            owner[node] = owner[parent]
            uncovered_from[node] = start
        if trie.terminals[node]:
            tree.direct_requests[owner[node]].extend(trie.terminals[node])
    return tree
