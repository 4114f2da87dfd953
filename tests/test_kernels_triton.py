"""Triton kernels (llm_operator.kernels.triton_attention) against the torch reference.

They run on CPU tensors under the Triton interpreter (conftest sets TRITON_INTERPRET=1
before anything imports triton). Cache slots nobody wrote hold NaN, so a stray read shows;
block ids are shuffled and block tables padded with junk. The interpreter rounds fp32 to
bf16 by truncation, hence the looser bf16 tolerance (up to one bf16 ulp). The interpreter
runs the fp32-operand path of the matrix products; the last test compiles the kernels for
sm_90 (no GPU needed) so the fp16/bf16 tensor-core path at least builds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from helpers import compile_for_sm90  # noqa: E402

# Tolerances (Triton and the reference: same inputs, fp32 inside, outputs rounded to the
# dtype) and own-request batches as (context_len, query_count), shared with the torch tests.
from test_kernels_torch import (  # noqa: E402
    BATCHES,
    LSE_TOLERANCE,
    OUT_TOLERANCE,
    check_store_writes_exactly_the_given_slots,
)

from llm_operator.kernels import layout, torch_attention  # noqa: E402
from llm_operator.kernels import triton_attention as tri  # noqa: E402


@dataclass
class Case:
    q: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unused
    v_cache: torch.Tensor
    prefix: layout.PrefixBatch
    own: layout.OwnBatch
    scale: float


def make_case(
    *,
    segments: Sequence[tuple[int, Sequence[int]]] | None = None,
    prefix_len: int = 37,
    requests: Sequence[tuple[int, int]] = BATCHES["mixed"],
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Case:
    """Random q and K/V in a NaN-filled cache on shuffled blocks.

    segments: (length, q rows) per prefix segment; default: one segment of prefix_len
    tokens read by every row. requests: (context_len, query_count) per own request.
    """
    generator = torch.Generator().manual_seed(seed)
    num_rows = sum(n for _, n in requests)
    if segments is None:
        segments = [(prefix_len, range(num_rows))]
    lengths = [length for length, _ in segments] + [c for c, _ in requests]
    blocks_per = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_per) + 3  # spare blocks stay NaN
    block_ids = torch.randperm(num_blocks, generator=generator)
    owned = list(torch.split(block_ids[: sum(blocks_per)], blocks_per))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype)
    v_cache = torch.full(shape, math.nan, dtype=dtype)
    slots = torch.cat(
        [
            blocks.long()[torch.arange(length) // block_size] * block_size
            + torch.arange(length) % block_size
            for blocks, length in zip(owned, lengths)
        ]
    )
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    torch_attention.store_kv(k_cache, v_cache, k, v, slots)

    cache = {"block_size": block_size, "num_blocks": num_blocks}
    # Table padding holds junk (the kernels must not read past the used blocks).
    segment_blocks = [
        torch.cat([blocks, torch.tensor([10**6, -5])]).to(index_dtype)
        for blocks in owned[: len(segments)]
    ]
    prefix = layout.prefix_batch(
        [list(rows) for _, rows in segments],
        [b.tolist() for b in segment_blocks],
        [length for length, _ in segments],
        num_rows=num_rows,
        **cache,
    )
    max_blocks = max(blocks_per[len(segments) :], default=0) + 1
    tables = torch.full((len(requests), max_blocks), -1, dtype=index_dtype)
    tables[1::2] = 2**30
    for b, blocks in enumerate(owned[len(segments) :]):
        tables[b, : len(blocks)] = blocks.to(index_dtype)
    starts = list(itertools.accumulate((n for _, n in requests), initial=0))
    own = layout.own_batch(
        torch.tensor(starts, dtype=index_dtype),
        tables,
        torch.tensor([c for c, _ in requests], dtype=index_dtype),
        **cache,
    )
    q = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=generator).to(dtype)
    return Case(q, k_cache, v_cache, prefix, own, head_dim**-0.5)


def assert_close(actual, expected, dtype: torch.dtype) -> None:
    out, lse = actual
    assert out.dtype == dtype and out.shape == expected.out.shape
    assert lse.dtype == torch.float32 and lse.shape == expected.lse.shape
    torch.testing.assert_close(out.float(), expected.out.float(), **OUT_TOLERANCE[dtype])
    torch.testing.assert_close(lse, expected.lse, **LSE_TOLERANCE)


def check_case(case: Case, *, merge: bool = True) -> None:
    """prefix, own and their merge: Triton vs the reference on the same inputs."""
    args = (case.q, case.k_cache, case.v_cache)
    tri_prefix = tri.prefix_attention(*args, case.prefix, case.scale)
    ref_prefix = torch_attention.prefix_attention(*args, case.prefix, case.scale)
    assert_close(tri_prefix, ref_prefix, case.q.dtype)
    tri_own = tri.own_attention(*args, case.own, case.scale)
    ref_own = torch_attention.own_attention(*args, case.own, case.scale)
    assert_close(tri_own, ref_own, case.q.dtype)
    if merge:
        merged = tri.merge_attention_states([tri_prefix, tri_own])
        expected = torch_attention.merge_attention_states([ref_prefix, ref_own])
        assert_close(merged, expected, case.q.dtype)
        assert not bool(merged.out.isnan().any())


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_matches_reference_fp32(block_size, head_dim, group):
    case = make_case(
        prefix_len=37,  # not a multiple of the block size: a partial last block
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        seed=block_size * 1000 + head_dim + group,
    )
    check_case(case)


@pytest.mark.parametrize("prefix_len", [0, 1, 70])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_attention_matches_reference_for_batch_kinds(batch, prefix_len):
    case = make_case(prefix_len=prefix_len, requests=BATCHES[batch], seed=prefix_len + 11)
    check_case(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(16, 64, 1), (32, 128, 4), (16, 64, 8), (32, 128, 8)]
)
def test_attention_matches_reference_half_precision(dtype, block_size, head_dim, group):
    case = make_case(
        prefix_len=45, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype, seed=7
    )
    check_case(case)


def test_multiple_segments_row_tiles_and_rows_in_no_segment():
    """Three segments (one empty) read by scattered rows; rows 3 and 17 read none. The
    long segment's 40 rows x 8 heads span several row tiles and its 150 keys several
    key tiles."""
    requests = [(6, 5), (9, 9), (12, 12), (40, 20), (3, 1), (2, 1)]  # 48 rows
    rows = list(range(48))
    long_rows = [r for r in rows if r not in (3, 17, 30, 31, 32, 7, 44)][:40]
    short_rows = [30, 7, 44]
    empty_rows = [31, 32]
    assert not {3, 17} & set(long_rows + short_rows + empty_rows)
    case = make_case(
        segments=[(5, short_rows), (150, long_rows), (0, empty_rows)],
        requests=requests,
        block_size=16,
        group=8,
        seed=5,
    )
    check_case(case)
    out, lse = tri.prefix_attention(case.q, case.k_cache, case.v_cache, case.prefix, case.scale)
    for row in (3, 17, 31, 32):
        assert bool((out[row] == 0).all()) and bool(torch.isneginf(lse[row]).all())
    assert bool(torch.isfinite(lse[long_rows + short_rows]).all())


def test_segments_with_one_and_many_rows_fp16_int64():
    requests = [(1, 1)] * 6 + [(70, 30)]
    case = make_case(
        segments=[(33, [0]), (64, [1, 2, 3]), (200, list(range(6, 36)))],
        requests=requests,
        block_size=32,
        group=4,
        head_dim=128,
        dtype=torch.float16,
        index_dtype=torch.int64,
        seed=9,
    )
    check_case(case)


def test_strided_q_and_cache_views_give_the_same_answer():
    case = make_case(prefix_len=29, block_size=16, group=2, head_dim=64, seed=3)
    expected_prefix = tri.prefix_attention(
        case.q, case.k_cache, case.v_cache, case.prefix, case.scale
    )
    expected_own = tri.own_attention(case.q, case.k_cache, case.v_cache, case.own, case.scale)
    # q inside a fused qkv buffer; k and v interleaved along head_dim in one buffer.
    num_rows, num_heads, head_dim = case.q.shape
    qkv = torch.zeros(num_rows, num_heads + 4, head_dim)
    qkv[:, :num_heads] = case.q
    q = qkv[:, :num_heads]
    storage = torch.stack([case.k_cache, case.v_cache], dim=-1).flatten(-2)
    k_cache, v_cache = storage[..., ::2], storage[..., 1::2]
    assert not (q.is_contiguous() or k_cache.is_contiguous())
    prefix = tri.prefix_attention(q, k_cache, v_cache, case.prefix, case.scale)
    own = tri.own_attention(q, k_cache, v_cache, case.own, case.scale)
    torch.testing.assert_close(prefix, expected_prefix, atol=0, rtol=0)
    torch.testing.assert_close(own, expected_own, atol=0, rtol=0)


def test_empty_batches_give_zero_and_negative_infinity():
    case = make_case(prefix_len=0, requests=[(4, 0), (7, 0)], seed=1)
    assert case.q.shape[0] == 0
    out, lse = tri.prefix_attention(case.q, case.k_cache, case.v_cache, case.prefix, case.scale)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8)
    case = make_case(segments=[(20, [])], requests=[(3, 2)], seed=2)
    out, lse = tri.prefix_attention(case.q, case.k_cache, case.v_cache, case.prefix, case.scale)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_launch_plan_is_derived_once_per_batch():
    case = make_case(prefix_len=20, requests=BATCHES["decode_only"], group=4, seed=4)
    check_case(case, merge=False)
    keys = [k for k in case.prefix.derived if k[0] == "triton"]
    assert len(keys) == 1
    plan = case.prefix.derived[keys[0]]
    tri.prefix_attention(case.q, case.k_cache, case.v_cache, case.prefix, case.scale)
    assert case.prefix.derived[keys[0]] is plan and plan.num_splits == 1
    (own_key,) = [k for k in case.own.derived if k[0] == "triton"]
    own_plan = case.own.derived[own_key]
    # 4 decode rows x 4 heads: BLOCK_M 16, one tile per request.
    assert own_plan.config[0] == 16 and own_plan.work.shape == (4, 6)


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim"), [(torch.float32, 4, 64), (torch.float16, 3, 128)]
)
def test_key_splits_match_reference(monkeypatch, dtype, group, head_dim):
    """Few row tiles on long segments: keys split into chunks, partial states combined."""
    monkeypatch.setattr(tri, "_target_programs", lambda device: 64)
    monkeypatch.setattr(tri, "SPLIT_MIN_KEYS", 40)
    requests = [(3, 1)] * 7 + [(20, 5)]
    case = make_case(
        segments=[(5, [1, 2]), (0, [3]), (230, [0, 4, 6, 7, 8, 9, 10, 11])],
        requests=requests,
        block_size=16,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=12,
    )
    check_case(case)
    (plan,) = [v for k, v in case.prefix.derived.items() if k[0] == "triton"]
    assert plan.num_splits > 1
    assert sorted(set(plan.work[:, 5].tolist())) == list(range(plan.num_splits))
    out, lse = tri.prefix_attention(case.q, case.k_cache, case.v_cache, case.prefix, case.scale)
    for row in (3, 5):  # an empty segment's row and a row in no segment
        assert bool((out[row] == 0).all()) and bool(torch.isneginf(lse[row]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [False, True])
def test_attend_merges_every_level_in_place(monkeypatch, dtype, splits):
    """``attend`` (the engine's path: own part, then each level merged into one fp32 state
    in place, with and without key splits) equals the reference's parts merged."""
    if splits:
        monkeypatch.setattr(tri, "_target_programs", lambda device: 64)
        monkeypatch.setattr(tri, "SPLIT_MIN_KEYS", 40)
    requests = [(3, 1)] * 7 + [(20, 5)]
    case = make_case(
        segments=[(5, [1, 2]), (0, [3]), (230, [0, 4, 6, 7, 8, 9, 10, 11])],
        requests=requests,
        dtype=dtype,
        seed=21,
    )
    # a second level: another segment over some of the same rows
    second = make_case(segments=[(90, [0, 1, 2, 5, 7])], requests=requests, dtype=dtype, seed=22)
    k_cache = torch.cat([case.k_cache, second.k_cache])
    v_cache = torch.cat([case.v_cache, second.v_cache])
    offset = case.k_cache.shape[0]
    level2 = layout.prefix_batch(
        [list(second.prefix.host_rows)],
        [(second.prefix.block_tables[0, :6] + offset).tolist()],
        [90],
        num_rows=case.q.shape[0],
        block_size=16,
        num_blocks=k_cache.shape[0],
    )
    level1 = layout.prefix_batch(
        [list(case.prefix.host_rows[a:b]) for a, b in
         zip(case.prefix.host_row_start, case.prefix.host_row_start[1:])],
        [row.tolist() for row in case.prefix.block_tables],
        list(case.prefix.host_lengths),
        num_rows=case.q.shape[0], block_size=16, num_blocks=k_cache.shape[0],
    )  # fmt: skip
    own = layout.own_batch(
        list(case.own.host_query_start),
        case.own.block_tables.tolist(),
        list(case.own.host_context_lens),
        block_size=16,
        num_blocks=k_cache.shape[0],
    )
    args = (case.q, k_cache, v_cache)
    out = tri.attend(*args, own, [level1, level2], case.scale)
    expected = torch_attention.merge_attention_states(
        [
            torch_attention.own_attention(*args, own, case.scale),
            torch_attention.prefix_attention(*args, level1, case.scale),
            torch_attention.prefix_attention(*args, level2, case.scale),
        ]
    )
    assert out.dtype == dtype and not bool(out.isnan().any())
    torch.testing.assert_close(out.float(), expected.out.float(), **OUT_TOLERANCE[dtype])
    if splits:
        (plan,) = [v for k, v in level1.derived.items() if k[0] == "triton"]
        assert plan.num_splits > 1
    alone = tri.attend(*args, own, [], case.scale)  # no segments: the own part only
    torch.testing.assert_close(
        alone.float(), torch_attention.own_attention(*args, own, case.scale).out.float(),
        **OUT_TOLERANCE[dtype],
    )  # fmt: skip


def test_non_power_of_two_group():
    """SmolLM2's 9 heads on 3 KV heads: group 3 packs 5 rows into a 16-row tile."""
    case = make_case(prefix_len=50, num_kv_heads=3, group=3, head_dim=64, seed=13)
    check_case(case)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_exactly_the_given_slots(slot_dtype, dtype):
    check_store_writes_exactly_the_given_slots(
        tri.store_kv, slot_dtype, dtype=dtype, num_kv_heads=3, head_dim=40
    )


def test_store_kv_into_strided_views_skips_slots_outside_the_cache():
    storage = torch.zeros(5, 4, 3, 16)  # k and v interleaved in one buffer
    k_cache, v_cache = storage[..., ::2], storage[..., 1::2]  # [5, 4, 3, 8] each
    k = (torch.rand(4, 3, 16) + 1)[..., ::2]  # non-contiguous source too
    tri.store_kv(k_cache, v_cache, k, k + 1, torch.tensor([0, 9, -1, 19]))
    torch.testing.assert_close(k_cache[0, 0], k[0], atol=0, rtol=0)
    torch.testing.assert_close(k_cache[2, 1], k[1], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[4, 3], k[3] + 1, atol=0, rtol=0)
    assert int((storage != 0).sum()) == 3 * 3 * 16  # three slots of both caches, nothing else


# ---------------------------------------------------------------- merge


def random_parts(num_parts: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for index in range(num_parts):
        out = torch.randn(7, 4, 64, generator=generator).to(dtype)
        lse = torch.randn(7, 4, generator=generator) * 3
        lse[index % 7, :2] = -math.inf  # this part saw no key there: its out is ignored
        out[index % 7, :2] = math.nan
        parts.append((out, lse))
    for out, lse in parts:  # row 6, head 3: no part saw a key
        lse[6, 3] = -math.inf
        out[6, 3] = math.nan
    return parts


@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merge_matches_reference(num_parts, dtype):
    parts = random_parts(num_parts, dtype, seed=num_parts)
    merged = tri.merge_attention_states(parts)
    expected = torch_attention.merge_attention_states(parts)
    assert_close(merged, expected, dtype)
    assert not bool(merged.out.isnan().any()) and not bool(merged.lse.isnan().any())
    assert bool((merged.out[6, 3] == 0).all()) and bool(torch.isneginf(merged.lse[6, 3]))


def test_merge_of_strided_parts_and_half_precision_lse():
    parts = random_parts(2, torch.float32, seed=3)
    strided = [
        (torch.cat([out, out], dim=-1)[..., ::2], lse.T.contiguous().T) for out, lse in parts
    ]
    strided[1] = (strided[1][0], strided[1][1].half())
    expected = torch_attention.merge_attention_states(strided)
    merged = tri.merge_attention_states(strided)
    assert_close(merged, expected, torch.float32)


def test_merge_rejects_bad_parts():
    with pytest.raises(ValueError, match="at least one"):
        tri.merge_attention_states([])
    with pytest.raises(TypeError, match="pair"):
        tri.merge_attention_states([(torch.zeros(3, 2, 4),)])
    with pytest.raises(ValueError, match="lse shape"):
        tri.merge_attention_states([(torch.zeros(3, 2, 4), torch.zeros(3, 3))])
    with pytest.raises(ValueError, match=r"parts\[1\] out"):
        tri.merge_attention_states(
            [
                (torch.zeros(3, 2, 4), torch.zeros(3, 2)),
                (torch.zeros(3, 2, 4).half(), torch.zeros(3, 2)),
            ]
        )


# ---------------------------------------------------------------- argument errors


def test_launchers_reject_bad_arguments():
    case = make_case(prefix_len=5, requests=[(3, 2)], group=2, head_dim=16, seed=6)
    args = (case.k_cache, case.v_cache)
    with pytest.raises(TypeError, match="PrefixBatch"):
        tri.prefix_attention(case.q, *args, case.own, case.scale)
    with pytest.raises(ValueError, match="head_dim"):
        tri.own_attention(case.q[..., :8], *args, case.own, case.scale)
    with pytest.raises(TypeError, match="dtype"):
        tri.own_attention(case.q.half(), *args, case.own, case.scale)
    with pytest.raises(ValueError, match="rows"):
        tri.prefix_attention(case.q[:1], *args, case.prefix, case.scale)
    with pytest.raises(ValueError, match="finite"):
        tri.own_attention(case.q, *args, case.own, math.nan)
    with pytest.raises(ValueError, match="k must be"):
        tri.store_kv(*args, torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        k = torch.zeros(2, 2, 16)
        tri.store_kv(*args, k, k, torch.tensor([0.0, 1.0]))


# ---------------------------------------------------------------- GPU build

# Compiles the kernels for sm_90 (H100/H200) with Triton's bundled LLVM and ptxas, without
# a GPU: catches what the interpreter lets through (types, layouts, constexpr handling).
# Integer arguments get the specializations a real launch gives them (unit strides as
# constants, the rest divisible by 16).
COMPILE_SCRIPT = r"""
import sys
try:
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as error:
    print(error)
    sys.exit(77)
from llm_operator.kernels import triton_attention as tri

assert not tri._INTERPRETED, "the kernels run in the interpreter"
TARGET = GPUTarget("cuda", 90, 32)
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_kcd", "stride_vcd",
        "stride_aod", "stride_bod", "stride_pod"}


def build(kernel, types, constexprs, **options):
    names = kernel.arg_names
    constexprs = dict(constexprs, **{n: 1 for n in names if n in UNIT})
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or (n.startswith("stride") and n not in UNIT)}
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs=attrs)
    return triton.compile(source, target=TARGET, options=options)


TL = {torch.bfloat16: ("bf16", tl.bfloat16), torch.float16: ("fp16", tl.float16),
      torch.float32: ("fp32", tl.float32)}
for dtype, head_dim, group, rows, causal, out, merge, windowed in [
    (torch.bfloat16, 128, 4, 512, False, None, False, False),
    (torch.bfloat16, 128, 4, 512, False, "fp32", False, False),
    (torch.bfloat16, 64, 4, 1024, False, "fp32", True, False),  # merged into an fp32 state
    (torch.float16, 64, 8, 1, True, None, False, False),
    (torch.float16, 64, 8, 1, True, "fp32", False, False),
    (torch.float32, 128, 3, 64, False, None, True, False),
    # sliding windows (Gemma 3 / Mistral): own rows causal in their window, prefix rows from
    # their first visible key, merged into an fp32 state
    (torch.bfloat16, 256, 4, 512, True, "fp32", False, True),
    (torch.bfloat16, 256, 4, 512, False, "fp32", True, True),
]:
    name, mma = TL[dtype]
    q = torch.empty(1, group, head_dim, dtype=dtype)
    block_m, block_n, block_d, warps, stages = tri._tile_config(q, rows, group)
    pointers = {n: "*" + name for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    pointers.update(lse_ptr="*fp32", work_ptr="*i32", rows_ptr="*i64", table_ptr="*i32",
                    lows_ptr="*i32", scale="fp32")
    if out:
        pointers["out_ptr"] = "*" + out  # key splits: fp32 partial outs
    precision = "ieee" if dtype == torch.float32 else "tf32"
    build(tri._paged_attention_kernel, pointers,
          dict(GROUP=group, INDIRECT=not causal, CAUSAL=causal, MERGE=merge, WINDOWED=windowed,
               MMA_DTYPE=mma, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d),
          num_warps=warps, num_stages=stages)
build(tri._store_kv_kernel, {n: "*bf16" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
      | {"slot_ptr": "*i32"}, dict(BLOCK_H=8, BLOCK_D=128), num_warps=4)
for has_b in (True, False):
    build(tri._merge_kernel, {"a_out_ptr": "*fp16", "b_out_ptr": "*fp16", "a_lse_ptr": "*fp32",
          "b_lse_ptr": "*fp16", "out_ptr": "*fp16", "lse_ptr": "*fp32"},
          dict(HAS_B=has_b, BLOCK_P=32, BLOCK_D=128), num_warps=4)
for merge, out, rows_type in ((False, "*bf16", "*i64"), (True, "*fp32", "*i32")):
    build(tri._combine_splits_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
          "rows_ptr": rows_type, "out_ptr": out, "lse_ptr": "*fp32"},
          dict(MERGE=merge, BLOCK_P=32, BLOCK_D=128), num_warps=4)
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    compile_for_sm90(COMPILE_SCRIPT, TRITON_DEFAULT_FP_FUSION="1")
