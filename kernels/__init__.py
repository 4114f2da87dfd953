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

Self-check. The Triton kernels are tested in the interpreter, not yet on a GPU, so the
native engine calls ``ensure_checked(device, dtype)`` when it starts: it runs
``self_check.check_triton`` once per (device, dtype, head shape) and, when the kernels
disagree with the reference or fail to build, warns once (RuntimeWarning) and sends every
later operation on that device to the torch reference for the rest of the process. An
explicit ``LLM_OPERATOR_KERNELS`` skips the check (``triton`` still forces the kernels).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from llm_operator.kernels import reference
from llm_operator.kernels.reference import (
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    chain_batch,
    own_batch,
    prefix_batch,
)

__all__ = [
    "IMPLEMENTATION_ENV",
    "AttentionOutput",
    "OwnBatch",
    "PrefixBatch",
    "chain_batch",
    "ensure_checked",
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
# Device types whose tensors go to the Triton kernels unless the self-check failed there.
_TRITON_DEVICE_TYPES = ("cuda",)

# Process-wide self-check registry (filled at engine start, read by every dispatch):
# reasons by (device type, index, dtype, num_heads, num_kv_heads, head_dim), None = passed;
# and the (device type, index) pairs whose operations fall back to the torch reference.
_check_lock = threading.Lock()
_check_results: dict[tuple, str | None] = {}
_fallback_devices: set[tuple[str, int | None]] = set()


def _forced() -> str | None:
    """The implementation ``LLM_OPERATOR_KERNELS`` forces, or None when it is unset."""
    forced = os.environ.get(IMPLEMENTATION_ENV, "").strip().lower()
    if not forced:
        return None
    if forced not in _IMPLEMENTATIONS:
        raise ValueError(
            f"{IMPLEMENTATION_ENV} must be one of {', '.join(_IMPLEMENTATIONS)}, got {forced!r}"
        )
    return forced


def _device_key(device: torch.device) -> tuple[str, int | None]:
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return device.type, index


def implementation(tensor: Tensor) -> str:
    """``"torch"`` or ``"triton"``: the one that runs operations on ``tensor``'s device.

    ``LLM_OPERATOR_KERNELS`` when set; else Triton for CUDA tensors unless the device
    failed its self-check (``ensure_checked``), and the torch reference for the rest.
    """
    forced = _forced()
    if forced:
        return forced
    device = tensor.device
    if device.type not in _TRITON_DEVICE_TYPES:
        return "torch"
    if _fallback_devices and (device.type, device.index) in _fallback_devices:
        return "torch"
    return "triton"


def ensure_checked(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
) -> str | None:
    """Self-check the Triton kernels on ``device`` and ``dtype`` once per process; on a
    failure, route every later operation on ``device`` to the torch reference.

    Returns None when the kernels passed (or no check applies), else the failure's reason.
    Does nothing (None) when ``LLM_OPERATOR_KERNELS`` is set (``triton`` forces the kernels
    unchecked, ``torch`` needs none) or when ``device``'s tensors go to the torch reference
    anyway (CPU). Otherwise runs ``self_check.check_triton(device, dtype, ...)`` with the
    model's head shape the first time a (device, dtype, head shape) is seen and caches its
    result; a failure warns once (RuntimeWarning: which check failed, why, and that the
    torch path is used) and is never retried. Thread-safe; a check holds the lock while
    it runs (a few milliseconds on a GPU once compiled).
    """
    forced = _forced()
    device = torch.device(device)
    if forced or device.type not in _TRITON_DEVICE_TYPES:
        return None
    device_key = _device_key(device)
    key = (*device_key, dtype, num_heads, num_kv_heads, head_dim)
    with _check_lock:
        if key in _check_results:
            return _check_results[key]
        from llm_operator.kernels import self_check

        reason = self_check.check_triton(
            torch.device(*device_key),
            dtype,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        _check_results[key] = reason
        if reason is not None:
            _fallback_devices.add(device_key)
    if reason is not None:
        where = torch.device(*device_key)
        warnings.warn(
            f"llm_operator: the Triton attention kernels failed their self-check on {where} "
            f"({str(dtype).removeprefix('torch.')}): {reason}. Every attention operation on "
            f"{where} now uses the torch reference instead (correct, slower); set "
            f"{IMPLEMENTATION_ENV}=triton to force the kernels anyway.",
            RuntimeWarning,
            stacklevel=2,
        )
    return reason


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
    """Rows against their shared segments, non-causal (see ``reference.prefix_attention``);
    a ``chain_batch`` (slot lists) runs on the torch path only."""
    module = _module(q)
    if getattr(batch, "slot_tables", None) is not None and module is not reference:
        raise ValueError(
            "a chain_batch (segments as slot lists) runs on the torch path only; build one "
            "prefix_batch per chain level for the Triton kernels"
        )
    return module.prefix_attention(q, k_cache, v_cache, batch, scale)


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Log-sum-exp merge of parts over disjoint keys (see ``reference.merge_attention_states``)."""
    first = parts[0][0] if isinstance(parts, Sequence) and parts and len(parts[0]) else None
    if not isinstance(first, Tensor):
        return reference.merge_attention_states(parts)  # raises the argument error
    return _module(first).merge_attention_states(parts)
