"""Attention operations of the native engine over a paged KV cache (``llm_operator.kernels``).

Shared-prefix attention: ``prefix_attention`` (the rows of every request sharing a prefix
segment against one copy of its K/V, non-causal) plus ``own_attention`` (each request
against its own K/V, causal), merged by log-sum-exp in ``merge_attention_states``;
``store_kv`` writes a step's K/V into the cache. The index layout of one step is
validated once on the host (``own_batch``, ``prefix_batch``, in ``metadata.py``) and reused
by every layer. Shapes and contracts are in the docstrings of ``metadata.py`` (the cache
layout, the batches, dtypes) and ``torch_attention.py`` (the operations).

Three implementations:

    torch   plain torch (``torch_attention.py``): the test oracle, and the CPU fallback
    triton  Triton kernels (``triton_attention.py``) for CUDA tensors, same signatures
    cpp     compiled CPU kernels (``cpu_kernels.cpp`` via ``cpu_extension`` and ``cpu_ops``)
            for fp32/bf16 CPU tensors: their own cache layout (``kv_cache_shapes``), and one
            call per layer that stores the step's K/V and computes every part, merged

The engine runs a step through ``AttentionStep`` (built once per step, called per layer),
which works for all three (``step_implementation`` picks: CUDA tensors go to Triton;
fp32/bf16 CPU tensors to ``cpp`` once ``ensure_checked`` loaded it, other CPU tensors to
torch). The single operations below run in the reference layout (``metadata.py``), on
Triton or torch (``implementation``).
``LLM_OPERATOR_KERNELS=torch|triton|cpp`` forces one (``triton`` on CPU tensors needs
``TRITON_INTERPRET=1``, set before import).

Self-check. The native engine calls ``ensure_checked(device, dtype)`` when it starts. On
CUDA it runs ``self_check.check_triton`` once per (device, dtype, head shape), in a child
process first (``triton_proof``; a crash there is a failed check), and, when the
kernels disagree with the reference or fail to build, warns once (RuntimeWarning) and
sends every later operation on that device to the torch reference for the rest of the
process. On the CPU it builds or loads the compiled kernels and checks them
(``cpu_extension.load``); without a compiler, or on a failed check, it warns once and the
CPU runs the torch reference. An explicit ``LLM_OPERATOR_KERNELS`` skips the Triton check
(``triton`` still forces the kernels); ``cpp`` raises if the compiled kernels cannot load.
The elementwise regions' Triton kernels (``triton_fused``) have a check of their own
(``self_check_fused``, proven the same way), which the engine runs next where
``triton_device`` holds (``llm_operator.models.triton_ops.ensure_checked``: its reference
lives above this layer); a failure there sends those regions to eager on that device and
leaves the attention kernels as their own check left them.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from llm_operator.kernels import cpu_extension, cpu_ops, torch_attention
from llm_operator.kernels.metadata import (
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    chain_batch,
    own_batch,
    own_batch_arrays,
    prefix_batch,
    prefix_batch_arrays,
    windowed,
)

__all__ = [
    "IMPLEMENTATION_ENV",
    "AttentionOutput",
    "AttentionStep",
    "OwnBatch",
    "PrefixBatch",
    "chain_batch",
    "ensure_checked",
    "implementation",
    "kv_cache_shapes",
    "step_implementation",
    "triton_device",
    "merge_attention_states",
    "own_attention",
    "own_batch",
    "own_batch_arrays",
    "prefix_attention",
    "prefix_batch",
    "prefix_batch_arrays",
    "store_kv",
    "windowed",
]

IMPLEMENTATION_ENV = "LLM_OPERATOR_KERNELS"
_IMPLEMENTATIONS = ("torch", "triton", "cpp")
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


def triton_device(device: torch.device | str) -> bool:
    """Whether ``device``'s tensors go to the Triton kernels unless forced or failed (CUDA):
    where the engine self-checks them (``ensure_checked``; the elementwise regions' kernels:
    ``llm_operator.models.triton_ops.ensure_checked``)."""
    return torch.device(device).type in _TRITON_DEVICE_TYPES


def implementation(tensor: Tensor) -> str:
    """``"torch"`` or ``"triton"``: the one that runs single operations (``store_kv``,
    ``own_attention``, ...) on ``tensor``'s device, in the reference cache layout.

    ``LLM_OPERATOR_KERNELS`` when set (``cpp``, which has no single operations, means the
    reference here); else Triton for CUDA tensors unless the device failed its self-check
    (``ensure_checked``), and the torch reference for the rest.
    """
    forced = _forced()
    if forced:
        return "torch" if forced == "cpp" else forced
    device = tensor.device
    if device.type not in _TRITON_DEVICE_TYPES:
        return "torch"
    if _fallback_devices and (device.type, device.index) in _fallback_devices:
        return "torch"
    return "triton"


def step_implementation(tensor: Tensor) -> str:
    """``"torch"``, ``"triton"`` or ``"cpp"``: the one an ``AttentionStep`` (and the cache
    layout, ``kv_cache_shapes``) uses for tensors like ``tensor``: the compiled CPU kernels
    for fp32/bf16 CPU tensors once ``ensure_checked`` loaded them (or when
    ``LLM_OPERATOR_KERNELS=cpp``), else ``implementation(tensor)``."""
    forced = _forced()
    if forced == "cpp":
        return "cpp"
    if (
        forced is None
        and tensor.device.type == "cpu"
        and tensor.dtype in cpu_ops.CPU_DTYPES
        and cpu_extension.loaded() is not None
    ):
        return "cpp"
    return implementation(tensor)


def kv_cache_shapes(
    implementation: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(k_cache, v_cache) shapes of one layer for ``implementation``: the compiled CPU
    kernels' layout for ``cpp``, ``[num_blocks, block_size, num_kv_heads, head_dim]`` else."""
    if implementation == "cpp":
        return cpu_ops.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape


def ensure_checked(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    windowed: bool = False,
) -> str | None:
    """Self-check the Triton kernels on ``device`` and ``dtype`` once per process; on a
    failure, route every later operation on ``device`` to the torch reference.

    Returns None when the kernels passed (or no check applies), else the failure's reason.
    On the CPU (fp32, bf16; unless ``LLM_OPERATOR_KERNELS`` is ``torch`` or ``triton``) it
    builds or loads and checks the compiled CPU kernels once per process
    (``cpu_extension.load``, which warns on failure; forced ``cpp`` then raises). Else it
    does nothing (None) when ``LLM_OPERATOR_KERNELS`` is set (``triton`` forces the kernels
    unchecked, ``torch`` needs none) or when ``device``'s tensors go to the torch reference
    anyway. Otherwise runs ``self_check.check_triton(device, dtype, ...)`` with the
    model's head shape (and, ``windowed``, the sliding-window kernels a model with
    sliding-window layers launches) the first time a (device, dtype, head shape,
    windowed) is seen, first in a
    child process and then here only if it passed there (``triton_proof``: a crash fails
    the check instead of killing the process; the child's verdict is cached on disk per
    machine kind), and caches its result; a failure warns once (RuntimeWarning: which
    check failed, why, and that the torch path is used) and is never retried. Thread-safe; a check holds the lock while
    it runs (a few milliseconds on a GPU once compiled).
    """
    forced = _forced()
    device = torch.device(device)
    if (
        device.type == "cpu"
        and device.type not in _TRITON_DEVICE_TYPES
        and forced in (None, "cpp")
        and dtype in cpu_ops.CPU_DTYPES
    ):
        if cpu_extension.load() is None and forced == "cpp":
            raise RuntimeError(
                f"{IMPLEMENTATION_ENV}=cpp but the compiled CPU kernels cannot be used: "
                f"{cpu_extension.failure()}"
            )
        return cpu_extension.failure()
    if forced or device.type not in _TRITON_DEVICE_TYPES:
        return None
    device_key = _device_key(device)
    key = (*device_key, dtype, num_heads, num_kv_heads, head_dim, windowed)
    with _check_lock:
        if key in _check_results:
            return _check_results[key]
        from llm_operator.kernels import triton_proof

        reason = triton_proof.proven_check_triton(
            torch.device(*device_key),
            dtype,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            windowed=windowed,
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
        return torch_attention
    try:
        from llm_operator.kernels import triton_attention
    except ImportError as error:  # triton missing, or no GPU and no interpreter
        raise RuntimeError(
            f"the Triton kernels cannot be used ({error}); install triton, or set "
            f"{IMPLEMENTATION_ENV}=torch"
        ) from error
    return triton_attention


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write a step's K/V into the paged cache (see ``torch_attention.store_kv``)."""
    _module(k_cache).store_kv(k_cache, v_cache, k, v, slot_mapping)


def own_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: OwnBatch, scale: float
) -> AttentionOutput:
    """Each request's rows against its own K/V, causal (see ``torch_attention.own_attention``)."""
    return _module(q).own_attention(q, k_cache, v_cache, batch, scale)


def prefix_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: PrefixBatch, scale: float
) -> AttentionOutput:
    """Rows against their shared segments, non-causal (see ``torch_attention.prefix_attention``);
    a ``chain_batch`` (slot lists) runs on the torch path only."""
    module = _module(q)
    if getattr(batch, "slot_tables", None) is not None and module is not torch_attention:
        raise ValueError(
            "a chain_batch (segments as slot lists) runs on the torch path only; build one "
            "prefix_batch per chain level for the Triton kernels"
        )
    return module.prefix_attention(q, k_cache, v_cache, batch, scale)


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Log-sum-exp merge of parts over disjoint keys (see
    ``torch_attention.merge_attention_states``)."""
    first = parts[0][0] if isinstance(parts, Sequence) and parts and len(parts[0]) else None
    if not isinstance(first, Tensor):
        return torch_attention.merge_attention_states(parts)  # raises the argument error
    return _module(first).merge_attention_states(parts)


class AttentionStep:
    """One step's attention, built once and called by every layer.

    ``__call__(q, k, v, k_cache, v_cache, scale)`` stores this step's k, v
    [T, kv_heads, dim] at ``slot_mapping`` and returns each row's attention over its own
    K/V (``own``, causal) and its shared segments (``prefixes``, non-causal), merged by
    log-sum-exp: out [T, heads, dim] in q's dtype. Caches are in ``implementation``'s
    layout (``kv_cache_shapes``). ``prefixes``: one ``prefix_batch`` per chain level, or
    (torch only) one ``chain_batch``.
    """

    def __init__(
        self,
        implementation: str,
        own: OwnBatch,
        prefixes: Sequence[PrefixBatch],
        slot_mapping: Tensor,
        invariant: bool = False,
    ) -> None:
        """invariant: the compiled CPU attention's batch-invariant mode (a row's bits do not
        depend on the step; segments must end on block boundaries). Other implementations
        ignore it."""
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}"
            )
        self.implementation = implementation
        self.own, self.prefixes, self.slot_mapping = own, list(prefixes), slot_mapping
        # attention scores soft-capped (Gemma 2): softcap * tanh(scores / softcap); the
        # torch implementation only
        self.softcap: float | None = None
        self.split_keys = cpu_ops.SPLIT_KEYS
        self.module = None
        if implementation == "cpp":
            self.module = cpu_extension.loaded()
            if self.module is None:
                raise RuntimeError(
                    "the compiled CPU kernels are not loaded (kernels.ensure_checked loads "
                    f"them): {cpu_extension.failure() or 'never loaded'}"
                )
            step_keys = None
            if invariant:
                self.split_keys = cpu_ops.invariant_split_keys(own.block_size, self.prefixes)
                step_keys = cpu_ops.INVARIANT_STEP_KEYS if self.split_keys < 0 else None
            self.work = cpu_ops.attention_items(own, self.prefixes, step_keys)
        elif implementation == "triton":
            from llm_operator.kernels import triton_attention

            self.module = triton_attention
        else:
            self.module = torch_attention

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float
    ) -> Tensor:
        self.store(k, v, k_cache, v_cache)
        return self.attend(q, k_cache, v_cache, scale)

    def store(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Write this step's k, v [T, kv_heads, dim] at ``slot_mapping``."""
        if self.implementation == "cpp":
            cpu_ops.store_kv(self.module, k_cache, v_cache, k, v, self.slot_mapping)
        else:
            self.module.store_kv(k_cache, v_cache, k, v, self.slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
        """Each row's attention over its own K/V and its segments, merged (K/V stored)."""
        if self.softcap is not None and self.implementation != "torch":
            raise ValueError(
                f"soft-capped attention scores run on the torch kernels only, not "
                f"{self.implementation!r}"
            )
        if self.implementation == "cpp":
            return cpu_ops.attention(
                self.module, q, k_cache, v_cache, self.work, scale, self.split_keys
            )
        module, softcap = self.module, self.softcap
        if self.implementation == "triton":  # own part, then each level merged in place
            return module.attend(q, k_cache, v_cache, self.own, self.prefixes, scale)
        parts = [module.own_attention(q, k_cache, v_cache, self.own, scale, softcap)]
        for batch in self.prefixes:
            parts.append(module.prefix_attention(q, k_cache, v_cache, batch, scale, softcap))
        if len(parts) == 1:
            return parts[0].out
        return module.merge_attention_states(parts).out
