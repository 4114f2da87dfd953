"""Triton kernels for a decoder layer's elementwise regions (the CUDA path of
``llm_operator.models.fused``, whose functions are the torch references):

- ``rms_norm``: HF's RMSNorm of each row of x [T, size], whole rows per program;
- ``add_rms_norm``: the same, after the residual add ``hidden + delta`` (both written);
- ``qkv_rope``: the q/k/v split of the qkv projection, optional per-head q/k RMSNorm
  (Qwen3), RoPE on q and k (HF's rotate_half), whole tokens per program;
  ``qkv_rope_store`` also writes k and v into the paged KV cache in the same launch
  (``triton_attention.store_kv``'s layout and slot rule);
- ``silu_mul``: SiLU(gate) * up, per (rows, column block) program.

Precision: eager's roundings, one by one. Loads go to fp32; each op eager runs in the
model dtype is computed in fp32 and rounded to that dtype (``_round``: nearest even, also
for bf16 under the interpreter, whose own bf16 cast truncates): the residual sum, the
normalized value, its product with the weight, ``x * cos``, ``rotate_half(x) * sin`` and
their sum, ``silu(gate)``, its product with ``up``. Products and sums of two bf16/fp16
values are exact in fp32, so those roundings equal eager's bit for bit. The launches turn
off fp fusion (no multiply-add contraction, which would skip a rounding), divide with IEEE
``div_rn``, and on CUDA take ``exp`` from libdevice (CUDA's ``expf``, as torch's SiLU;
Triton's own ``exp`` is an approximation). What can differ from eager: the order of an
RMSNorm's fp32 sum of squares (a tree here), and ``exp``/``rsqrt`` by an ulp where the
libraries differ: fp32 outputs agree to a few ulp, bf16/fp16 outputs are bitwise equal but
for a rare flip where such an fp32 difference crosses a rounding boundary (one ulp, which
the weight's product can widen to two).

Block sizes come from the shapes, no autotuning: a program takes 1 to 16 rows (tokens),
as many as make ~2,048 values of one row's size (never from the token count: a row's
arithmetic is the same in every batch). Each call is one launch (none for zero tokens),
never reads a device value back, and returns new contiguous tensors. The launchers check shapes, strides, dtypes and devices; slots outside
the cache are skipped, as ``store_kv`` does, not checked (that would need a sync).
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm_operator.kernels.layout import FLOAT_DTYPES, check_store
from llm_operator.kernels.triton_fused_kernels import (
    _qkv_rope_kernel,
    _rms_norm_kernel,
    _silu_mul_kernel,
)

__all__ = ["MAX_HEAD_DIM", "MAX_ROW_SIZE", "add_rms_norm", "qkv_rope", "qkv_rope_store",
           "rms_norm", "silu_mul"]  # fmt: skip

MAX_ROW_SIZE = 32768  # elements of a norm row: one program holds the whole row
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------- launch checks

_INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` before
    Triton was first imported): they take CPU tensors then, and only then."""
    return _INTERPRETED


def _check_float(name: str, value: object, ndim: int, layout: str) -> Tensor:
    """A floating-point tensor of ``ndim`` dims with unit stride along its last dim."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(value.shape)}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {value.dtype}")
    if value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride along its last dimension, got strides {value.stride()}"
        )
    return value


def _check_like(name: str, value: Tensor, first_name: str, first: Tensor) -> None:
    if value.dtype != first.dtype:
        raise TypeError(f"{name} dtype {value.dtype} != {first_name} dtype {first.dtype}")
    if value.device != first.device:
        raise ValueError(f"{name} is on {value.device} but {first_name} on {first.device}")


def _check_device(name: str, tensor: Tensor) -> None:
    if tensor.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            f"{name} is a CPU tensor but the Triton kernels run compiled; set "
            "TRITON_INTERPRET=1 before triton is first imported to run them in the interpreter"
        )


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return float(eps)


def _check_count(name: str, value: object, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return int(value)


def _rows_per_program(row_elements: int) -> int:
    """Rows (tokens) a program takes: enough for ~2,048 values, 1 to 16; from the row's
    size only, so a row's arithmetic never depends on the token count (batch invariance)."""
    return max(1, min(16, 2048 // triton.next_power_of_2(row_elements)))


def _warps(elements: int) -> int:
    """Warps for a program over ``elements`` values: ~256 values a warp, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(elements) // 256))


# ---------------------------------------------------------------- public operations


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, size], weight [size] -> HF's RMSNorm of each row, [T, size] in x's dtype:
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (``models.fused.rms_norm``)."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    hidden: Tensor, delta: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """hidden, delta [T, size], weight [size] -> (hidden + delta, rms_norm(hidden + delta)),
    each [T, size] in hidden's dtype; the sum rounded to the dtype, as eager's add."""
    return _norm(hidden, delta, weight, eps)


def _norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta or x, its RMSNorm): one launch of ``_rms_norm_kernel``."""
    x_name = "x" if delta is None else "hidden"
    _check_float(x_name, x, 2, "[tokens, size]")
    if delta is not None:
        _check_float("delta", delta, 2, "[tokens, size]")
        _check_like("delta", delta, x_name, x)
        if delta.shape != x.shape:
            raise ValueError(f"delta shape {tuple(delta.shape)} != hidden shape {tuple(x.shape)}")
    _check_float("weight", weight, 1, "[size]")
    _check_like("weight", weight, x_name, x)
    tokens, size = x.shape
    if weight.shape[0] != size:
        raise ValueError(f"weight has {weight.shape[0]} elements but {x_name} rows {size}")
    _check_count(f"{x_name} row size", size, MAX_ROW_SIZE)
    eps = _check_eps(eps)
    _check_device(x_name, x)
    out = torch.empty((tokens, size), dtype=x.dtype, device=x.device)
    total = x if delta is None else torch.empty_like(out)
    if tokens:
        block = triton.next_power_of_2(size)
        rows = _rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(tokens, rows),)](
            x, x if delta is None else delta, weight, out, total, tokens, eps,
            x.stride(0), x.stride(0) if delta is None else delta.stride(0),
            SIZE=size, HAS_DELTA=delta is not None, DTYPE=_TL_DTYPES[x.dtype], ROWS=rows,
            BLOCK=block, num_warps=_warps(rows * block), enable_fp_fusion=False,
        )  # fmt: skip
    return total, out


def qkv_rope(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The qkv projection's output [T, (heads + 2 * kv_heads) * dim] -> q [T, heads, dim],
    k and v [T, kv_heads, dim], contiguous, in qkv's dtype; q and k per-head RMSNormed when
    both norm weights [dim] are given (Qwen3; neither: no norm), then rotated with cos, sin
    [T, dim] (HF's ``x * cos + rotate_half(x) * sin``), as ``models.fused.qkv_rope``."""
    return _qkv_rope(
        qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads, head_dim
    )


def qkv_rope_store(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``qkv_rope``, and in the same launch k and v written into the paged cache, as
    ``triton_attention.store_kv(k_cache, v_cache, k, v, slot_mapping)`` would.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in qkv's dtype, any
    strides; slot_mapping: [T] int32/int64, token t to block slot // block_size at offset
    slot % block_size; slots outside [0, num_blocks * block_size) (e.g. -1 padding) are
    skipped. Returns (q, k, v) as ``qkv_rope`` does.
    """
    return _qkv_rope(
        qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads, head_dim,
        (k_cache, v_cache, slot_mapping),
    )  # fmt: skip


def _qkv_rope(
    qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads, head_dim, store=None
) -> tuple[Tensor, Tensor, Tensor]:
    """Check, then one launch of ``_qkv_rope_kernel`` (storing to the cache when ``store``)."""
    num_heads = _check_count("num_heads", num_heads)
    num_kv_heads = _check_count("num_kv_heads", num_kv_heads)
    head_dim = _check_count("head_dim", head_dim, MAX_HEAD_DIM)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates two halves), got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    _check_float("qkv", qkv, 2, f"[tokens, (num_heads + 2 * num_kv_heads) * head_dim = {width}]")
    tokens = qkv.shape[0]
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv has rows of {qkv.shape[1]} but (num_heads {num_heads} + 2 * num_kv_heads "
            f"{num_kv_heads}) * head_dim {head_dim} = {width}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        _check_float(name, table, 2, "[tokens, head_dim]")
        _check_like(name, table, "qkv", qkv)
        if tuple(table.shape) != (tokens, head_dim):
            raise ValueError(
                f"{name} must be [tokens, head_dim] = {(tokens, head_dim)}, got {tuple(table.shape)}"
            )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must both be given or both be None")
    qk_norm = q_norm_weight is not None
    if qk_norm:
        for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            _check_float(name, weight, 1, "[head_dim]")
            _check_like(name, weight, "qkv", qkv)
            if weight.shape[0] != head_dim:
                raise ValueError(
                    f"{name} must be [head_dim = {head_dim}], got {tuple(weight.shape)}"
                )
    eps = _check_eps(eps)
    _check_device("qkv", qkv)
    options = {"dtype": qkv.dtype, "device": qkv.device}
    q = torch.empty((tokens, num_heads, head_dim), **options)  # [T, heads, dim]
    k = torch.empty((tokens, num_kv_heads, head_dim), **options)  # [T, kv_heads, dim]
    v = torch.empty((tokens, num_kv_heads, head_dim), **options)
    if store is None:
        k_cache = v_cache = slot_mapping = qkv  # unused (STORE off)
        num_slots, block_size, stride_slot = 0, 1, 0
    else:
        k_cache, v_cache, slot_mapping = store
        layout = (num_kv_heads, head_dim)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(cache, Tensor):
                continue  # check_store says what it must be
            _check_like(name, cache, "qkv", qkv)
            if cache.dim() == 4 and cache.shape[2:] != layout:
                raise ValueError(
                    f"{name} must be [num_blocks, block_size, num_kv_heads = {num_kv_heads}, "
                    f"head_dim = {head_dim}], got {tuple(cache.shape)}"
                )
        num_blocks, block_size = check_store(k_cache, v_cache, k, v, slot_mapping)
        num_slots, stride_slot = num_blocks * block_size, slot_mapping.stride(0)
    if tokens:
        block_q, block_kv = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
        block_d = triton.next_power_of_2(head_dim)
        row_elements = (block_q + 2 * block_kv) * block_d
        rows = _rows_per_program(row_elements)
        _qkv_rope_kernel[(triton.cdiv(tokens, rows),)](
            qkv, cos, sin, q_norm_weight if qk_norm else qkv, k_norm_weight if qk_norm else qkv,
            q, k, v, k_cache, v_cache, slot_mapping, tokens, eps, num_slots, block_size,
            qkv.stride(0), cos.stride(0), sin.stride(0), stride_slot,
            *(k_cache.stride() if store else (0,) * 4), *(v_cache.stride() if store else (0,) * 4),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, QK_NORM=qk_norm,
            STORE=store is not None, DTYPE=_TL_DTYPES[qkv.dtype], ROWS=rows, BLOCK_Q=block_q,
            BLOCK_KV=block_kv, BLOCK_D=block_d,
            num_warps=_warps(rows * row_elements), enable_fp_fusion=False,
        )  # fmt: skip
    return q, k, v


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2 * intermediate] (gate, then up) -> SiLU(gate) * up [T, intermediate] in
    gate_up's dtype: ``silu`` rounded to the dtype, then the product (``models.fused.silu_mul``)."""
    _check_float("gate_up", gate_up, 2, "[tokens, 2 * intermediate]")
    tokens, width = gate_up.shape
    if width == 0 or width % 2:
        raise ValueError(f"gate_up rows must have an even, positive size, got {width}")
    size = width // 2
    _check_device("gate_up", gate_up)
    out = torch.empty((tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(triton.next_power_of_2(size), 1024)
        rows = _rows_per_program(block)
        _silu_mul_kernel[(triton.cdiv(tokens, rows), triton.cdiv(size, block))](
            gate_up, out, tokens, gate_up.stride(0),
            SIZE=size, DTYPE=_TL_DTYPES[gate_up.dtype], LIBDEVICE_EXP=not _INTERPRETED,
            ROWS=rows, BLOCK=block, num_warps=_warps(rows * block), enable_fp_fusion=False,
        )  # fmt: skip
    return out
