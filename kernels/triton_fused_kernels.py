"""The Triton kernels of a decoder layer's elementwise regions; their launchers, checks
and numerics are in ``triton_fused.py`` (read its docstring). Each loads to fp32 and
rounds every op eager runs in the model dtype with ``_round``, so the roundings are eager's.

A program takes ROWS rows (tokens), a number the launchers derive from the row's size
alone, never from the token count, so a row's arithmetic does not depend on its batch; the
token count is not specialized on either (one build serves every batch).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - Triton < 3.0 has no generic libdevice
    libdevice = None


def _device_function(function):
    """``triton.jit`` for a helper the kernels call; under the interpreter the plain function
    (the calling kernel has already patched ``triton.language``, which a nested interpreted
    call would re-patch at ~1 ms a call: most of the tests' time otherwise)."""
    jitted = triton.jit(function)
    return function if type(jitted).__name__ == "InterpretedFunction" else jitted


@_device_function
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (nearest even), as fp32: what eager's op in DTYPE gives."""
    if DTYPE == tl.float32:
        return x
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:  # bfloat16: by the bits (the interpreter's fp32 -> bf16 cast truncates)
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN


@triton.jit(do_not_specialize=["tokens"])  # one build for any token count
def _rms_norm_kernel(
    x_ptr,  # [T, SIZE]
    delta_ptr,  # [T, SIZE] (HAS_DELTA)
    weight_ptr,  # [SIZE]
    out_ptr,  # [T, SIZE] contiguous
    sum_ptr,  # [T, SIZE] contiguous: x + delta (HAS_DELTA)
    tokens,
    eps,
    stride_x,
    stride_delta,
    SIZE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # SIZE rounded up to a power of two
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < tokens) & (cols < SIZE)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + rows * stride_delta + cols, mask=mask, other=0.0)
        x = _round(x + delta.to(tl.float32), DTYPE)
        tl.store(sum_ptr + rows * SIZE + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)
    variance = tl.math.div_rn(tl.sum(x * x, axis=1), SIZE * 1.0)  # [ROWS]
    normed = _round(x * tl.math.rsqrt(variance + eps)[:, None], DTYPE)
    weight = tl.load(weight_ptr + cols, mask=cols < SIZE, other=0.0).to(tl.float32)
    out = _round(weight * normed, DTYPE)
    tl.store(out_ptr + rows * SIZE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@_device_function
def _rope_heads(
    src,  # [ROWS, 1, 1] pointers: each row's first element of the section [NUM, HEAD_DIM]
    row_valid,  # [ROWS, 1, 1]
    norm_ptr,  # [HEAD_DIM] (QK_NORM)
    cos,  # [ROWS, 1, BLOCK_D] fp32
    sin,
    eps,
    NUM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """([ROWS, BLOCK_H, BLOCK_D] fp32: NUM heads [per-head RMSNormed], rotated, each op
    rounded to DTYPE; the heads' index and mask)."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM  # the element rotate_half brings to dims
    mask = row_valid & (heads < NUM) & (dims < HEAD_DIM)
    x = tl.load(src + heads * HEAD_DIM + dims, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src + heads * HEAD_DIM + partner, mask=mask, other=0.0)
    x_partner = x_partner.to(tl.float32)
    if QK_NORM:
        variance = tl.math.div_rn(tl.sum(x * x, axis=2), HEAD_DIM * 1.0)  # [ROWS, BLOCK_H]
        scale = tl.math.rsqrt(variance + eps)[:, :, None]
        weight = tl.load(norm_ptr + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
        weight_partner = tl.load(norm_ptr + partner, mask=dims < HEAD_DIM, other=0.0)
        x = _round(weight * _round(x * scale, DTYPE), DTYPE)
        x_partner = _round(weight_partner.to(tl.float32) * _round(x_partner * scale, DTYPE), DTYPE)
    rotated = tl.where(dims < HEAD_DIM // 2, -x_partner, x_partner)  # rotate_half(x)
    return _round(_round(x * cos, DTYPE) + _round(rotated * sin, DTYPE), DTYPE), heads, mask


@triton.jit(do_not_specialize=["tokens"])  # one build for any token count
def _qkv_rope_kernel(
    qkv_ptr,  # [T, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM], unit stride along a row
    cos_ptr,  # [T, HEAD_DIM]
    sin_ptr,
    q_norm_ptr,  # [HEAD_DIM] (QK_NORM)
    k_norm_ptr,
    q_ptr,  # [T, NUM_HEADS, HEAD_DIM] contiguous
    k_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM] contiguous
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM] (STORE)
    v_cache_ptr,
    slot_ptr,  # [T] int32 / int64 (STORE)
    tokens,
    eps,
    num_slots,  # num_blocks * block_size
    block_size,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_slot,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    STORE: tl.constexpr,
    DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    valid = token < tokens
    token = token.to(tl.int64)[:, None, None]  # [ROWS, 1, 1]
    row_valid = valid[:, None, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]  # [1, 1, BLOCK_D]
    table_mask = row_valid & (dims < HEAD_DIM)
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=table_mask, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    src = qkv_ptr + token * stride_qkv  # region map of a row: [q heads | k heads | v heads]
    q, heads, mask = _rope_heads(src, row_valid, q_norm_ptr, cos, sin, eps, NUM_HEADS, HEAD_DIM,
                                 QK_NORM, DTYPE, BLOCK_Q, BLOCK_D)  # fmt: skip
    q_dst = q_ptr + token * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(q_dst, q.to(q_ptr.dtype.element_ty), mask=mask)

    src = src + NUM_HEADS * HEAD_DIM
    k, heads, mask = _rope_heads(src, row_valid, k_norm_ptr, cos, sin, eps, NUM_KV_HEADS,
                                 HEAD_DIM, QK_NORM, DTYPE, BLOCK_KV, BLOCK_D)  # fmt: skip
    offsets = heads * HEAD_DIM + dims  # [1, BLOCK_KV, BLOCK_D] within a row
    v = tl.load(src + NUM_KV_HEADS * HEAD_DIM + offsets, mask=mask, other=0.0)
    k, v = k.to(k_ptr.dtype.element_ty), v.to(v_ptr.dtype.element_ty)
    tl.store(k_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + offsets, k, mask=mask)
    tl.store(v_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + offsets, v, mask=mask)
    if STORE:
        slot = tl.load(slot_ptr + token * stride_slot, mask=row_valid, other=-1).to(tl.int64)
        in_cache = (slot >= 0) & (slot < num_slots)  # other slots (e.g. -1 padding): skipped
        slot = tl.where(in_cache, slot, 0)
        block, offset = slot // block_size, slot % block_size  # [ROWS, 1, 1]
        heads_here = tl.where(in_cache, NUM_KV_HEADS, 0)  # 0: write nothing
        mask = (heads < heads_here) & (dims < HEAD_DIM)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
        tl.store(k_dst + heads * stride_kch + dims * stride_kcd, k, mask=mask)
        tl.store(v_dst + heads * stride_vch + dims * stride_vcd, v, mask=mask)


@triton.jit(do_not_specialize=["tokens"])  # one build for any token count
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * SIZE]: gate, then up; unit stride along a row
    out_ptr,  # [T, SIZE] contiguous
    tokens,
    stride_in,
    SIZE: tl.constexpr,
    DTYPE: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,  # CUDA's expf (compiled); tl.exp in the interpreter
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per program
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # [1, BLOCK]
    mask = (rows < tokens) & (cols < SIZE)
    gate = tl.load(gate_up_ptr + rows * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * stride_in + SIZE + cols, mask=mask, other=0.0)
    if LIBDEVICE_EXP:
        exp = libdevice.exp(-gate)
    else:
        exp = tl.exp(-gate)
    silu = _round(tl.math.div_rn(gate, 1.0 + exp), DTYPE)  # eager: x / (1 + exp(-x))
    out = _round(silu * up.to(tl.float32), DTYPE)
    tl.store(out_ptr + rows * SIZE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
