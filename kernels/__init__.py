"""Attention operations of the native engine over a paged KV cache (``llm_operator.kernels``).

Shared-prefix attention: ``prefix_attention`` (the rows of every request sharing a prefix
segment against one copy of its K/V, non-causal) plus ``own_attention`` (each request
against its own K/V, causal), merged by log-sum-exp in ``merge_attention_states``;
``store_kv`` writes a step's K/V into the cache. The index layout of one step is
validated once on the host (``own_batch``, ``prefix_batch``) and reused by every layer.
Shapes and contracts are in ``reference.py``'s docstrings.

Two implementations share these signatures: the torch reference (``reference.py``, the
CPU path and the test oracle) and Triton kernels (``triton_attention.py``). CUDA tensors
go to Triton, CPU tensors to the reference; ``LLM_OPERATOR_KERNELS=torch|triton`` forces
one (``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``, set before import).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch import Tensor

from llm_operator.kernels import reference
from llm_operator.kernels.reference import (
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    own_batch,
    prefix_batch,
)

__all__ = [
    "IMPLEMENTATION_ENV",
    "AttentionOutput",
    "OwnBatch",
    "PrefixBatch",
    "implementation",
    "merge_attention_states",
    "own_attention",
    "own_batch",
    "prefix_attention",
    "prefix_batch",
    "store_kv",
]

IMPLEMENTATION_ENV = "LLM_OPERATOR_KERNELS"
_IMPLEMENTATIONS = ("torch", "triton")


def implementation(tensor: Tensor) -> str:
    """``"torch"`` or ``"triton"``: the one that runs operations on ``tensor``'s device."""
    forced = os.environ.get(IMPLEMENTATION_ENV, "").strip().lower()
    if forced:
        if forced not in _IMPLEMENTATIONS:
            raise ValueError(
                f"{IMPLEMENTATION_ENV} must be one of {', '.join(_IMPLEMENTATIONS)}, got {forced!r}"
            )
        return forced
    return "triton" if tensor.device.type == "cuda" else "torch"


def _module(tensor: Tensor):
    if implementation(tensor) == "torch":
        return reference
    try:
        from llm_operator.kernels import triton_attention
    except ImportError as error:  # triton missing, or no GPU and no interpreter
        raise RuntimeError(
            f"the Triton kernels cannot be used ({error}); install triton, or set "
            f"{IMPLEMENTATION_ENV}=torch"
        ) from error
    return triton_attention


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write a step's K/V into the paged cache (see ``reference.store_kv``)."""
    _module(k_cache).store_kv(k_cache, v_cache, k, v, slot_mapping)


def own_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: OwnBatch, scale: float
) -> AttentionOutput:
    """Each request's rows against its own K/V, causal (see ``reference.own_attention``)."""
    return _module(q).own_attention(q, k_cache, v_cache, batch, scale)


def prefix_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: PrefixBatch, scale: float
) -> AttentionOutput:
    """Rows against their shared segments, non-causal (see ``reference.prefix_attention``)."""
    return _module(q).prefix_attention(q, k_cache, v_cache, batch, scale)


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Log-sum-exp merge of parts over disjoint keys (see ``reference.merge_attention_states``)."""
    first = parts[0][0] if isinstance(parts, Sequence) and parts and len(parts[0]) else None
    if not isinstance(first, Tensor):
        return reference.merge_attention_states(parts)  # raises the argument error
    return _module(first).merge_attention_states(parts)
