"""Paged-KV attention on the torch path (kernels/torch_attention.py, the batches and checks of
kernels/layout.py): store_kv, prefix/own attention, merge.

Oracle: dense float64 attention over explicitly concatenated [prefix ; own] K/V (the
tensors the test wrote, not read back from the cache), an explicit causal mask, and GQA
by repeat_interleave. Cache slots nobody wrote hold NaN, so any read of them shows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_operator.kernels import own_batch, prefix_batch, torch_attention
from llm_operator.kernels.torch_attention import (
    merge_attention_states,
    own_attention,
    prefix_attention,
    store_kv,
)

# Output vs the float64 oracle; parts are rounded to the dtype before the merge.
OUT_TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
# lse is accumulated in fp32 from the same rounded inputs the oracle sees, for every dtype.
LSE_TOLERANCE = {"atol": 2e-5, "rtol": 1e-5}

# Batches as (context_len, query_count) per request; all share one prefix.
BATCHES = {
    "decode_only": [(1, 1), (17, 1), (40, 1), (5, 1)],
    "prefill_only": [(13, 13), (37, 37), (3, 3)],
    "chunk_in_middle": [(45, 20), (33, 16)],  # rows at own positions 25..44 and 17..32
    "mixed": [(30, 1), (20, 20), (12, 0), (50, 17), (9, 1), (64, 64)],
}


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, num_heads, head_dim]
    prefix_k: torch.Tensor  # [prefix_len, num_kv_heads, head_dim]
    prefix_v: torch.Tensor
    own_k: list[torch.Tensor]  # per request: [context_len, num_kv_heads, head_dim]
    own_v: list[torch.Tensor]
    query_counts: list[int]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    prefix_blocks: torch.Tensor  # [ceil(prefix_len / block_size)]
    block_tables: torch.Tensor  # [B, max_blocks], padded with junk
    query_start: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B]
    scale: float

    @property
    def prefix_len(self) -> int:
        return self.prefix_k.shape[0]


def slots_of(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    position = torch.arange(length)
    return blocks.long()[position // block_size] * block_size + position % block_size


def make_case(
    *,
    prefix_len: int,
    requests: Sequence[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> PagedCase:
    """Random K/V and queries, written into a NaN-filled cache on shuffled block ids."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    num_heads = num_kv_heads * group
    blocks_per = [-(-length // block_size) for length in (prefix_len, *(c for c, _ in requests))]
    num_blocks = sum(blocks_per) + 3  # spare blocks stay NaN
    block_ids = torch.randperm(num_blocks, generator=generator)  # shuffled, non-contiguous
    owned = list(torch.split(block_ids[: sum(blocks_per)], blocks_per))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype)
    v_cache = torch.full(shape, math.nan, dtype=dtype)

    prefix_k, prefix_v = (
        randn(prefix_len, num_kv_heads, head_dim),
        randn(prefix_len, num_kv_heads, head_dim),
    )
    store_kv(k_cache, v_cache, prefix_k, prefix_v, slots_of(owned[0], prefix_len, block_size))
    own_k = [randn(c, num_kv_heads, head_dim) for c, _ in requests]
    own_v = [randn(c, num_kv_heads, head_dim) for c, _ in requests]
    if requests:  # one store for every request's tokens, as an engine step does
        slots = torch.cat(
            [slots_of(owned[1 + b], c, block_size) for b, (c, _) in enumerate(requests)]
        )
        store_kv(k_cache, v_cache, torch.cat(own_k), torch.cat(own_v), slots)

    max_blocks = max(blocks_per[1:], default=0) + 1
    block_tables = torch.full((len(requests), max_blocks), -1, dtype=index_dtype)
    block_tables[1::2] = 2**30  # padding may hold any value
    for b, blocks in enumerate(owned[1:]):
        block_tables[b, : len(blocks)] = blocks.to(index_dtype)
    counts = [n for _, n in requests]
    query_start = torch.tensor(list(itertools.accumulate(counts, initial=0)))
    return PagedCase(
        q=randn(sum(counts), num_heads, head_dim),
        prefix_k=prefix_k,
        prefix_v=prefix_v,
        own_k=own_k,
        own_v=own_v,
        query_counts=counts,
        k_cache=k_cache,
        v_cache=v_cache,
        prefix_blocks=owned[0].to(index_dtype),
        block_tables=block_tables,
        query_start=query_start.to(index_dtype),
        context_lens=torch.tensor([c for c, _ in requests], dtype=index_dtype),
        scale=head_dim**-0.5,
    )


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 oracle. q: [n, heads, dim]; k, v: [keys, kv_heads, dim]; visible: [n, keys]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [keys, heads, dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse.T


def dense_reference(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's rows over [prefix ; own], float64."""
    outs, lses = [], []
    start = 0
    for k, v, count in zip(case.own_k, case.own_v, case.query_counts):
        keys = torch.cat([case.prefix_k, k])  # [prefix_len + context_len, kv, dim]
        values = torch.cat([case.prefix_v, v])
        position = keys.shape[0] - count + torch.arange(count)  # [n]
        visible = torch.arange(keys.shape[0])[None, :] <= position[:, None]
        out, lse = dense_attention(case.q[start : start + count], keys, values, visible, case.scale)
        outs.append(out)
        lses.append(lse)
        start += count
    if not outs:
        return case.q.double(), case.q.double()[..., 0]
    return torch.cat(outs), torch.cat(lses)


def cache_shape(case: PagedCase) -> dict:
    return {"block_size": case.k_cache.shape[1], "num_blocks": case.k_cache.shape[0]}


def attend_prefix(case: PagedCase, q: torch.Tensor, blocks: torch.Tensor, length: int):
    """Every row of q against one segment (one batch, one segment)."""
    batch = prefix_batch(
        [range(q.shape[0])], [blocks], [length], num_rows=q.shape[0], **cache_shape(case)
    )
    return prefix_attention(q, case.k_cache, case.v_cache, batch, case.scale)


def split_attention(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = attend_prefix(case, case.q, case.prefix_blocks, case.prefix_len)
    batch = own_batch(case.query_start, case.block_tables, case.context_lens, **cache_shape(case))
    own = own_attention(case.q, case.k_cache, case.v_cache, batch, case.scale)
    return merge_attention_states([prefix, own])


def assert_matches_dense(case: PagedCase) -> None:
    out, lse = split_attention(case)
    expected_out, expected_lse = dense_reference(case)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert lse.dtype == torch.float32 and lse.shape == case.q.shape[:2]
    torch.testing.assert_close(out.double(), expected_out, **OUT_TOLERANCE[case.q.dtype])
    torch.testing.assert_close(lse.double(), expected_lse, **LSE_TOLERANCE)


# ---------------------------------------------------------------- store_kv


def check_store_writes_exactly_the_given_slots(
    store, slot_dtype, *, dtype=torch.float32, num_kv_heads=2, head_dim=8
) -> None:
    """``store`` (a store_kv implementation) changes the 11 given slots of both caches to
    exactly k and v, and nothing else."""
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size = 6, 4
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), -7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, -9.0)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:11]
    k = torch.randn(11, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(11, num_kv_heads, head_dim, generator=generator).to(dtype)
    store(k_cache, v_cache, k, v, slots.to(slot_dtype))

    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], v, rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert bool((flat_k[untouched] == -7.0).all()) and bool((flat_v[untouched] == -9.0).all())


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_exactly_the_given_slots(slot_dtype):
    check_store_writes_exactly_the_given_slots(store_kv, slot_dtype)


def test_store_kv_into_strided_cache_views():
    storage = torch.zeros(5, 4, 3, 16)  # k and v interleaved in one buffer: non-contiguous views
    k_cache, v_cache = storage[..., ::2], storage[..., 1::2]  # [5, 4, 3, 8] each
    k = torch.rand(3, 3, 8) + 1
    store_kv(k_cache, v_cache, k, k + 1, torch.tensor([0, 9, 19]))
    torch.testing.assert_close(k_cache[2, 1], k[1], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[4, 3], k[2] + 1, atol=0, rtol=0)
    assert int((storage != 0).sum()) == 3 * 3 * 16  # three slots of both caches, nothing else


# ---------------------------------------------------------------- prefix + own == dense


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_split_attention_matches_dense_fp32(block_size, head_dim, group):
    case = make_case(
        prefix_len=37,
        requests=BATCHES["mixed"],
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        seed=block_size * 1000 + head_dim + group,
    )
    assert_matches_dense(case)


@pytest.mark.parametrize("prefix_len", [0, 1, 37, 70])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_split_attention_matches_dense_for_batch_kinds(batch, prefix_len):
    case = make_case(
        prefix_len=prefix_len,
        requests=BATCHES[batch],
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        seed=prefix_len,
    )
    assert_matches_dense(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(16, 64, 1), (16, 128, 4), (32, 64, 8), (1, 128, 8)]
)
def test_split_attention_matches_dense_half_precision(dtype, block_size, head_dim, group):
    case = make_case(
        prefix_len=45,
        requests=BATCHES["mixed"],
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=7,
    )
    assert_matches_dense(case)


def test_int64_indices_and_tiny_work_budget(monkeypatch):
    """Row tiles and request groups (forced by a tiny budget) give the same answer."""
    case = make_case(
        prefix_len=29,
        requests=BATCHES["mixed"] + BATCHES["chunk_in_middle"],
        block_size=8,
        num_kv_heads=2,
        group=4,
        head_dim=16,
        index_dtype=torch.int64,
        seed=3,
    )
    whole = split_attention(case)
    monkeypatch.setattr(torch_attention, "MAX_SCORE_ELEMENTS", 64)
    tiled = split_attention(case)
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-6)
    assert_matches_dense(case)


def test_explicit_path_matches_the_fused_cpu_kernel(monkeypatch):
    """The matmul/logsumexp path (non-CPU devices, or no fused op) gives the same answer."""
    case = make_case(
        prefix_len=29,
        requests=BATCHES["mixed"],
        block_size=8,
        num_kv_heads=2,
        group=4,
        head_dim=16,
        seed=4,
    )
    fused = split_attention(case)
    monkeypatch.setattr(torch_attention, "_FLASH_CPU", None)
    explicit = split_attention(case)
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)
    assert_matches_dense(case)


def test_own_attention_work_plan_covers_rows_once_within_budget(monkeypatch):
    monkeypatch.setattr(torch_attention, "MAX_SCORE_ELEMENTS", 20_000)
    counts = [1, 1, 300, 2, 1, 17, 40, 0, 3, 1]
    context_lens = [90, 12, 310, 5, 200, 17, 100, 8, 60, 100]
    starts = list(itertools.accumulate(counts, initial=0))
    tables = [list(range(-(-n // 16))) for n in context_lens]
    batch = own_batch(starts, tables, context_lens, block_size=16, num_blocks=20)
    num_heads, num_kv_heads, head_dim = 8, 2, 16
    kv_elements = 2 * num_kv_heads * head_dim
    groups = torch_attention._groups(batch, num_heads, num_kv_heads, head_dim)
    assert groups is torch_attention._groups(batch, num_heads, num_kv_heads, head_dim)  # cached
    rows = sorted(r for group in groups for r in group.rows.tolist())
    assert rows == list(range(starts[-1]))
    for group in groups:
        counts_in = group.row_valid.sum(dim=1).tolist()
        padded = group.row_index.shape[1]
        cost = len(counts_in) * group.slots.shape[1] * (num_heads * padded + kv_elements)
        assert len(counts_in) == 1 or cost <= 20_000
        assert group.valid_positions is None or len(group.valid_positions) == sum(counts_in)
    assert any(group.row_index.shape[0] > 1 for group in groups)


def _padded_and_useful(group, num_heads: int, kv_elements: int) -> tuple[int, int]:
    rows = max(len(p.rows) for p in group)
    keys = max(p.key_len for p in group)
    padded = len(group) * keys * (num_heads * rows + kv_elements)
    useful = sum(p.key_len * (num_heads * len(p.rows) + kv_elements) for p in group)
    return padded, useful


def test_small_pieces_share_one_group_whatever_their_padding():
    """Decode rows: a call per group costs more than padding them to one shape."""
    pieces = [
        torch_attention._Piece(i, (i,), key_len)
        for i, key_len in enumerate([9, 400, 17, 30, 200, 33, 8])
    ]
    groups = torch_attention._group_pieces(pieces, num_heads=4, kv_elements=64)
    assert [sorted(p.table for p in g) for g in groups] == [list(range(7))]


def test_large_pieces_are_grouped_within_twice_their_work():
    """Prefill tiles: padding may at most double a group's work (plus one group's overhead),
    so very different key lengths or row counts never share a group."""
    num_heads, kv_elements = 8, 64
    shapes = [(64, 1000), (64, 4000), (60, 1100), (64, 1900), (8, 3000), (64, 4100), (33, 900)]
    pieces = [
        torch_attention._Piece(i, tuple(range(rows)), keys) for i, (rows, keys) in enumerate(shapes)
    ]
    groups = torch_attention._group_pieces(pieces, num_heads=num_heads, kv_elements=kv_elements)
    assert sorted(p.table for g in groups for p in g) == list(range(len(shapes)))
    for group in groups:
        padded, useful = _padded_and_useful(group, num_heads, kv_elements)
        assert padded <= 2 * useful + torch_attention.GROUP_OVERHEAD_ELEMENTS
    together = {frozenset(p.table for p in g) for g in groups}
    assert not any({0, 1} <= g for g in together)  # 1000 and 4000 keys: 4x padding
    assert any({1, 5} <= g for g in together)  # 4000 and 4100 keys, 64 rows: alike
    assert len(groups) < len(shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_cache_views_give_the_same_answer(dtype):
    """k and v interleaved in one buffer (non-contiguous views) read like contiguous caches."""
    case = make_case(
        prefix_len=19,
        requests=BATCHES["mixed"],
        block_size=4,
        num_kv_heads=2,
        group=2,
        head_dim=8,
        dtype=dtype,
        seed=11,
    )
    contiguous = split_attention(case)
    storage = torch.stack([case.k_cache, case.v_cache], dim=-1).flatten(-2)  # [..., dim * 2]
    case.k_cache, case.v_cache = storage[..., ::2], storage[..., 1::2]
    assert not case.k_cache.is_contiguous()
    torch.testing.assert_close(split_attention(case), contiguous, atol=0, rtol=0)
    assert_matches_dense(case)


def test_prefix_attention_is_shared_and_non_causal():
    """Every row of every request sees the whole prefix: rows with equal queries agree."""
    case = make_case(
        prefix_len=21, requests=[(5, 3), (9, 1)], block_size=4, num_kv_heads=1, group=2, head_dim=8
    )
    q = case.q.clone()
    q[3] = q[0]
    out, lse = attend_prefix(case, q, case.prefix_blocks, 21)
    expected_out, expected_lse = dense_attention(
        q, case.prefix_k, case.prefix_v, torch.ones(4, 21, dtype=torch.bool), case.scale
    )
    torch.testing.assert_close(out.double(), expected_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[3], out[0], atol=0, rtol=0)


@st.composite
def paged_cases(draw):
    requests = []
    for _ in range(draw(st.integers(0, 4))):
        context_len = draw(st.integers(0, 24))
        requests.append((context_len, draw(st.integers(0, context_len))))
    return make_case(
        prefix_len=draw(st.integers(0, 20)),
        requests=requests,
        block_size=draw(st.sampled_from([1, 2, 3, 8])),
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None)
@given(case=paged_cases())
def test_split_attention_matches_dense_property(case):
    assert_matches_dense(case)


# ---------------------------------------------------------------- merge


def prefix_key_sets(num_sets: int, seed: int = 5):
    """One query batch and a block-size-1 prefix whose keys are dealt into disjoint sets."""
    case = make_case(
        prefix_len=50, requests=[(4, 4), (6, 1)], block_size=1, num_kv_heads=2, group=4, head_dim=32
    )
    owner = torch.randint(num_sets, (50,), generator=torch.Generator().manual_seed(seed))
    tables = [case.prefix_blocks[owner == index] for index in range(num_sets)]
    return case, tables


def attend_to(case: PagedCase, table: torch.Tensor):
    generator = torch.Generator().manual_seed(table.shape[0])
    shuffled = table[torch.randperm(table.shape[0], generator=generator)]  # order is irrelevant
    return attend_prefix(case, case.q, shuffled, shuffled.shape[0])


def segments_case(lengths: list[int], block_size: int, seed: int):
    """A case whose prefix is cut into segments: segment i owns whole blocks of it and
    reads lengths[i] tokens. Returns (case, block cuts, per-segment block tables)."""
    per_block = [-(-n // block_size) for n in lengths]
    cuts = list(itertools.accumulate(per_block, initial=0))
    case = make_case(
        prefix_len=cuts[-1] * block_size,
        requests=[(3, 3), (2, 1), (5, 2), (4, 4)],
        block_size=block_size,
        num_kv_heads=2,
        group=4,
        head_dim=16,
        seed=seed,
    )
    return case, cuts, [case.prefix_blocks[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("block_size", [1, 4])
def test_prefix_batch_of_several_segments_matches_each_alone(block_size):
    """Segments of different lengths in one batch (grouped and padded together) give each
    row what its own segment alone gives; a row in no segment gets out 0, lse -inf."""
    lengths = [7, 13, 4, 30]
    case, cuts, tables = segments_case(lengths, block_size, seed=11)
    segment_rows = [[0, 5, 7], [1, 2], [], [3, 6, 8, 9]]  # row 4 reads no segment
    batch = prefix_batch(segment_rows, tables, lengths, num_rows=10, **cache_shape(case))
    out, lse = prefix_attention(case.q, case.k_cache, case.v_cache, batch, case.scale)
    for rows, table, length in zip(segment_rows, tables, lengths):
        if rows:
            alone = attend_prefix(case, case.q[rows], table, length)
            torch.testing.assert_close(out[rows], alone.out, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lse[rows], alone.lse, atol=1e-6, rtol=1e-6)
    assert bool((out[4] == 0).all()) and bool(torch.isneginf(lse[4]).all())
    # Segment 1 in the dense oracle: the keys written at its positions.
    first = cuts[1] * block_size
    keys = case.prefix_k[first : first + lengths[1]]
    values = case.prefix_v[first : first + lengths[1]]
    expected, _ = dense_attention(
        case.q[[1, 2]], keys, values, torch.ones(2, lengths[1], dtype=torch.bool), case.scale
    )
    torch.testing.assert_close(out[[1, 2]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_sets", [1, 2, 3])
def test_merge_of_disjoint_key_sets_equals_attention_over_all(num_sets):
    case, tables = prefix_key_sets(num_sets)
    assert all(table.numel() > 0 for table in tables)
    out, lse = merge_attention_states([attend_to(case, table) for table in tables])
    expected_out, expected_lse = dense_attention(
        case.q, case.prefix_k, case.prefix_v, torch.ones(5, 50, dtype=torch.bool), case.scale
    )
    torch.testing.assert_close(out.double(), expected_out, **OUT_TOLERANCE[torch.float32])
    torch.testing.assert_close(lse.double(), expected_lse, **LSE_TOLERANCE)


def test_merge_is_associative_and_ignores_empty_parts():
    case, tables = prefix_key_sets(3, seed=8)
    parts = [attend_to(case, table) for table in tables]
    empty = attend_prefix(case, case.q, tables[0][:0], 0)
    assert bool(torch.isneginf(empty.lse).all()) and bool((empty.out == 0).all())
    flat = merge_attention_states(parts)
    nested = merge_attention_states([merge_attention_states(parts[:2]), parts[2]])
    with_empty = merge_attention_states([empty, *parts, empty])
    torch.testing.assert_close(nested, flat, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(with_empty, flat, atol=1e-6, rtol=1e-6)


def test_merge_handles_negative_infinity_without_nan():
    generator = torch.Generator().manual_seed(2)
    out_a, out_b = torch.randn(2, 3, 2, 4, generator=generator).unbind(0)
    lse_a, lse_b = torch.randn(2, 3, 2, generator=generator).unbind(0)
    out_a[0], lse_a[0] = math.nan, -math.inf  # part a saw no key for row 0
    out_a[2], lse_a[2] = math.nan, -math.inf  # row 2: no part saw a key
    out_b[2], lse_b[2] = math.nan, -math.inf

    out, lse = merge_attention_states([(out_a, lse_a), (out_b, lse_b)])
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(lse[0], lse_b[0])
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())
    weight_a = torch.sigmoid(lse_a[1] - lse_b[1])[:, None]
    torch.testing.assert_close(out[1], weight_a * out_a[1] + (1 - weight_a) * out_b[1])
    torch.testing.assert_close(lse[1], torch.logaddexp(lse_a[1], lse_b[1]))

    single_out, single_lse = merge_attention_states([(out_a, lse_a)])
    assert bool((single_out[0] == 0).all()) and bool(torch.isneginf(single_lse[0]).all())
    torch.testing.assert_close(single_out[1], out_a[1])


def test_merge_keeps_the_parts_dtype():
    out = torch.randn(3, 2, 4).to(torch.bfloat16)
    lse = torch.randn(3, 2)
    merged = merge_attention_states([(out, lse), (out, lse)])
    assert merged.out.dtype == torch.bfloat16 and merged.lse.dtype == torch.float32
    torch.testing.assert_close(merged.lse, lse + math.log(2))


# ---------------------------------------------------------------- argument errors


def small_inputs(**overrides):
    """Valid arguments for every operation; overrides replace some by bad ones."""
    cache = torch.zeros(4, 2, 2, 8)
    inputs = {
        "q": torch.zeros(3, 4, 8),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "segment_rows": [[0, 2], [1]],
        "segment_blocks": [torch.tensor([2, 0]), [3]],
        "lengths": [3, 1],
        "query_start": torch.tensor([0, 1, 3]),
        "block_tables": torch.tensor([[1, 9], [3, 9]]),
        "context_lens": torch.tensor([2, 2]),
        "k": torch.zeros(3, 2, 8),
        "v": torch.zeros(3, 2, 8),
        "slot_mapping": torch.tensor([0, 1, 7]),
        "num_rows": 3,
        "block_size": 2,
        "num_blocks": 4,
    }
    inputs.update(overrides)
    return inputs


def build(operation: str, a: dict):
    shape = {"block_size": a["block_size"], "num_blocks": a["num_blocks"]}
    if operation == "prefix":
        return prefix_batch(
            a["segment_rows"], a["segment_blocks"], a["lengths"], num_rows=a["num_rows"], **shape
        )
    return own_batch(a["query_start"], a["block_tables"], a["context_lens"], **shape)


def call(operation: str, **overrides):
    a = small_inputs(**overrides)
    if operation == "store":
        return store_kv(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"])
    batch = a.get("batch") or build(operation, small_inputs())
    attend = prefix_attention if operation == "prefix" else own_attention
    return attend(a["q"], a["k_cache"], a["v_cache"], batch, a.get("scale", 0.5))


def test_small_inputs_are_valid():
    call("store")
    call("prefix")
    call("own")


@pytest.mark.parametrize(
    ("operation", "overrides", "error", "message"),
    [
        ("prefix", {"q": torch.zeros(3, 3, 8)}, ValueError, "not a multiple of"),
        ("own", {"q": torch.zeros(3, 5, 8)}, ValueError, "not a multiple of"),
        ("prefix", {"q": torch.zeros(3, 4, 16)}, ValueError, "head_dim 16"),
        ("own", {"q": torch.zeros(3, 4)}, ValueError, "q must be"),
        ("own", {"q": torch.zeros(4, 4, 8)}, ValueError, "built for 3"),
        ("prefix", {"q": torch.zeros(3, 4, 8, dtype=torch.float16)}, TypeError, "dtype"),
        ("prefix", {"q": torch.zeros(3, 4, 8, device="meta")}, ValueError, "meta"),
        ("prefix", {"v_cache": torch.zeros(4, 2, 1, 8)}, ValueError, "v_cache shape"),
        ("prefix", {"k_cache": torch.zeros(4, 2, 2, 8, dtype=torch.int32)}, TypeError, "float"),
        (
            "own",
            {"k_cache": torch.zeros(5, 2, 2, 8), "v_cache": torch.zeros(5, 2, 2, 8)},
            ValueError,
            "built for 4 blocks",
        ),
        ("prefix", {"batch": "segments"}, TypeError, "PrefixBatch"),
        ("own", {"scale": float("nan")}, ValueError, "scale"),
        ("store", {"k": torch.zeros(3, 1, 8), "v": torch.zeros(3, 1, 8)}, ValueError, "k must"),
        ("store", {"v": torch.zeros(2, 2, 8)}, ValueError, "v shape"),
        ("store", {"v": torch.zeros(3, 2, 8, dtype=torch.bfloat16)}, TypeError, "v dtype"),
        ("store", {"slot_mapping": torch.tensor([0, 1])}, ValueError, "3 tokens"),
        ("store", {"slot_mapping": torch.tensor([0, 1, 8])}, ValueError, r"\[0, 8\)"),
        ("store", {"slot_mapping": torch.tensor([0, -1, 2])}, ValueError, "slot_mapping values"),
    ],
)
def test_bad_arguments_raise_clear_errors(operation, overrides, error, message):
    with pytest.raises(error, match=message):
        call(operation, **overrides)


@pytest.mark.parametrize(
    ("operation", "overrides", "error", "message"),
    [
        ("prefix", {"lengths": [5, 1]}, ValueError, "need 3 blocks"),
        ("prefix", {"lengths": [-1, 1]}, ValueError, "lengths"),
        ("prefix", {"lengths": [2.0, 1]}, TypeError, "lengths must hold ints"),
        ("prefix", {"lengths": [3]}, ValueError, "one entry per segment"),
        ("prefix", {"segment_blocks": [torch.tensor([4, 0]), [3]]}, ValueError, "segment_blocks"),
        (
            "prefix",
            {"segment_blocks": [torch.tensor([2.0, 0.0]), [3]]},
            TypeError,
            "int32 or int64",
        ),
        ("prefix", {"segment_rows": [[0, 2], [2]]}, ValueError, "two segments"),
        ("prefix", {"segment_rows": [[0, 3], [1]]}, ValueError, r"\[0, 3\)"),
        ("prefix", {"num_rows": -1}, ValueError, "num_rows"),
        ("prefix", {"block_size": 0}, ValueError, "block_size"),
        ("own", {"query_start": torch.tensor([1, 1, 3])}, ValueError, "query_start must run"),
        ("own", {"query_start": torch.tensor([0, 3])}, ValueError, "num_requests \\+ 1"),
        ("own", {"query_start": torch.tensor([0, 4, 3])}, ValueError, "non-decreasing"),
        ("own", {"context_lens": torch.tensor([2, 1])}, ValueError, r"context_lens\[1\]"),
        ("own", {"context_lens": torch.tensor([2, 5])}, ValueError, "need 3 blocks"),
        ("own", {"context_lens": torch.tensor([2])}, ValueError, "context_lens must have"),
        ("own", {"context_lens": torch.tensor([3, 2])}, ValueError, r"block_tables\[0\] values"),
        ("own", {"block_tables": torch.tensor([1, 3])}, ValueError, "2 dimension"),
        ("own", {"block_tables": "blocks"}, TypeError, "sequence of ints"),
    ],
)
def test_bad_batches_raise_clear_errors(operation, overrides, error, message):
    with pytest.raises(error, match=message):
        build(operation, small_inputs(**overrides))


@pytest.mark.parametrize(
    ("parts", "error", "message"),
    [
        ([], ValueError, "at least one"),
        (torch.zeros(2, 3), TypeError, "sequence"),
        ([(torch.zeros(3, 2, 4),)], TypeError, "pair"),
        ([(torch.zeros(3, 2, 4), torch.zeros(3, 3))], ValueError, "lse shape"),
        (
            [(torch.zeros(3, 2, 4), torch.zeros(3, 2)), (torch.zeros(2, 2, 4), torch.zeros(2, 2))],
            ValueError,
            "parts\\[1\\] out",
        ),
        (
            [
                (torch.zeros(3, 2, 4), torch.zeros(3, 2)),
                (torch.zeros(3, 2, 4, dtype=torch.float16), torch.zeros(3, 2)),
            ],
            ValueError,
            "float16",
        ),
    ],
)
def test_merge_rejects_bad_parts(parts, error, message):
    with pytest.raises(error, match=message):
        merge_attention_states(parts)
