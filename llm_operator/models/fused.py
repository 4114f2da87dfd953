"""The decoder layer's elementwise work as three regions, eager: the reference.

Besides its GEMMs and attention, a layer runs ~35 small ops: RMSNorms, residual adds,
the q/k/v split, Qwen3's q/k norm, RoPE on q and k, SiLU(gate) * up. They form three
regions per layer (the linears and the attention callback run between them):

    add_rms_norm   residual add + RMSNorm (the input norm, fed the previous layer's MLP
                   output; the post-attention norm, fed o_proj's output; the final norm)
    qkv_rope       split q/k/v, [per-head q/k RMSNorm,] RoPE on q and k, v contiguous
    silu_mul       SiLU(gate) * up (only for hidden_act "silu"; other activations eager)

The functions below are Hugging Face's arithmetic, op for op: the eager forward's regions
(``EAGER_OPS``) and the reference of the Triton kernels that run them on CUDA, one launch
each (``models/triton_ops.py``, ``kernels/triton_fused.py``). On the CPU the compiled
decoder (``models/cpu_decoder.py``) runs whole steps in C++ and these run only where it
does not (Gemma, Phi-3's partial rotary, the torch kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llm_operator.models.rope import apply_rotary


# -- the regions, eagerly: Hugging Face's arithmetic, op for op ----------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., size], weight [size] -> [..., size] in x's dtype, as HF's RMSNorm computes it:
    normalize in fp32 (x * rsqrt(mean(x^2) + eps)), cast back, then times the weight."""
    dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


def add_rms_norm(
    hidden: Tensor, delta: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """hidden, delta [T, size] -> (hidden + delta, rms_norm(hidden + delta)), each [T, size]:
    a residual add (rounded to the model dtype, as HF's) and the next block's norm."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


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
    k and v [T, kv_heads, dim], each contiguous; q and k per-head RMSNormed when the norm
    weights [dim] are given (Qwen3), then rotated with cos, sin [T, dim] (HF's rotate_half)."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_heads, head_dim)  # [T, heads, dim], strided over qkv
    k = k.view(tokens, num_kv_heads, head_dim)  # [T, kv_heads, dim]
    v = v.reshape(tokens, num_kv_heads, head_dim).contiguous()  # [T, kv_heads, dim]
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2 * intermediate] (gate, then up) -> SiLU(gate) * up [T, intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class FusedOps:
    """The three regions, and the first layer's input norm (``rms_norm``), eagerly (this
    class) or as Triton kernels (``triton_ops.TritonOps``): same contract."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    qkv_rope = staticmethod(qkv_rope)
    silu_mul = staticmethod(silu_mul)


EAGER_OPS = FusedOps()
