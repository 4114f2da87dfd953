"""Triton kernels for the native engine's attention over a paged KV cache.

Same signatures and semantics as ``torch_attention.py`` (read its docstrings and
``layout.py``'s for the contracts):

- ``store_kv``: one program per new token writes its K and V rows into the paged cache;
- ``prefix_attention``: one program per (row tile of a segment, KV head). The query heads
  of that KV head are packed into the tile's M dimension (GQA), the tile's q rows come
  through ``batch.rows``, and the program streams the segment's K/V once, key tile by key
  tile through ``batch.block_tables[s]``, with an online softmax in fp32 (non-causal);
- ``own_attention``: the same loop per (row tile of a request, KV head), causal, the rows
  at own positions ``context_lens[b] - n_b + j``;
- ``merge_attention_states``: a log-sum-exp merge of (out, lse) parts, folded pairwise
  with an fp32 running state (one rounding to the parts' dtype at the end);
- ``attend_invariant`` (``AttentionStep(invariant=True)``, ``deterministic=True``): the
  batch-invariant mode, as the compiled CPU kernel's: one fp32 softmax state per (row
  tile, KV head) carried through the row's levels in fixed steps of 64 keys, on items
  aligned on the host (``invariant_batches``); no key split, no log-sum-exp merge.

Work lists. A batch's work items (segment or request, row tile, key range) are listed once
per engine step from its host fields (``host_row_start``, ``host_query_start``, ...) into
a small int32 tensor cached in ``batch.derived`` (keyed ``("triton", num_heads,
num_kv_heads, head_dim, config)``); every layer reuses it, so no launch reads a device
value back and no program is launched for an empty tile. Segments (requests) are listed
longest first, tiles of one segment next to each other (they read the same K/V from L2).
When a batch's prefix tiles are too few to fill the GPU (decode rows on a long shared
prefix), each segment's keys are split into chunks (flash-decoding): every (tile, chunk)
writes an fp32 partial state and a second kernel combines them by log-sum-exp.

Precision. Every load is cast to fp32 right away. The two matrix products take fp32
operands under the interpreter (CPU tensors, ``TRITON_INTERPRET=1``) and for fp32 inputs
(exact "ieee" products); on a GPU with fp16/bf16 inputs the operands go back to the input
dtype for the tensor cores (q and K/V exactly, the softmax weights rounded), with fp32
accumulation. Scores, softmax and sums are fp32; ``lse`` is the natural log.

Block sizes depend on head_dim and dtype, plus the tile's M from the batch's row counts
(16, 32, 64 or 128 packed rows); no autotuning. Index values (slots, block ids, lengths)
are validated on the host by ``own_batch`` / ``prefix_batch``; the launchers here check
shapes, strides and dtypes only (``store_kv`` skips slots outside the cache instead of
checking them, which would need a device-to-host sync).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_operator.kernels.layout import (
    INDEX_DTYPES,
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    check_launch,
    check_merge_parts,
    check_scale,
    check_store,
)
from llm_operator.kernels.triton_fused_kernels import _device_function

__all__ = [
    "attend_invariant",
    "invariant_batches",
    "merge_attention_states",
    "own_attention",
    "prefix_attention",
    "store_kv",
]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


# ---------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_ptr,  # [T] int32 / int64
    num_slots,  # num_blocks * block_size
    block_size,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    in_cache = (slot >= 0) & (slot < num_slots)  # other slots (e.g. -1 padding) are skipped
    slot = tl.where(in_cache, slot, 0)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads_here = tl.where(in_cache, num_kv_heads, 0)  # 0: write nothing
    mask = (heads[:, None] < heads_here) & (dims[None, :] < head_dim)  # [H, D]
    k_src = k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
    v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
    k_dst = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kcs
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :] * stride_vcd
    )
    # A copy: the values go through fp32 (exact for every input dtype) and back.
    k = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@_device_function
def _merge_states(a_out, a_lse, b_out, b_lse):
    """Log-sum-exp merge of two (out [P, D], lse [P]) states over disjoint keys, in fp32: a
    part with lse -inf weighs 0, even if its out is NaN."""
    top = tl.maximum(a_lse, b_lse)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.exp(a_lse - shift) + tl.exp(b_lse - shift)
    lse = tl.where(total > 0.0, shift + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    lse = tl.where(top == float("inf"), float("inf"), lse)
    # lse - merged lse, as the reference weighs each part: 0 for a part with lse -inf.
    merged_shift = tl.where(lse == float("-inf"), 0.0, lse)
    a_weight = tl.exp(a_lse - merged_shift)
    b_weight = tl.exp(b_lse - merged_shift)
    out = tl.where(a_weight[:, None] > 0.0, a_weight[:, None] * a_out, 0.0)
    out += tl.where(b_weight[:, None] > 0.0, b_weight[:, None] * b_out, 0.0)
    return out, lse


@_device_function
def _write_state(
    out_ptr, lse_ptr, out_offsets, lse_offsets, out, lse, mask, row_mask, MERGE: tl.constexpr
):
    """Store (out, lse) at the offsets, merged (MERGE) with the state already there."""
    if MERGE:
        old_lse = tl.load(lse_ptr + lse_offsets, mask=row_mask, other=float("-inf"))
        old_out = tl.load(out_ptr + out_offsets, mask=mask, other=0.0).to(tl.float32)
        out, lse = _merge_states(old_out, old_lse, out, lse)
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)


@_device_function
def _q_rows(
    rows_ptr, kv_head, first, count, head_dim, GROUP: tl.constexpr, INDIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A work item's packed tile rows m = (tile row r, head g of the KV head's group):
    (r, q_row, head, row_valid, dims, dim_valid)."""
    m = tl.arange(0, BLOCK_M)
    r = m // GROUP
    g = m % GROUP
    row_valid = r < count  # [M]
    if INDIRECT:
        q_row = tl.load(rows_ptr + first + r, mask=row_valid, other=0).to(tl.int64)
    else:
        q_row = first + r
    head = (kv_head * GROUP + g).to(tl.int64)  # [M]
    dims = tl.arange(0, BLOCK_D)
    return r, q_row, head, row_valid, dims, dims < head_dim


@_device_function
def _attend_keys(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, lows_ptr, kv_head, table, first,
    count, key_begin, key_end, r, row_valid, dims, dim_valid, window, scale, block_size,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_table, INDIRECT: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
    INVARIANT: tl.constexpr, MMA_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    STEP_KEYS: tl.constexpr, ROW_PRODUCTS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The online softmax state (m_i: running max in log2 units, l_i: running sum of
    exp2(score - m_i), acc [M, D]) of a work item's q tile carried over its keys
    [key_begin, key_end) of one KV head, STEP_KEYS keys (of BLOCK_N columns) a loop step.

    Causal: row r sits at position key_end - count + r and sees keys up to it. WINDOWED: a
    row sees no key before its low (own: position - window + 1; prefix: lows_ptr's entry),
    and the steps before every row's window are skipped, not masked (INVARIANT: the loop
    still starts on a multiple of STEP_KEYS). ROW_PRODUCTS: the two products as broadcast
    sums, not tl.dot."""
    position = key_end - count + r  # [M] causal position of each packed row
    kv_head64 = kv_head.to(tl.int64)
    k_base = k_cache_ptr + kv_head64 * stride_kh
    v_base = v_cache_ptr + kv_head64 * stride_vh
    table_base = table_ptr + table * stride_table
    loop_begin = key_begin
    if WINDOWED:
        if INDIRECT:
            low = tl.load(lows_ptr + first + r, mask=row_valid, other=0)
        else:
            low = position - window + 1
        low = tl.where(row_valid, low, key_end)  # [M]
        loop_begin = tl.maximum(key_begin, tl.min(low, axis=0))
        if INVARIANT:
            loop_begin = loop_begin - loop_begin % STEP_KEYS
    columns = tl.arange(0, BLOCK_N)
    for start in range(loop_begin, key_end, STEP_KEYS):
        keys = start + columns  # [N] positions in the segment / request
        if INVARIANT:
            key_valid = (columns < STEP_KEYS) & (keys < key_end)
        else:
            key_valid = keys < key_end
        block = tl.load(table_base + keys // block_size, mask=key_valid, other=0).to(tl.int64)
        offset = (keys % block_size).to(tl.int64)
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(
            k_base
            + block[:, None] * stride_kb
            + offset[:, None] * stride_ks
            + dims[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [N, D]
        v = tl.load(
            v_base
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + dims[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [N, D]
        if ROW_PRODUCTS:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [M, N]
        else:
            scores = tl.dot(q, tl.trans(k.to(MMA_DTYPE)), input_precision=PRECISION) * scale
        if CAUSAL:
            visible = key_valid[None, :] & (keys[None, :] <= position[:, None])
        else:
            visible = key_valid[None, :] & row_valid[:, None]
        if WINDOWED:
            visible &= keys[None, :] >= low[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps m = -inf: shift it by 0 (its weights are 0).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(scores - shift[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if ROW_PRODUCTS:
            acc += tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        else:
            acc += tl.dot(p.to(MMA_DTYPE), v.to(MMA_DTYPE), input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, head_dim] q's dtype, or [splits, T, num_heads, head_dim] fp32
    lse_ptr,  # [T, num_heads] or [splits, T, num_heads], fp32
    work_ptr,  # [W, 6] int32: (table row, first, row count, key_begin, key_end, split)
    rows_ptr,  # [N] q row indices (INDIRECT) or unused
    table_ptr,  # [S or B, max_blocks] block ids
    lows_ptr,  # [N] int32 aligned with rows_ptr: each row's first visible key (WINDOWED prefix)
    window,  # sliding window of an own batch (WINDOWED, not INDIRECT)
    scale,  # softmax scale * log2(e)
    block_size,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_os,  # 0 unless out/lse hold one partial state per key split
    stride_ot,
    stride_oh,
    stride_od,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    INDIRECT: tl.constexpr,  # rows come through rows_ptr (prefix) or are contiguous (own)
    CAUSAL: tl.constexpr,
    MERGE: tl.constexpr,  # merge into the rows' (out, lse) state instead of overwriting it
    WINDOWED: tl.constexpr,  # sliding window: keys before a row's first visible key are out
    MMA_DTYPE: tl.constexpr,  # operand dtype of the two matrix products
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands
    BLOCK_M: tl.constexpr,  # packed (row, head of the group) pairs per tile
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    """One (work item, KV head): out/lse of a row tile over keys [key_begin, key_end).

    Work item: table row (segment or request), ``first`` (index into rows_ptr when
    INDIRECT, else the first q row), ``count`` rows, the key range, and the ``split`` the
    result goes to (its offset is split * stride_os). Causal (key_begin 0): row r of the
    tile sits at position key_end - count + r and sees keys up to it; else every row sees
    the whole range; WINDOWED rows see a sliding window of it (``_attend_keys``).
    """
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    table = tl.load(work_ptr + item * 6).to(tl.int64)
    first = tl.load(work_ptr + item * 6 + 1).to(tl.int64)
    count = tl.load(work_ptr + item * 6 + 2)
    key_begin = tl.load(work_ptr + item * 6 + 3)
    key_end = tl.load(work_ptr + item * 6 + 4)
    split = tl.load(work_ptr + item * 6 + 5).to(tl.int64)
    r, q_row, head, row_valid, dims, dim_valid = _q_rows(
        rows_ptr, kv_head, first, count, head_dim, GROUP, INDIRECT, BLOCK_M, BLOCK_D
    )
    q_offsets = q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32).to(MMA_DTYPE)  # [M, D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, lows_ptr, kv_head, table, first,
        count, key_begin, key_end, r, row_valid, dims, dim_valid, window, scale, block_size,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        stride_table, INDIRECT, CAUSAL, WINDOWED, False, MMA_DTYPE, PRECISION, BLOCK_N, False,
        BLOCK_N,
    )  # fmt: skip

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(
        seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    o_offsets = q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    o_offsets += split * stride_os
    l_offsets = split * stride_ls + q_row * stride_lt + head * stride_lh
    _write_state(out_ptr, lse_ptr, o_offsets, l_offsets, out, lse, q_mask, row_valid, MERGE)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,  # [splits, T, H, D] fp32, partial outs over disjoint key ranges
    part_lse_ptr,  # [splits, T, H] fp32, -inf where a split saw no key
    rows_ptr,  # [N] the q rows to combine
    out_ptr,  # [T, H, D] q's dtype
    lse_ptr,  # [T, H] fp32
    num_pairs,  # N * H
    num_splits,
    num_heads,
    head_dim,
    stride_pos,
    stride_pot,
    stride_poh,
    stride_pod,
    stride_pls,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    MERGE: tl.constexpr,  # merge into the rows' (out, lse) state instead of overwriting it
    BLOCK_P: tl.constexpr,  # (row, head) pairs per program
    BLOCK_D: tl.constexpr,
):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_valid = pairs < num_pairs
    row = tl.load(rows_ptr + pairs // num_heads, mask=pair_valid, other=-1).to(tl.int64)
    pair_valid = pair_valid & (row >= 0)  # a padded row (-1, a CUDA graph's spare) is skipped
    row = tl.where(pair_valid, row, 0)
    head = pairs % num_heads
    dims = tl.arange(0, BLOCK_D)
    mask = pair_valid[:, None] & (dims[None, :] < head_dim)
    lse_base = part_lse_ptr + row * stride_plt + head * stride_plh  # [P]
    top = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for split in range(0, num_splits):
        part = tl.load(lse_base + split * stride_pls, mask=pair_valid, other=float("-inf"))
        top = tl.maximum(top, part)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    out_base = part_out_ptr + row[:, None] * stride_pot + head[:, None] * stride_poh
    out_base += dims[None, :] * stride_pod
    for split in range(0, num_splits):
        part = tl.load(lse_base + split * stride_pls, mask=pair_valid, other=float("-inf"))
        weight = tl.exp(part - shift)  # 0 for a split that saw no key (its out is unset)
        used = weight > 0.0
        part_out = tl.load(out_base + split * stride_pos, mask=mask & used[:, None], other=0.0)
        acc += tl.where(used[:, None], weight[:, None] * part_out, 0.0)
        total += weight
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    out_offsets = row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    lse_offsets = row * stride_lt + head * stride_lh
    _write_state(out_ptr, lse_ptr, out_offsets, lse_offsets, out, lse, mask, pair_valid, MERGE)


@triton.jit
def _merge_kernel(
    a_out_ptr,  # [T, H, D]
    a_lse_ptr,  # [T, H]
    b_out_ptr,  # [T, H, D] (unused unless HAS_B)
    b_lse_ptr,
    out_ptr,  # [T, H, D]
    lse_ptr,  # [T, H] fp32
    num_pairs,  # T * H
    num_heads,
    head_dim,
    stride_aot,
    stride_aoh,
    stride_aod,
    stride_alt,
    stride_alh,
    stride_bot,
    stride_boh,
    stride_bod,
    stride_blt,
    stride_blh,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    HAS_B: tl.constexpr,
    BLOCK_P: tl.constexpr,  # (token, head) pairs per program
    BLOCK_D: tl.constexpr,
):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_valid = pairs < num_pairs
    token = pairs // num_heads
    head = pairs % num_heads
    dims = tl.arange(0, BLOCK_D)
    mask = pair_valid[:, None] & (dims[None, :] < head_dim)
    a_lse = tl.load(a_lse_ptr + token * stride_alt + head * stride_alh, mask=pair_valid, other=0.0)
    a_lse = a_lse.to(tl.float32)
    a_out = tl.load(
        a_out_ptr
        + token[:, None] * stride_aot
        + head[:, None] * stride_aoh
        + dims[None, :] * stride_aod,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    if HAS_B:
        b_lse = tl.load(
            b_lse_ptr + token * stride_blt + head * stride_blh, mask=pair_valid, other=0.0
        )
        b_lse = b_lse.to(tl.float32)
        b_out = tl.load(
            b_out_ptr
            + token[:, None] * stride_bot
            + head[:, None] * stride_boh
            + dims[None, :] * stride_bod,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        out, lse = _merge_states(a_out, a_lse, b_out, b_lse)
    else:
        lse = a_lse
        a_weight = tl.exp(a_lse - tl.where(lse == float("-inf"), 0.0, lse))
        out = tl.where(a_weight[:, None] > 0.0, a_weight[:, None] * a_out, 0.0)
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + token * stride_lt + head * stride_lh, lse, mask=pair_valid)


@triton.jit
def _invariant_attention_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, head_dim] q's dtype, written when FINAL
    m_ptr,  # [T, num_heads] fp32 running max (log2 units), contiguous
    l_ptr,  # [T, num_heads] fp32 running denominator, contiguous
    acc_ptr,  # [T, num_heads, head_dim] fp32 running numerator, contiguous
    work_ptr,  # [W, 6] int32: (table row, first, row count, -, key_end, -)
    rows_ptr,  # [N] q row indices (INDIRECT) or unused
    table_ptr,  # [S or B, max_blocks] block ids
    lows_ptr,  # [N] int32 aligned with rows_ptr: each row's first visible key (WINDOWED prefix)
    window,  # sliding window of an own batch (WINDOWED, not INDIRECT)
    scale,  # softmax scale * log2(e)
    block_size,
    num_heads,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    INDIRECT: tl.constexpr,  # rows come through rows_ptr (prefix) or are contiguous (own)
    CAUSAL: tl.constexpr,
    LOAD_STATE: tl.constexpr,  # start from the rows' carried state (else m -inf, l 0, acc 0)
    FINAL: tl.constexpr,  # normalize and write out (else store the state for the next level)
    WINDOWED: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    STEP_KEYS: tl.constexpr,  # keys per softmax step (<= BLOCK_N)
    ROW_PRODUCTS: tl.constexpr,  # the interpreter: products as broadcast sums, not tl.dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (work item, KV head) of the batch-invariant attention: the tile's rows carry
    their softmax state (m, l, acc) through the item's keys [0, key_end) in steps of
    STEP_KEYS keys from key 0. Items start on a multiple of the step in every row's key
    positions (``layout.align_step_keys``), so a step holds the same keys at the same
    columns whatever the layout; a key a row does not see scores -inf (weight exactly 0,
    and a step it sees nothing of leaves its state as it was), and every row is computed
    on its own in fixed tile shapes: a row's bits depend on its keys alone. No key split,
    no log-sum-exp merge: levels run one launch after another on the same state.

    ROW_PRODUCTS (the interpreter, CPU tensors): the two products are broadcast sums.
    The interpreter's tl.dot is numpy's BLAS GEMM, which rounds the same row differently
    at different rows of a tile; a GPU's tl.dot (tensor-core MMA, or in-order FMAs for
    fp32) computes every row of a tile alike, so it keeps tl.dot."""
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    table = tl.load(work_ptr + item * 6).to(tl.int64)
    first = tl.load(work_ptr + item * 6 + 1).to(tl.int64)
    count = tl.load(work_ptr + item * 6 + 2)
    key_end = tl.load(work_ptr + item * 6 + 4)
    r, q_row, head, row_valid, dims, dim_valid = _q_rows(
        rows_ptr, kv_head, first, count, head_dim, GROUP, INDIRECT, BLOCK_M, BLOCK_D
    )
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offsets = q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32).to(MMA_DTYPE)  # [M, D]
    state = q_row * num_heads + head  # [M]
    acc_offsets = state[:, None] * head_dim + dims[None, :]
    if LOAD_STATE:
        m_i = tl.load(m_ptr + state, mask=row_valid, other=float("-inf"))
        l_i = tl.load(l_ptr + state, mask=row_valid, other=0.0)
        acc = tl.load(acc_ptr + acc_offsets, mask=q_mask, other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, lows_ptr, kv_head, table, first,
        count, key_end * 0, key_end, r, row_valid, dims, dim_valid, window, scale, block_size,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        stride_table, INDIRECT, CAUSAL, WINDOWED, True, MMA_DTYPE, PRECISION, STEP_KEYS,
        ROW_PRODUCTS, BLOCK_N,
    )  # fmt: skip

    if FINAL:
        seen = l_i > 0.0
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        o_offsets = (
            q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        )
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(m_ptr + state, m_i, mask=row_valid)
        tl.store(l_ptr + state, l_i, mask=row_valid)
        tl.store(acc_ptr + acc_offsets, acc, mask=q_mask)


# ---------------------------------------------------------------- launch configuration

_INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _check_device(tensor: Tensor) -> None:
    if tensor.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "the Triton kernels got CPU tensors but run compiled; set TRITON_INTERPRET=1 "
            "before triton is first imported to run them in the interpreter"
        )


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support head_dim 1..{_MAX_HEAD_DIM}, got {head_dim}")


def _check_batch_index(name: str, value: Tensor, ndim: int) -> None:
    if not isinstance(value, Tensor) or value.dim() != ndim or value.dtype not in INDEX_DTYPES:
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else type(value)
        raise ValueError(f"batch.{name} must be a {ndim}-D int32/int64 tensor, got {got}")
    if ndim == 2 and value.shape[1] > 0 and value.stride(1) != 1:
        raise ValueError(f"batch.{name} must have unit stride along its last dimension")
    if ndim == 1 and value.numel() > 1 and value.stride(0) != 1:
        raise ValueError(f"batch.{name} must be contiguous")


def tile_config(
    dtype: torch.dtype, head_dim: int, max_rows: int, group: int
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for one launch on q of this dtype
    and head_dim.

    BLOCK_M: packed rows (rows x heads of a group), the smallest power of two >= 16 that
    holds the batch's largest piece, up to a cap, and at least one group. The caps keep
    sm_90 builds free of register spills: fp16/bf16 128 packed rows (64 past head_dim
    128); fp32 (exact products on the FMA units, no tensor cores) 64 rows by 32 keys up
    to head_dim 64, 32 by 16 up to 128, 16 by 16 beyond.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        cap, block_n = (64, 32) if block_d <= 64 else (32, 16) if block_d <= 128 else (16, 16)
    else:
        cap, block_n = (128, 64) if block_d <= 128 else (64, 32)
    block_m = max(16, min(cap, triton.next_power_of_2(max(1, max_rows * group))))
    block_m = max(block_m, triton.next_power_of_2(group))
    num_warps = 8 if dtype == torch.float32 or block_m * block_d >= 128 * 128 else 4
    return block_m, block_n, block_d, num_warps, 2


def _tile_config(q: Tensor, max_rows: int, group: int) -> tuple[int, int, int, int, int]:
    return tile_config(q.dtype, q.shape[2], max_rows, group)


def preset_plan(
    batch: OwnBatch | PrefixBatch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: tuple,
    work: Tensor,
    num_splits: int,
) -> None:
    """Give ``batch`` the launch plan the kernels would derive for it, built by the caller
    (a CUDA graph's static work buffer, refilled before each replay): ``work`` [W, 6]
    int32 items as ``own_work`` / ``prefix_work`` list them, padding items with count 0
    doing nothing; ``config`` from ``tile_config`` for the batch's ``max_query_rows`` /
    ``max_segment_rows``."""
    key = ("triton", num_heads, num_kv_heads, head_dim, config)
    batch.derived[key] = _Plan(config, work, num_splits)


def _mma(q: Tensor) -> tuple[object, str]:
    """Operand dtype and input precision of the kernels' two matrix products."""
    if q.device.type == "cpu" or q.dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if q.dtype == torch.float16 else tl.bfloat16), "tf32"  # ignored: 16-bit


class _Plan(NamedTuple):
    """Launch metadata of one batch and configuration, derived once from host fields."""

    config: tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_D, num_warps, stages
    work: Tensor  # [W, 6] int32 work items on the batch's device
    num_splits: int  # > 1: partial states per key split, then a combine kernel


def _target_programs(device: torch.device) -> int:
    """Programs one launch should have to fill the device: 2 per SM on a GPU. Under the
    interpreter (CPU) 0, so nothing is split (tests raise it to exercise key splits)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 2 * _SM_COUNTS[index]


_SM_COUNTS: dict[int, int] = {}
# Key splits of a long segment read by few row tiles (flash-decoding): at least this many
# keys per split, at most this many splits.
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 16


def _work_tensor(items: np.ndarray, device: torch.device) -> Tensor:
    host = torch.from_numpy(np.ascontiguousarray(items, dtype=np.int32)).reshape(-1, 6)
    if device.type == "cuda":  # once per step, and without a host-device sync
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _tiles(first: np.ndarray, end: np.ndarray, rows_per_tile: int) -> tuple[np.ndarray, ...]:
    """Row tiles of pieces [first, end): (piece index, tile's first row, tile's rows), the
    tiles of one piece together, in piece order."""
    tiles = -(-(end - first) // rows_per_tile)  # [pieces], 0 for an empty piece
    piece = np.repeat(np.arange(first.shape[0]), tiles)
    within = np.arange(piece.shape[0]) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile_first = first[piece] + within * rows_per_tile
    return piece, tile_first, np.minimum(rows_per_tile, end[piece] - tile_first)


def prefix_work(
    row_start: Sequence[int],
    lengths: Sequence[int],
    rows_per_tile: int,
    block_n: int,
    target_programs: int,
    num_kv_heads: int,
) -> tuple[np.ndarray, int]:
    """Work items [W, 6] (segment, first index into batch.rows, count, key_begin, key_end,
    split) of a prefix batch and its key splits: segments longest first, then key splits,
    then row tiles (the tiles of one split read the same K/V one after another, from L2).
    A segment of length 0 or without rows has none (its rows get out 0, lse -inf)."""
    starts = np.asarray(row_start, dtype=np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)
    live = np.flatnonzero((sizes > 0) & (starts[1:] > starts[:-1]))
    segments = live[np.argsort(-sizes[live], kind="stable")]
    if segments.size == 0:
        return np.zeros((0, 6), dtype=np.int32), 1
    tiles = -(-(starts[segments + 1] - starts[segments]) // rows_per_tile)
    num_splits = 1
    programs = int(tiles.sum()) * num_kv_heads
    if 0 < programs < target_programs:
        longest = int(sizes[segments].max())
        num_splits = max(
            1, min(-(-target_programs // programs), longest // SPLIT_MIN_KEYS, MAX_SPLITS)
        )
    # Splits hold whole key tiles and at least SPLIT_MIN_KEYS keys.
    length = sizes[segments]
    chunk = np.maximum(-(-length // num_splits), np.minimum(SPLIT_MIN_KEYS, length))
    chunk = -(-chunk // block_n) * block_n
    splits = -(-length // chunk)  # [segments]
    # one (segment, split) pair after another, then its row tiles
    pair_segment = np.repeat(np.arange(segments.shape[0]), splits)
    pair_split = np.arange(pair_segment.shape[0]) - np.repeat(np.cumsum(splits) - splits, splits)
    segment_ids = segments[pair_segment]
    pair, first, count = _tiles(starts[segment_ids], starts[segment_ids + 1], rows_per_tile)
    key_begin = pair_split[pair] * chunk[pair_segment[pair]]
    key_end = np.minimum(length[pair_segment[pair]], key_begin + chunk[pair_segment[pair]])
    items = np.stack([segment_ids[pair], first, count, key_begin, key_end, pair_split[pair]], 1)
    return items.astype(np.int32), int(splits.max())


def own_work(
    query_start: Sequence[int], context_lens: Sequence[int], rows_per_tile: int
) -> np.ndarray:
    """Work items [W, 6] (request, first q row, count, 0, key_end = last row's position + 1,
    0) of an own batch, the tiles with most keys first."""
    starts = np.asarray(query_start, dtype=np.int64)
    lengths = np.asarray(context_lens, dtype=np.int64)
    request, first, count = _tiles(starts[:-1], starts[1:], rows_per_tile)
    key_end = lengths[request] - (starts[request + 1] - first) + count
    zeros = np.zeros_like(request)
    items = np.stack([request, first, count, zeros, key_end, zeros], 1)
    return items[np.argsort(-key_end, kind="stable")].astype(np.int32)


def _prefix_plan(
    batch: PrefixBatch, config: tuple, group: int, num_kv_heads: int, target: int | None = None
) -> _Plan:
    """``prefix_work`` on the batch's host fields, on its device, for ``target`` programs
    (0: no key splits; by default the device's)."""
    if target is None:
        target = _target_programs(batch.rows.device)
    items, num_splits = prefix_work(
        batch.host_row_start, batch.host_lengths, config[0] // group, config[1], target,
        num_kv_heads,
    )  # fmt: skip
    return _Plan(config, _work_tensor(items, batch.rows.device), num_splits)


def _own_plan(batch: OwnBatch, config: tuple, group: int, num_kv_heads: int, target=None) -> _Plan:
    """``own_work`` on the batch's host fields, on its device (no key splits: no target)."""
    items = own_work(batch.host_query_start, batch.host_context_lens, config[0] // group)
    return _Plan(config, _work_tensor(items, batch.query_start.device), 1)


def _plan(batch, q: Tensor, k_cache: Tensor, group: int, max_rows: int, plan_of) -> _Plan:
    """The batch's plan for this configuration, derived on first use (host fields only)."""
    config = _tile_config(q, max_rows, group)
    key = ("triton", q.shape[1], k_cache.shape[2], q.shape[2], config)
    if key not in batch.derived:
        batch.derived[key] = plan_of(batch, config, group, k_cache.shape[2])
    return batch.derived[key]


def _launch_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    group: int,
    plan: _Plan,
    rows: Tensor,
    table: Tensor,
    causal: bool,
    state: AttentionOutput | None = None,
    merge: bool = False,
    window: int = 0,
    lows: Tensor | None = None,
) -> AttentionOutput:
    """The kernels' launch. ``state``: write into these (out, lse) buffers (``attend``)
    rather than new zero-filled ones; ``merge``: merge into what they hold, in place, by
    log-sum-exp, rather than overwrite it. Sliding windows: ``window`` (own batches,
    ``OwnBatch.window``) or ``lows`` (prefix batches, ``PrefixBatch.key_start``)."""
    block_m, block_n, block_d, num_warps, num_stages = plan.config
    num_rows, num_heads, head_dim = q.shape
    if state is not None:
        out, lse = state
    else:
        out = torch.zeros_like(q)  # rows no work item covers keep out 0 and lse -inf
        lse = torch.full((num_rows, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    num_kv_heads = k_cache.shape[2]
    if plan.work.shape[0] == 0 or num_heads == 0 or head_dim == 0:
        return AttentionOutput(out, lse)
    if plan.num_splits > 1:
        # [splits, T, H, D] fp32 partial states; a split that never runs for a row stays -inf.
        part_out = torch.empty((plan.num_splits, *q.shape), dtype=torch.float32, device=q.device)
        part_lse = torch.full(
            (plan.num_splits, num_rows, num_heads), -math.inf, dtype=torch.float32, device=q.device
        )
        target_out, target_lse = part_out, part_lse
        split_strides = (part_out.stride(0), part_lse.stride(0))
    else:
        target_out, target_lse = out, lse
        split_strides = (0, 0)
    mma, precision = _mma(q)
    _paged_attention_kernel[(plan.work.shape[0], num_kv_heads)](
        q,
        k_cache,
        v_cache,
        target_out,
        target_lse,
        plan.work,
        rows,
        table,
        rows if lows is None else lows,
        window,
        scale * _LOG2E,
        k_cache.shape[1],
        head_dim,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        split_strides[0],
        *target_out.stride()[-3:],
        split_strides[1],
        *target_lse.stride()[-2:],
        table.stride(0),
        GROUP=group,
        INDIRECT=not causal,
        CAUSAL=causal,
        MERGE=merge and plan.num_splits == 1,
        WINDOWED=bool(window) or lows is not None,
        MMA_DTYPE=mma,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if plan.num_splits > 1:
        num_pairs = rows.shape[0] * num_heads
        block_p = max(1, min(64, 4096 // block_d))
        _combine_splits_kernel[(triton.cdiv(num_pairs, block_p),)](
            part_out,
            part_lse,
            rows,
            out,
            lse,
            num_pairs,
            plan.num_splits,
            num_heads,
            head_dim,
            *part_out.stride(),
            *part_lse.stride(),
            *out.stride(),
            *lse.stride(),
            MERGE=merge,
            BLOCK_P=block_p,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return AttentionOutput(out, lse)


# ---------------------------------------------------------------- public operations


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write this step's keys and values into the paged cache, in place.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides
    k, v:             [T, num_kv_heads, head_dim], the cache's dtype and device, any strides
    slot_mapping:     [T] int64 or int32; token t goes to block slot // block_size at
                      offset slot % block_size. Slots outside [0, num_blocks * block_size)
                      (e.g. -1 padding) are skipped, not checked (that would need a sync).
    """
    check_store(k_cache, v_cache, k, v, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape[0] == 0 or num_kv_heads == 0 or head_dim == 0:
        return
    _check_device(k)
    _check_head_dim(head_dim)
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_blocks * block_size,
        block_size,
        num_kv_heads,
        head_dim,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


def own_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: OwnBatch, scale: float
) -> AttentionOutput:
    """Each request's query rows against its own paged K/V, causal, variable length.

    q:       [T, num_heads, head_dim], T = batch.num_rows, any strides
    k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device, any
             strides, already holding this step's tokens
    batch:   OwnBatch from own_batch()
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32).
    """
    group = check_launch(q, k_cache, v_cache, batch, OwnBatch)
    scale = check_scale(scale)
    _check_device(q)
    _check_head_dim(q.shape[2])
    _check_batch_index("block_tables", batch.block_tables, 2)
    plan = _plan(batch, q, k_cache, group, batch.max_query_rows, _own_plan)
    table = batch.block_tables
    return _launch_attention(
        q, k_cache, v_cache, scale, group, plan, table, table, causal=True, window=batch.window
    )


def prefix_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: PrefixBatch, scale: float
) -> AttentionOutput:
    """The q rows of every request sharing a segment against ONE copy of its K/V,
    non-causal, for every segment of the batch.

    q:       [T, num_heads, head_dim], T = batch.num_rows, any strides
    k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device, any
             strides
    batch:   PrefixBatch from prefix_batch()
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32);
    rows in no segment get out 0 and lse -inf.
    """
    group = check_launch(q, k_cache, v_cache, batch, PrefixBatch)
    scale = check_scale(scale)
    _check_device(q)
    _check_head_dim(q.shape[2])
    _check_batch_index("block_tables", batch.block_tables, 2)
    _check_batch_index("rows", batch.rows, 1)
    plan = _plan(batch, q, k_cache, group, batch.max_segment_rows, _prefix_plan)
    return _launch_attention(
        q, k_cache, v_cache, scale, group, plan, batch.rows, batch.block_tables, causal=False,
        lows=batch.key_start,
    )  # fmt: skip


def attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    own: OwnBatch,
    prefixes: Sequence[PrefixBatch],
    scale: float,
) -> Tensor:
    """A step's whole attention in as few launches as the kernels allow: each row against
    its own K/V (causal), then each level of shared segments merged into that state in
    place (``MERGE``: no separate merge kernel, no zero-filled buffers). One launch per
    part (two with key splits), plus one cast to q's dtype when there are segments.

    Equals ``merge_attention_states([own_attention(...), prefix_attention(...), ...]).out``
    up to fp32 rounding (the state is kept in fp32 between parts and rounded once). Rows
    no own work item covers (a CUDA graph's padding rows, none otherwise) get garbage.
    Returns out [T, num_heads, head_dim] in q's dtype."""
    group = check_launch(q, k_cache, v_cache, own, OwnBatch)
    scale = check_scale(scale)
    _check_device(q)
    _check_head_dim(q.shape[2])
    _check_batch_index("block_tables", own.block_tables, 2)
    num_rows, num_heads, _ = q.shape
    state_dtype = torch.float32 if prefixes else q.dtype
    state = AttentionOutput(
        torch.empty(q.shape, dtype=state_dtype, device=q.device),
        torch.empty((num_rows, num_heads), dtype=torch.float32, device=q.device),
    )
    plan = _plan(own, q, k_cache, group, own.max_query_rows, _own_plan)
    if plan.work.shape[0] == 0:  # no rows at all
        return state.out.to(q.dtype)
    # every row of an own batch is covered: its kernel writes the whole state
    _launch_attention(q, k_cache, v_cache, scale, group, plan, own.block_tables,
                      own.block_tables, causal=True, state=state, merge=False,
                      window=own.window)  # fmt: skip
    for batch in prefixes:
        check_launch(q, k_cache, v_cache, batch, PrefixBatch)
        _check_batch_index("block_tables", batch.block_tables, 2)
        _check_batch_index("rows", batch.rows, 1)
        plan = _plan(batch, q, k_cache, group, batch.max_segment_rows, _prefix_plan)
        if plan.work.shape[0]:
            _launch_attention(q, k_cache, v_cache, scale, group, plan, batch.rows,
                              batch.block_tables, causal=False, state=state, merge=True,
                              lows=batch.key_start)  # fmt: skip
    return state.out if state.out.dtype == q.dtype else state.out.to(q.dtype)


# ---------------------------------------------------------------- batch-invariant attention

# Keys per softmax step of the batch-invariant attention where the blocks tile such steps
# (the compiled CPU kernel's ``cpu_ops.INVARIANT_STEP_KEYS``); else one block a step.
INVARIANT_STEP_KEYS = 64
_ALIGNED = ("triton", "invariant", "aligned")  # batch.derived: its keys are step-aligned


def invariant_step_keys(block_size: int) -> int:
    """Keys per softmax step of the batch-invariant attention for this block size: 64
    where blocks tile 64-key steps (or steps tile blocks), else one block."""
    tiles = INVARIANT_STEP_KEYS % block_size == 0 or block_size % INVARIANT_STEP_KEYS == 0
    return INVARIANT_STEP_KEYS if tiles else block_size


def invariant_config(
    dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages, STEP_KEYS) of every launch of
    the batch-invariant attention: a function of the model and cache only, never of the
    step's rows (a row's bits must not depend on its tile's shape: another BLOCK_M may
    take other MMA instructions and reduction trees). BLOCK_M: fp16/bf16 64 packed rows
    (32 past head_dim 128), fp32 32 (16 past head_dim 64), at least a group; BLOCK_N: the
    step. Not timed on a GPU: decode rows fill few of a tile's 64 packed rows."""
    step = invariant_step_keys(block_size)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_m, num_warps = (32 if block_d <= 64 else 16), 8
    else:
        block_m, num_warps = (64, 4) if block_d <= 128 else (32, 8)
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, max(16, triton.next_power_of_2(step)), block_d, num_warps, 2, step


def invariant_batches(
    own: OwnBatch, prefixes: Sequence[PrefixBatch]
) -> tuple[OwnBatch, list[PrefixBatch]]:
    """A step's batches prepared for ``attend_invariant``: every item's keys start at a
    multiple of the step (``layout.align_batches``: the tables are read back to the host
    once), sliding-window ``key_start`` moved to the aligned items' coordinates. Batches
    already prepared (``preset_invariant_plan``) come back as they are. ValueError for a
    segment that does not end on a block boundary, or rows left out of a segment of
    their chain (``windowed(drop=True)``)."""
    if own.derived.get(_ALIGNED):
        return own, list(prefixes)
    import dataclasses

    from llm_operator.kernels.layout import align_batches, device_tensor

    own, aligned, carried_in = align_batches(own, prefixes, invariant_step_keys(own.block_size))
    batches = []
    for batch, carried in zip(aligned, carried_in):
        if batch.host_key_start is not None:
            first = np.asarray(batch.host_key_start, dtype=np.int64)
            first = first + np.repeat(carried, np.diff(batch.host_row_start))
            first = np.clip(first, -(2**30), 2**30)
            batch = dataclasses.replace(
                batch,
                key_start=device_tensor(first.astype(np.int32), batch.rows.device),
                host_key_start=tuple(first.tolist()),
            )
        batch.derived[_ALIGNED] = True
        batches.append(batch)
    own.derived[_ALIGNED] = True
    return own, batches


def preset_invariant_plan(
    batch: OwnBatch | PrefixBatch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: tuple,
    work: Tensor,
) -> None:
    """``preset_plan`` for ``attend_invariant``: ``batch`` (a CUDA graph's static batch)
    holds step-aligned tables and lengths (``layout.align_step_keys``) and ``work`` [W, 6]
    the items ``own_work`` / ``prefix_work`` (no key splits) list for them; ``config``
    from ``invariant_config``."""
    key = ("triton", "invariant", num_heads, num_kv_heads, head_dim, config)
    batch.derived[key] = _Plan(config, work, 1)
    batch.derived[_ALIGNED] = True


def _invariant_plan(batch, q: Tensor, k_cache: Tensor, group: int, config: tuple) -> _Plan:
    """The batch's work items for ``attend_invariant`` (no key splits), listed once (host
    fields only)."""
    key = ("triton", "invariant", q.shape[1], k_cache.shape[2], q.shape[2], config)
    if key not in batch.derived:
        plan_of = _own_plan if isinstance(batch, OwnBatch) else _prefix_plan
        batch.derived[key] = plan_of(batch, config, group, k_cache.shape[2], 0)
    return batch.derived[key]


def _launch_invariant(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    group: int,
    plan: _Plan,
    state: tuple[Tensor, Tensor, Tensor, Tensor],
    batch: OwnBatch | PrefixBatch,
    load: bool,
) -> None:
    """One level's launch (own batch: causal, FINAL) on ``state`` (out, m, l, acc)."""
    block_m, block_n, block_d, num_warps, num_stages, step = plan.config
    out, m_state, l_state, acc_state = state
    own = isinstance(batch, OwnBatch)
    rows = batch.block_tables if own else batch.rows
    lows = None if own else batch.key_start
    mma, precision = _mma(q)
    _invariant_attention_kernel[(plan.work.shape[0], k_cache.shape[2])](
        q,
        k_cache,
        v_cache,
        out,
        m_state,
        l_state,
        acc_state,
        plan.work,
        rows,
        batch.block_tables,
        rows if lows is None else lows,
        batch.window if own else 0,
        scale * _LOG2E,
        k_cache.shape[1],
        q.shape[1],
        q.shape[2],
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        batch.block_tables.stride(0),
        GROUP=group,
        INDIRECT=not own,
        CAUSAL=own,
        LOAD_STATE=load,
        FINAL=own,
        WINDOWED=bool(batch.window) if own else lows is not None,
        MMA_DTYPE=mma,
        PRECISION=precision,
        STEP_KEYS=step,
        ROW_PRODUCTS=q.device.type == "cpu",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def attend_invariant(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    own: OwnBatch,
    prefixes: Sequence[PrefixBatch],
    scale: float,
) -> Tensor:
    """``attend``'s batch-invariant mode: a row's output bits are a function of its q and
    keys alone, whatever else shares the step, however its keys are cut into shared
    segments and prefill chunks, wherever it sits (as the compiled CPU kernel's invariant
    mode). The batches come from ``invariant_batches`` (or ``preset_invariant_plan``).

    Each (row tile, KV head) carries one fp32 softmax state (running max, denominator and
    numerator) through the row's shared levels in order, one launch a level, then its own
    keys, whose launch normalizes and writes out: softmax steps of ``invariant_step_keys``
    keys at positions that depend on the key positions only, tile shapes fixed per model
    (``invariant_config``), no key split and no log-sum-exp merge. Rows no own work item
    covers (a CUDA graph's padding rows) get garbage. Returns out [T, num_heads, head_dim]
    in q's dtype."""
    group = check_launch(q, k_cache, v_cache, own, OwnBatch)
    scale = check_scale(scale)
    _check_device(q)
    _check_head_dim(q.shape[2])
    _check_batch_index("block_tables", own.block_tables, 2)
    if not own.derived.get(_ALIGNED):
        raise ValueError("attend_invariant takes batches from invariant_batches")
    num_rows, num_heads, head_dim = q.shape
    config = invariant_config(q.dtype, head_dim, group, own.block_size)
    out = torch.empty_like(q)
    if prefixes:  # the carried state; rows no level reaches start it empty
        m_state = torch.full((num_rows, num_heads), -math.inf, device=q.device)
        l_state = torch.zeros((num_rows, num_heads), device=q.device)
        acc_state = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:  # the own launch starts the state itself and keeps it in registers
        m_state = l_state = acc_state = out
    state = (out, m_state, l_state, acc_state)
    if num_rows == 0 or num_heads == 0 or head_dim == 0:
        return out
    for batch in prefixes:
        check_launch(q, k_cache, v_cache, batch, PrefixBatch)
        _check_batch_index("block_tables", batch.block_tables, 2)
        _check_batch_index("rows", batch.rows, 1)
        if not batch.derived.get(_ALIGNED):
            raise ValueError("attend_invariant takes batches from invariant_batches")
        plan = _invariant_plan(batch, q, k_cache, group, config)
        if plan.work.shape[0]:
            _launch_invariant(q, k_cache, v_cache, scale, group, plan, state, batch, True)
    plan = _invariant_plan(own, q, k_cache, group, config)
    if plan.work.shape[0]:
        _launch_invariant(q, k_cache, v_cache, scale, group, plan, state, own, bool(prefixes))
    return out


def _merge_pair(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor] | None, out_dtype) -> tuple:
    a_out, a_lse = a
    num_tokens, num_heads, head_dim = a_out.shape
    out = torch.empty(a_out.shape, dtype=out_dtype, device=a_out.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=a_out.device)
    num_pairs = num_tokens * num_heads
    if num_pairs == 0 or head_dim == 0:
        return out, lse.fill_(-math.inf)
    b_out, b_lse = b if b is not None else (a_out, a_lse)
    block_d = triton.next_power_of_2(head_dim)
    block_p = max(1, min(64, 4096 // block_d))
    _merge_kernel[(triton.cdiv(num_pairs, block_p),)](
        a_out,
        a_lse,
        b_out,
        b_lse,
        out,
        lse,
        num_pairs,
        num_heads,
        head_dim,
        *a_out.stride(),
        *a_lse.stride(),
        *b_out.stride(),
        *b_lse.stride(),
        *out.stride(),
        *lse.stride(),
        HAS_B=b is not None,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out, lse


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Merge attention results of the same query rows over disjoint key sets.

    parts: one or more (out [T, num_heads, head_dim], lse [T, num_heads]) pairs, outs of
           one dtype, all on one device, any strides; a part with lse -inf at a row is
           ignored there (its out may be NaN).
    Returns AttentionOutput(out in the parts' out dtype, lse fp32); rows where every part
    is -inf get out 0, lse -inf. More than two parts fold pairwise in fp32.
    """
    checked = list(zip(*check_merge_parts(parts)))
    _check_device(checked[0][0])
    out_dtype = checked[0][0].dtype
    if len(checked) == 1:
        return AttentionOutput(*_merge_pair(checked[0], None, out_dtype))
    state = checked[0]
    for index, part in enumerate(checked[1:], start=2):
        dtype = out_dtype if index == len(checked) else torch.float32
        state = _merge_pair(state, part, dtype)
    return AttentionOutput(*state)
