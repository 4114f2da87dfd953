"""The global prefix planner (BatchLLM): structure, grouping, order and statistics."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_operator.planner import Plan, build_plan
from llm_operator.planner.prefix_tree import common_prefix_tokens, encode_prompt

# ---------------------------------------------------------------- invariant checker


def _common_prefix(first, second) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def check_plan(
    plan: Plan,
    prompts,
    max_tokens,
    merge_keys=None,
    min_shared_tokens=4,
    share_prefixes=True,
) -> None:
    """Assert every structural contract of a Plan against its inputs."""
    rows = len(prompts)
    per_row_max = [max_tokens] * rows if isinstance(max_tokens, int) else list(max_tokens)
    requests, segments, groups = plan.requests, plan.segments, plan.groups

    # Rows: each input row in exactly one request; merged rows are identical with equal keys.
    served = sorted(row for request in requests for row in request.rows)
    assert served == list(range(rows))
    outputs = [None] * rows
    for request in requests:
        assert list(request.rows) == sorted(request.rows)
        for row in request.rows:
            outputs[row] = request.token_ids
            assert list(prompts[row]) == list(request.token_ids)
            assert per_row_max[row] == request.max_tokens
            if len(request.rows) > 1:
                assert merge_keys is not None and merge_keys[row] is not None
                assert merge_keys[row] == merge_keys[request.rows[0]]
    assert [list(output) for output in outputs] == [list(prompt) for prompt in prompts]

    # Requests: chain tokens + suffix == prompt.
    for index, request in enumerate(requests):
        assert request.request_id == index
        covered = [token for segment in request.chain for token in segments[segment].token_ids]
        assert covered == list(request.token_ids[: request.prefix_length])
        assert list(request.suffix) == list(request.token_ids[request.prefix_length :])
        assert request.prefix_length == (segments[request.chain[-1]].end if request.chain else 0)
        for outer, inner in itertools.pairwise((None, *request.chain)):
            assert segments[inner].parent_id == outer

    # Segments: parent/start consistency, length, membership counts, contiguity.
    for index, segment in enumerate(segments):
        assert segment.segment_id == index
        assert len(segment.token_ids) >= min_shared_tokens
        if segment.parent_id is None:
            assert segment.start == 0
        else:
            assert segment.parent_id < index
            assert segment.start == segments[segment.parent_id].end
        members = [r.request_id for r in requests if index in r.chain]
        assert len(members) == segment.num_requests >= 2
        assert members == list(range(members[0], members[0] + len(members))), "not contiguous"
    if not share_prefixes:
        assert segments == ()

    # Groups: partition of requests into contiguous runs; prefix on a chain boundary.
    assert [m for group in groups for m in group.request_ids] == list(range(len(requests)))
    for index, group in enumerate(groups):
        assert group.group_id == index and group.request_ids
        for member in group.request_ids:
            request = requests[member]
            assert request.group_id == index
            assert request.group_prefix_length == group.prefix_length
            boundaries = {0} | {segments[s].end for s in request.chain}
            assert group.prefix_length in boundaries
        if not share_prefixes:
            assert group.prefix_length == 0 and len(group.request_ids) == 1

    # Sharing is maximal up to min_shared_tokens: requests with a long common prefix share
    # segments covering all but fewer than min_shared_tokens of it.
    if share_prefixes:
        for first, second in itertools.combinations(requests, 2):
            common = _common_prefix(first.token_ids, second.token_ids)
            if common >= min_shared_tokens:
                shared = [a for a, b in zip(first.chain, second.chain) if a == b]
                assert shared
                assert segments[shared[-1]].end > common - min_shared_tokens

    # Statistics.
    stats = plan.stats
    unique = len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})
    assert stats.rows == rows and stats.requests == len(requests)
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.unique_tokens == unique
    assert stats.prefill_tokens == sum(len(s.token_ids) for s in segments) + sum(
        len(r.suffix) for r in requests
    )
    single = sum(
        g.prefix_length + sum(len(requests[r].token_ids) - g.prefix_length for r in g.request_ids)
        for g in groups
    )
    assert stats.single_level_prefill_tokens == single
    assert stats.prompt_tokens >= stats.single_level_prefill_tokens >= stats.prefill_tokens
    assert stats.prefill_tokens >= stats.unique_tokens
    if share_prefixes and min_shared_tokens == 1:
        assert stats.prefill_tokens == stats.unique_tokens
    if not share_prefixes:
        assert stats.prefill_tokens == sum(len(r.token_ids) for r in requests)
    assert stats.groups == len(groups) and stats.segments == len(segments)
    assert stats.shared_groups == sum(1 for g in groups if g.prefix_length > 0)
    expected_ratio = (
        (stats.prompt_tokens - stats.prefill_tokens) / stats.prompt_tokens if rows else 0.0
    )
    assert stats.saving_ratio == pytest.approx(expected_ratio)


def _families(plan: Plan) -> list[list[int]]:
    """Consecutive runs of requests with the same first-level segment (or alone)."""
    runs: list[list[int]] = []
    previous = None
    for request in plan.requests:
        family = request.chain[0] if request.chain else ("alone", request.request_id)
        if not runs or family != previous:
            runs.append([])
        runs[-1].append(request.request_id)
        previous = family
    return runs


# ---------------------------------------------------------------- property tests


@st.composite
def batches(draw):
    vocabulary = st.integers(0, 3)
    pieces = draw(st.lists(st.lists(vocabulary, min_size=1, max_size=6), min_size=1, max_size=4))
    count = draw(st.integers(0, 24))
    prompts = []
    for _ in range(count):
        chosen = draw(st.lists(st.sampled_from(pieces), max_size=3))
        tail = draw(st.lists(vocabulary, max_size=3))
        prompt = [token for piece in chosen for token in piece] + tail
        prompts.append(prompt or [0])
    if draw(st.booleans()):
        max_tokens = draw(st.integers(1, 50))
    else:
        max_tokens = draw(st.lists(st.integers(1, 50), min_size=count, max_size=count))
    merge_keys = draw(
        st.none() | st.lists(st.none() | st.integers(0, 1), min_size=count, max_size=count)
    )
    return prompts, max_tokens, merge_keys


@settings(max_examples=3000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 150,
          deadline=None)  # fmt: skip
@given(
    batch=batches(),
    min_shared_tokens=st.integers(1, 6),
    decode_first=st.booleans(),
    share_prefixes=st.booleans(),
)
def test_plan_invariants(batch, min_shared_tokens, decode_first, share_prefixes):
    prompts, max_tokens, merge_keys = batch
    plan = build_plan(
        prompts,
        max_tokens,
        merge_keys=merge_keys,
        min_shared_tokens=min_shared_tokens,
        decode_first=decode_first,
        share_prefixes=share_prefixes,
    )
    check_plan(plan, prompts, max_tokens, merge_keys, min_shared_tokens, share_prefixes)
    # Families run in rank order; the first member of every family and every segment run
    # holds the run's best rank (largest ratio / smallest row).
    ratio = [r.max_tokens / len(r.token_ids) for r in plan.requests]
    first_row = [r.rows[0] for r in plan.requests]
    runs = _families(plan) + [
        [r.request_id for r in plan.requests if s in r.chain] for s in range(len(plan.segments))
    ]
    for run in runs:
        if decode_first:
            assert ratio[run[0]] == max(ratio[r] for r in run)
        else:
            assert first_row[run[0]] == min(first_row[r] for r in run)
    if decode_first:
        family_best = [max(ratio[r] for r in run) for run in _families(plan)]
        assert family_best == sorted(family_best, reverse=True)
    else:
        family_first_row = [min(first_row[r] for r in run) for run in _families(plan)]
        assert family_first_row == sorted(family_first_row)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.integers(-5, 50),
)
def test_common_prefix_tokens_matches_brute_force(first, second, guess):
    expected = _common_prefix(first, second)
    encoded = encode_prompt(0, first), encode_prompt(1, second)
    assert common_prefix_tokens(*encoded, guess) == expected
    assert (encoded[0] < encoded[1]) == (first < second)


# ---------------------------------------------------------------- concrete cases


def _tokens(start: int, count: int) -> list[int]:
    """``count`` distinct token ids from ``start``: a recognizable run."""
    return list(range(start, start + count))


TASK = _tokens(1000, 10)
DOC_A = _tokens(2000, 5)
DOC_B = _tokens(3000, 5)


def _segment_tokens(plan: Plan, request_row: int) -> list[tuple[int, ...]]:
    request = next(r for r in plan.requests if request_row in r.rows)
    return [plan.segments[s].token_ids for s in request.chain]


def test_two_level_sharing_builds_nested_chains():
    prompts = [TASK + DOC_A + [1], TASK + DOC_A + [2], TASK + DOC_B + [3], TASK + DOC_B + [4]]
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    assert len(plan.segments) == 3
    for row, doc in ((0, DOC_A), (1, DOC_A), (2, DOC_B), (3, DOC_B)):
        assert _segment_tokens(plan, row) == [tuple(TASK), tuple(doc)]
    first = plan.segments[0]
    assert (first.parent_id, first.start, first.num_requests) == (None, 0, 4)
    # (2 - 1) * 5 > 10 is false: one group sharing the task prefix.
    assert [(g.prefix_length, len(g.request_ids)) for g in plan.groups] == [(10, 4)]
    assert plan.stats.prefill_tokens == 10 + 5 + 5 + 4
    assert plan.stats.single_level_prefill_tokens == 10 + 4 * 6
    assert plan.stats.unique_tokens == plan.stats.prefill_tokens


def test_three_level_sharing():
    question = _tokens(4000, 4)
    prompts = [
        TASK + DOC_A + question + [1],
        TASK + DOC_A + question + [2],
        TASK + DOC_A + [5, 6, 7, 8, 9],
        TASK + DOC_B + [3],
    ]
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    assert _segment_tokens(plan, 0) == [tuple(TASK), tuple(DOC_A), tuple(question)]
    assert _segment_tokens(plan, 2) == [tuple(TASK), tuple(DOC_A)]
    assert _segment_tokens(plan, 3) == [tuple(TASK)]
    assert [s.num_requests for s in plan.segments] == [4, 3, 2]


def _lift_batch(family_length: int, child_length: int, child_requests: int):
    family = _tokens(1000, family_length)
    child = _tokens(2000, child_length)
    prompts = [family + child + [10 + i] for i in range(child_requests)]
    prompts += [family + [20], family + [21, 22]]
    return prompts, family, child


@pytest.mark.parametrize(
    ("family_length", "child_length", "child_requests", "lifted"),
    [
        (10, 6, 3, True),  # (3 - 1) * 6 = 12 > 10
        (12, 6, 3, False),  # 12 > 12 is false
        (10, 6, 2, False),  # 6 > 10 is false
        (10, 11, 2, True),  # 11 > 10
    ],
)
def test_enlarge_rule_lifts_child_exactly_when_inequality_holds(
    family_length, child_length, child_requests, lifted
):
    prompts, family, child = _lift_batch(family_length, child_length, child_requests)
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    prefixes = sorted((g.prefix_length, len(g.request_ids)) for g in plan.groups)
    if lifted:
        assert prefixes == [(family_length, 2), (family_length + child_length, child_requests)]
    else:
        assert prefixes == [(family_length, child_requests + 2)]
    # Lifting never changes the chains.
    assert _segment_tokens(plan, 0) == [tuple(family), tuple(child)]
    assert _segment_tokens(plan, child_requests) == [tuple(family)]


def test_enlarge_merges_family_into_its_single_remaining_child():
    family = _tokens(1000, 10)
    big, small = _tokens(2000, 8), _tokens(3000, 4)
    prompts = [family + big + [i] for i in range(3)] + [family + small + [7], family + small + [8]]
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    # big: (3 - 1) * 8 > 10 lifted; small: 4 > 10 not; family keeps only small -> merged.
    assert sorted(g.prefix_length for g in plan.groups) == [14, 18]


def test_enlarge_leaves_single_request_unshared():
    family = _tokens(1000, 10)
    big = _tokens(2000, 8)
    prompts = [family + big + [i] for i in range(3)] + [family + [50]]
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    lone = next(r for r in plan.requests if r.rows == (3,))
    assert lone.group_prefix_length == 0 and lone.chain == (0,)
    assert sorted(g.prefix_length for g in plan.groups) == [0, 18]
    assert plan.stats.shared_groups == 1


def test_decode_first_orders_by_decode_to_prompt_ratio():
    other = _tokens(5000, 10)
    prompts = [TASK + [1], other + [2], TASK + [3], [7, 8], other + [4, 4, 4]]
    max_tokens = [10, 40, 30, 1, 20]
    plan = build_plan(prompts, max_tokens)
    check_plan(plan, prompts, max_tokens)
    order = [r.rows[0] for r in plan.requests]
    # Ratios: 10/11, 40/11, 30/11, 1/2, 20/13; the `other` group holds the best (40/11).
    assert order == [1, 4, 2, 0, 3]
    assert [len(g.request_ids) for g in plan.groups] == [2, 2, 1]


def test_decode_first_false_keeps_input_order_per_group():
    other = _tokens(5000, 10)
    prompts = [TASK + [1], other + [2], TASK + [3], [7, 8], other + [4, 4, 4]]
    plan = build_plan(prompts, [10, 40, 30, 1, 20], decode_first=False)
    assert [r.rows[0] for r in plan.requests] == [0, 2, 1, 4, 3]


def test_share_prefixes_false_has_no_segments():
    prompts = [TASK + [1], TASK + [1], TASK + [2], [3]]
    plan = build_plan(prompts, 4, merge_keys=["greedy"] * 4, share_prefixes=False)
    check_plan(plan, prompts, 4, ["greedy"] * 4, share_prefixes=False)
    assert plan.segments == () and plan.stats.shared_groups == 0
    assert len(plan.requests) == 3  # merging still applies
    assert plan.stats.prefill_tokens == 11 + 11 + 1
    assert plan.stats.single_level_prefill_tokens == plan.stats.prefill_tokens
    assert [r.rows for r in plan.requests] == [(3,), (0, 1), (2,)]  # 4/1 > 4/11, then by row


def test_min_shared_tokens_dissolves_short_nodes():
    nine, five = [9, 9, 9, 9], [5, 5, 5, 5]
    prompts = [[1, 2, *nine, 10], [1, 2, *nine, 11], [1, 2, *five, 12], [1, 2, *five, 13]]
    coarse = build_plan(prompts, 4, min_shared_tokens=4)
    check_plan(coarse, prompts, 4, min_shared_tokens=4)
    assert sorted(s.token_ids for s in coarse.segments) == [(1, 2, *five), (1, 2, *nine)]
    assert all(s.parent_id is None and s.start == 0 for s in coarse.segments)
    fine = build_plan(prompts, 4, min_shared_tokens=1)
    check_plan(fine, prompts, 4, min_shared_tokens=1)
    assert [s.token_ids for s in fine.segments if s.parent_id is None] == [(1, 2)]
    assert fine.stats.prefill_tokens == fine.stats.unique_tokens < coarse.stats.prefill_tokens
    none_long_enough = build_plan(prompts, 4, min_shared_tokens=7)
    assert none_long_enough.segments == ()


def test_identical_prompts_merge_only_with_equal_keys():
    prompt = TASK + [1]
    prompts = [prompt, prompt, prompt, prompt, prompt]
    keys = ["a", "a", "b", None, None]
    plan = build_plan(prompts, 8, merge_keys=keys)
    check_plan(plan, prompts, 8, keys)
    assert sorted(r.rows for r in plan.requests) == [(0, 1), (2,), (3,), (4,)]
    # The unmerged copies share the whole prompt: one segment, empty suffixes.
    assert [s.token_ids for s in plan.segments] == [tuple(prompt)]
    assert all(r.suffix == [] and r.prefix_length == 11 for r in plan.requests)
    assert plan.stats.prefill_tokens == plan.stats.unique_tokens == 11
    assert plan.stats.prompt_tokens == 55
    unmerged = build_plan(prompts, 8)
    assert len(unmerged.requests) == 5


def test_different_max_tokens_are_not_merged():
    plan = build_plan([[1, 2], [1, 2]], [3, 4], merge_keys=["k", "k"])
    assert sorted(r.max_tokens for r in plan.requests) == [3, 4]


def test_prompt_that_is_a_prefix_of_another():
    prompts = [TASK, TASK + [1, 2], TASK + [3]]
    plan = build_plan(prompts, 8)
    check_plan(plan, prompts, 8)
    whole = next(r for r in plan.requests if r.rows == (0,))
    assert whole.prefix_length == len(TASK) and list(whole.suffix) == []


def test_accepts_tuples_and_numpy_arrays():
    prompts = [tuple(TASK + [1]), np.array(TASK + [2], dtype=np.int64), TASK + [3]]
    plan = build_plan(prompts, np.array([3, 4, 5]))
    check_plan(plan, [list(p) for p in prompts], [3, 4, 5])
    assert plan.segments[0].token_ids == tuple(TASK)
    assert all(type(t) is int for t in plan.segments[0].token_ids)
    assert any(p is plan.requests[0].token_ids for p in prompts), "prompts are not copied"


def test_empty_batch():
    plan = build_plan([], 16)
    assert plan.requests == plan.segments == plan.groups == ()
    assert plan.stats.rows == plan.stats.prompt_tokens == plan.stats.prefill_tokens == 0
    assert plan.stats.saving_ratio == 0.0


def test_report_and_stats_dict():
    plan = build_plan([TASK + [1], TASK + [2]], 8)
    text = plan.report()
    for word in (
        "rows",
        "requests",
        "groups",
        "segments",
        "prompt tokens",
        "unique tokens",
        "prefill tokens",
        "saving ratio",
        "seconds",
    ):
        assert word in text
    stats = plan.stats.as_dict()
    assert stats["prompt_tokens"] == 22 and stats["prefill_tokens"] == 12
    assert set(stats) >= {"rows", "requests", "saving_ratio", "seconds", "segments"}


@pytest.mark.parametrize(
    ("arguments", "options", "error", "name"),
    [
        (([[1]], 0), {}, ValueError, "max_tokens"),
        (([[1]], [1, 2]), {}, ValueError, "max_tokens"),
        (([[1]], [0]), {}, ValueError, r"max_tokens\[0\]"),
        (([[1]], 1.5), {}, TypeError, "max_tokens"),
        (([[1]], True), {}, TypeError, "max_tokens"),
        (([[1], []], 1), {}, ValueError, r"token_ids\[1\]"),
        (([[1], [-1]], 1), {}, ValueError, r"token_ids\[1\]"),
        (([[1], [2**32]], 1), {}, ValueError, r"token_ids\[1\]"),
        (([[1], [1.5]], 1), {}, TypeError, r"token_ids\[1\]"),
        (([[1], "ab"], 1), {}, TypeError, r"token_ids\[1\]"),
        (([[1], 7], 1), {}, TypeError, r"token_ids\[1\]"),
        (("ab", 1), {}, TypeError, "token_ids"),
        (([[1]], 1), {"min_shared_tokens": 0}, ValueError, "min_shared_tokens"),
        (([[1]], 1), {"min_shared_tokens": 2.0}, TypeError, "min_shared_tokens"),
        (([[1]], 1), {"merge_keys": [None, None]}, ValueError, "merge_keys"),
        (([[1]], 1), {"merge_keys": [[1]]}, TypeError, r"merge_keys\[0\]"),
        (([[1]], 1), {"decode_first": "yes"}, TypeError, "decode_first"),
        (([[1]], 1), {"share_prefixes": None}, TypeError, "share_prefixes"),
    ],
)
def test_bad_arguments_name_the_parameter(arguments, options, error, name):
    with pytest.raises(error, match=name):
        build_plan(*arguments, **options)


def test_deep_nesting_does_not_recurse():
    # Each prompt extends the previous one: a chain of 1,500 nested segments.
    prompts = [list(range(length)) for length in range(1, 1501)]
    plan = build_plan(prompts, 1, min_shared_tokens=1)
    assert len(plan.segments) == 1499
    assert plan.stats.prefill_tokens == plan.stats.unique_tokens == 1500


def test_planner_scale_benchmark_smoke():
    from llm_operator_bench.suites.planner import run_planner_benchmark

    result = run_planner_benchmark(200, 100, seed=1)
    assert result["prompts"] == 200 and result["tokens"] > 0
    assert 0.5 < result["saving_ratio"] < 1.0 and result["groups"] >= 1
    assert set(result) >= {"seconds", "prompts_per_second", "tokens_per_second", "segments"}


def test_input_order_after_heavy_merging():
    # Six merged rows make request numbers and row numbers diverge.
    prompts = [[1, 1]] * 6 + [[2, 2, 2, 2, 5], [3, 3, 3, 3, 1], [3, 3, 3, 3, 2]]
    keys = ["k"] * 6 + [None] * 3
    plan = build_plan(prompts, 4, merge_keys=keys, decode_first=False)
    check_plan(plan, prompts, 4, keys)
    assert [r.rows[0] for r in plan.requests] == [0, 6, 7, 8]
