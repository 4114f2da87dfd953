"""``build_plan``: tokenized prompts in, a prefix-sharing Plan out (BatchLLM, arXiv 2412.03594).

Steps: validate and encode every row; merge identical rows that the caller marked mergeable;
build the compressed prefix tree of the requests; keep the shared nodes as segments; form
BatchLLM groups; order requests decode-first; number everything in execution order.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

from llm_operator.config import EngineConfig
from llm_operator.planner.grouping import OrderedGroup, order_groups
from llm_operator.planner.plan import Plan, PlannedRequest, PlanStats, PrefixGroup, Segment
from llm_operator.planner.prefix_tree import build_prefix_tree, count_unique_tokens, encode_prompt
from llm_operator.planner.segment_tree import (
    ROOT_SEGMENT,
    SegmentTree,
    derive_segment_tree,
    unshared_segment_tree,
)


@contextlib.contextmanager
def _garbage_collector_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@_garbage_collector_paused()
def build_plan(
    token_ids: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    *,
    merge_keys: Sequence[Hashable | None] | None = None,
    min_shared_tokens: int = EngineConfig.min_shared_tokens,
    decode_first: bool = EngineConfig.decode_first,
    share_prefixes: bool = EngineConfig.share_prefixes,
) -> Plan:
    """Plan a batch of tokenized prompts.

    token_ids: one non-empty sequence of token ids (ints in [0, 2**32)) per input row.
    max_tokens: the decode budget, one int >= 1 for all rows or one per row.
    merge_keys: rows with equal token ids, equal max_tokens and equal non-None key become one
        request (its ``rows`` lists them all); None never merges.
    min_shared_tokens: a shared prefix-tree node shorter than this is not a segment.
    decode_first: order by max_tokens / prompt length, larger first (False: input order).
    share_prefixes: False gives no segments and one group of prefix 0 per request.

    Every input row lands in exactly one request's ``rows``. Raises ValueError or TypeError
    naming the bad argument. The cyclic garbage collector is paused while planning (the plan
    creates no cycles, and collections over many prompt lists are slow).
    """
    started = time.perf_counter()
    _check_flags(min_shared_tokens, decode_first, share_prefixes)
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(
            f"token_ids must be a sequence of token id sequences, got {type(token_ids)}"
        )
    num_rows = len(token_ids)
    row_max_tokens = _row_max_tokens(max_tokens, num_rows)
    if merge_keys is not None and len(merge_keys) != num_rows:
        raise ValueError(
            f"merge_keys has {len(merge_keys)} entries but token_ids has {num_rows} rows"
        )

    row_keys: list[bytes] = []
    prompt_tokens = 0
    for row, prompt in enumerate(token_ids):
        if not hasattr(prompt, "__len__"):
            raise TypeError(f"token_ids[{row}] must be a sequence of ints, got {type(prompt)}")
        if len(prompt) == 0:
            raise ValueError(f"token_ids[{row}] is empty; filter out empty prompts first")
        prompt_tokens += len(prompt)
        row_keys.append(encode_prompt(row, prompt))

    request_rows = _merge_rows(row_keys, row_max_tokens, merge_keys)
    first_rows = [rows[0] for rows in request_rows]
    request_keys = [row_keys[row] for row in first_rows]
    request_tokens = [token_ids[row] for row in first_rows]
    request_lengths = [len(prompt) for prompt in request_tokens]
    request_max_tokens = [row_max_tokens[row] for row in first_rows]

    if share_prefixes:
        trie = build_prefix_tree(request_keys)
        unique_tokens = trie.unique_tokens
        tree = derive_segment_tree(trie, min_shared_tokens)
    else:
        unique_tokens = count_unique_tokens(request_keys)
        tree = unshared_segment_tree(len(request_keys))
    ratios = [budget / length for budget, length in zip(request_max_tokens, request_lengths)]
    ordered = order_groups(tree, ratios, first_rows, decode_first=decode_first)

    requests, groups, segment_ids = _number_in_execution_order(
        ordered, tree, request_rows, request_tokens, request_max_tokens
    )
    segments = _make_segments(tree, segment_ids, request_tokens)
    stats = _plan_stats(requests, segments, groups, num_rows, prompt_tokens, unique_tokens, started)
    return Plan(requests, segments, groups, stats)


def _number_in_execution_order(
    ordered: list[OrderedGroup],
    tree: SegmentTree,
    request_rows: list[list[int]],
    request_tokens: list[Sequence[int]],
    request_max_tokens: list[int],
) -> tuple[tuple[PlannedRequest, ...], tuple[PrefixGroup, ...], dict[int, int]]:
    """Public requests and groups; segment ids by first appearance (parents come first)."""
    segment_ids: dict[int, int] = {}  # internal segment id -> public segment id
    requests: list[PlannedRequest] = []
    groups: list[PrefixGroup] = []
    for group_id, group in enumerate(ordered):
        first_request_id = len(requests)
        first_chain = group.members[0][1]
        assert group.prefix_length == 0 or any(
            tree.end[segment] == group.prefix_length for segment in first_chain
        ), "a group prefix must end on a segment boundary of its members' chains"
        for request, internal_chain in group.members:
            for segment in internal_chain:
                segment_ids.setdefault(segment, len(segment_ids))
            requests.append(
                PlannedRequest(
                    request_id=len(requests),
                    rows=tuple(request_rows[request]),
                    token_ids=request_tokens[request],
                    chain=tuple(segment_ids[segment] for segment in internal_chain),
                    prefix_length=tree.end[internal_chain[-1]] if internal_chain else 0,
                    group_id=group_id,
                    group_prefix_length=group.prefix_length,
                    max_tokens=request_max_tokens[request],
                )
            )
        members = tuple(range(first_request_id, len(requests)))
        groups.append(PrefixGroup(group_id, group.prefix_length, members))
    return tuple(requests), tuple(groups), segment_ids


def _plan_stats(
    requests: tuple[PlannedRequest, ...],
    segments: tuple[Segment, ...],
    groups: tuple[PrefixGroup, ...],
    num_rows: int,
    prompt_tokens: int,
    unique_tokens: int,
    started: float,
) -> PlanStats:
    prefill_tokens = sum(len(segment.token_ids) for segment in segments) + sum(
        len(request.token_ids) - request.prefix_length for request in requests
    )
    single_level = sum(
        group.prefix_length
        + sum(len(requests[r].token_ids) - group.prefix_length for r in group.request_ids)
        for group in groups
    )
    return PlanStats(
        rows=num_rows,
        requests=len(requests),
        prompt_tokens=prompt_tokens,
        unique_tokens=unique_tokens,
        prefill_tokens=prefill_tokens,
        single_level_prefill_tokens=single_level,
        groups=len(groups),
        shared_groups=sum(1 for group in groups if group.prefix_length > 0),
        segments=len(segments),
        saving_ratio=(prompt_tokens - prefill_tokens) / prompt_tokens if prompt_tokens else 0.0,
        seconds=time.perf_counter() - started,
    )


def _check_flags(min_shared_tokens: object, decode_first: object, share_prefixes: object) -> None:
    if not _is_int(min_shared_tokens):
        raise TypeError(f"min_shared_tokens must be an int, got {min_shared_tokens!r}")
    if min_shared_tokens < 1:  # type: ignore[operator]
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens!r}")
    for name, value in (("decode_first", decode_first), ("share_prefixes", share_prefixes)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _row_max_tokens(max_tokens: int | Sequence[int], num_rows: int) -> list[int]:
    """One validated max_tokens per row."""
    if _is_int(max_tokens):
        if max_tokens < 1:  # type: ignore[operator]
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        return [int(max_tokens)] * num_rows  # type: ignore[arg-type]
    if isinstance(max_tokens, (str, bytes)) or not hasattr(max_tokens, "__len__"):
        raise TypeError(f"max_tokens must be an int or a sequence of ints, got {max_tokens!r}")
    if len(max_tokens) != num_rows:
        raise ValueError(
            f"max_tokens has {len(max_tokens)} entries but token_ids has {num_rows} rows"
        )
    values = list(max_tokens)
    if all(type(value) is int for value in values) and (not values or min(values) >= 1):
        return values  # the common case, checked at C speed
    values = []
    for row, value in enumerate(max_tokens):
        if not _is_int(value):
            raise TypeError(f"max_tokens[{row}] must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"max_tokens[{row}] must be >= 1, got {value!r}")
        values.append(int(value))
    return values


def _merge_rows(
    row_keys: list[bytes],
    row_max_tokens: list[int],
    merge_keys: Sequence[Hashable | None] | None,
) -> list[list[int]]:
    """Input rows of each request, requests in order of their first row."""
    if merge_keys is None:
        return [[row] for row in range(len(row_keys))]
    request_rows: list[list[int]] = []
    request_of: dict[tuple[bytes, int, Hashable], int] = {}
    for row, merge_key in enumerate(merge_keys):
        if merge_key is None:
            request_rows.append([row])
            continue
        identity = (row_keys[row], row_max_tokens[row], merge_key)
        try:
            request = request_of.setdefault(identity, len(request_rows))
        except TypeError:
            raise TypeError(
                f"merge_keys[{row}] must be hashable or None, got {type(merge_key).__name__}"
            ) from None
        if request == len(request_rows):
            request_rows.append([row])
        else:
            request_rows[request].append(row)
    return request_rows


def _make_segments(
    tree: SegmentTree, segment_ids: dict[int, int], request_tokens: list[Sequence[int]]
) -> tuple[Segment, ...]:
    """Public Segments in id order, their tokens read from a request below each."""
    segments: list[Segment] = []
    for internal, public in sorted(segment_ids.items(), key=lambda pair: pair[1]):
        assert public == len(segments), "segment ids must be dense"
        parent = tree.parent[internal]
        start, end = tree.start[internal], tree.end[internal]
        tokens = request_tokens[tree.source_request[internal]][start:end]
        segments.append(
            Segment(
                segment_id=public,
                parent_id=None if parent == ROOT_SEGMENT else segment_ids[parent],
                start=start,
                token_ids=tuple(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens),
                num_requests=tree.num_requests[internal],
            )
        )
    return tuple(segments)
