"""The decoder layer's elementwise regions as Triton kernels: the CUDA path of ``fused``.

``TritonOps`` runs each region of ``fused.FusedOps`` (and the first layer's input norm,
``rms_norm``) as one launch of ``llm_operator.kernels.triton_fused``, with eager's
roundings (read its docstring). ``qkv_rope_store`` also writes the step's k and v into the
paged KV cache in the same launch (``triton_attention.store_kv``'s layout): the engine's
forward takes it where both the attention and these regions run on Triton
(``LlamaModel.forward(fused_store=True)``).

The engine decides where these run, once (``engine.factory.native_paths``): on CUDA, and
on CPU tensors under the Triton interpreter in tests (``kernels="triton"``), after
``kernels.self_check.check_triton_fused`` passed for the model's sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llm_operator.kernels import torch_attention, triton_fused
from llm_operator.models import fused
from llm_operator.models.fused import FusedOps


class TritonOps(FusedOps):
    """The regions through the Triton kernels; same contract as ``FusedOps``.

    Each method returns what ``FusedOps``'s returns (up to the rounding in
    ``triton_fused``'s docstring), in new contiguous tensors. Inputs the kernels do not
    take run the eager reference instead: non-contiguous or mixed dtypes or devices,
    shapes that disagree, zero tokens, tensors that need gradients, sizes past the
    kernels' limits, CPU tensors unless the Triton interpreter runs the kernels.
    """

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() == 2 and weight.shape == x.shape[1:] and self._runs(x, weight):
            if x.shape[1] <= triton_fused.MAX_ROW_SIZE:
                return triton_fused.rms_norm(x, weight, eps)
        return fused.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, hidden: Tensor, delta: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        if (
            hidden.dim() == 2
            and hidden.shape == delta.shape
            and weight.shape == hidden.shape[1:]
            and hidden.shape[1] <= triton_fused.MAX_ROW_SIZE
            and self._runs(hidden, delta, weight)
        ):
            return triton_fused.add_rms_norm(hidden, delta, weight, eps)
        return fused.add_rms_norm(hidden, delta, weight, eps)

    def qkv_rope(
        self,
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
        args = (qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads)
        if self._rope_runs(*args, head_dim):
            return triton_fused.qkv_rope(*args, head_dim)
        return fused.qkv_rope(*args, head_dim)

    def qkv_rope_store(
        self,
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
        """``qkv_rope``, then k and v written into the cache at ``slot_mapping`` (layout and
        skipped slots of ``triton_attention.store_kv``), in one launch when the kernels
        take the inputs, else the eager regions and the torch reference store."""
        args = (qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads)
        cache = (k_cache, v_cache, slot_mapping)
        if (
            self._rope_runs(*args, head_dim)
            and k_cache.dim() == 4
            and k_cache.shape[2:] == (num_kv_heads, head_dim)
            and v_cache.shape == k_cache.shape
            and slot_mapping.shape == qkv.shape[:1]
            and slot_mapping.dtype in (torch.int32, torch.int64)
            and _same_place(qkv, k_cache, v_cache)
            and slot_mapping.device == qkv.device
        ):
            return triton_fused.qkv_rope_store(*args, head_dim, *cache)
        return _eager_rope_store(*args, head_dim, *cache)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and self._runs(gate_up):
            return triton_fused.silu_mul(gate_up)
        return fused.silu_mul(gate_up)

    # -- when the kernels run ----------------------------------------------------------
    def _rope_runs(
        self, qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads, head_dim
    ) -> bool:
        tensors = [qkv, cos, sin]
        if (q_norm_weight is None) != (k_norm_weight is None):
            return False  # the reference normalizes only with both weights
        if q_norm_weight is not None and k_norm_weight is not None:
            if not q_norm_weight.shape == k_norm_weight.shape == (head_dim,):
                return False
            tensors += (q_norm_weight, k_norm_weight)
        return (
            0 < head_dim <= triton_fused.MAX_HEAD_DIM
            and head_dim % 2 == 0
            and qkv.dim() == 2
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.shape == sin.shape == (qkv.shape[0], head_dim)
            and self._runs(*tensors)
        )

    def _runs(self, first: Tensor, *others: Tensor) -> bool:
        """Whether the kernels take these tensors: contiguous, one floating dtype and
        device the kernels run on, ``first`` with tokens, no autograd."""
        if first.numel() == 0 or first.dtype not in _KERNEL_DTYPES:
            return False
        if not _same_place(first, *others) or not all(t.is_contiguous() for t in (first, *others)):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in (first, *others)):
            return False  # the kernels record no autograd graph
        # CUDA, or the CPU when the Triton interpreter runs the kernels
        device = first.device.type
        return device == "cuda" or (device == "cpu" and triton_fused.interpreted())


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _same_place(first: Tensor, *others: Tensor) -> bool:
    return all(t.dtype == first.dtype and t.device == first.device for t in others)


def _eager_rope_store(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``fused.qkv_rope`` on args[:9], then the torch reference ``store_kv`` of the k and v
    rows whose slots lie in the cache (args[9:]: k_cache, v_cache, slot_mapping)."""
    q, k, v = fused.qkv_rope(*args[:9])
    k_cache, v_cache, slot_mapping = args[9:]
    num_slots = k_cache.shape[0] * k_cache.shape[1] if k_cache.dim() == 4 else 0
    kept = (slot_mapping >= 0) & (slot_mapping < num_slots)  # the others are skipped
    torch_attention.store_kv(k_cache, v_cache, k[kept], v[kept], slot_mapping[kept])
    return q, k, v


TRITON_OPS = TritonOps()
