"""The decoder layer's elementwise regions as Triton kernels: the CUDA path of ``fused``.

``TritonOps`` runs each region of ``fused.FusedOps`` (and the first layer's input norm,
``rms_norm``) as one launch of ``llm_operator.kernels.triton_fused``: four launches a
layer (add + RMSNorm twice, QKV split + q/k norm + RoPE, SiLU * up) and one for the first
layer's norm, where eager dispatches 30 to 50 ops a layer. The numerics are eager's
roundings (``triton_fused``'s docstring): bitwise but for rare one- or two-ulp flips of an
RMSNorm or SiLU output in bf16/fp16, a few ulp in fp32.

``qkv_rope_store`` also writes the step's k and v into the paged KV cache in the same
launch (``triton_attention.store_kv``'s layout); a caller that uses it must skip the
attention's own store (the engine does not call it yet).

``fused.fused_ops`` hands ``TRITON_OPS`` to CUDA tensors (and to CPU tensors when
``LLM_OPERATOR_KERNELS=triton`` and the Triton interpreter runs the kernels: the tests'
way to run the CUDA path on a CPU); ``triton_ops_for`` says whether a device qualifies.

Self-check. The native engine calls ``ensure_checked(device, dtype, config)`` when it
starts: on CUDA (``kernels.triton_device``), unless ``LLM_OPERATOR_COMPILE=off`` (no
kernels) or ``LLM_OPERATOR_KERNELS=triton`` (the kernels forced, unchecked), it runs
``kernels.self_check_fused`` once per (device, dtype, model sizes) with ``REFERENCE``
(``fused.EAGER_OPS``), first in a child process
(``kernels.triton_proof.proven_check_triton_fused``: a crash fails the check instead of
killing the process; the verdict is cached on disk per machine kind). A failure warns once
(RuntimeWarning) and the regions on that device run eagerly for the rest of the process;
the attention kernels keep their own check and fallback (``kernels.ensure_checked``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llm_operator import kernels
from llm_operator.kernels import IMPLEMENTATION_ENV, torch_attention, triton_fused, triton_proof
from llm_operator.models import fused
from llm_operator.models.fused import FusedOps

# The eager regions the self-check compares with, and the sources they come from.
REFERENCE = "llm_operator.models.fused:EAGER_OPS"
_REFERENCE_SOURCES = ("fused.py", "rope.py")


class TritonOps(FusedOps):
    """The regions through the Triton kernels; same contract as ``FusedOps``.

    Each method returns what ``FusedOps``'s returns (up to the rounding in
    ``triton_fused``'s docstring), in new contiguous tensors. Inputs the kernels do not
    take run the eager reference instead: non-contiguous or mixed dtypes or devices,
    shapes that disagree, zero tokens, tensors that need gradients, sizes past the
    kernels' limits, CPU tensors unless the Triton interpreter runs the kernels. If a
    kernel raises (e.g. Triton cannot compile it on this machine), one RuntimeWarning
    names the error and every region runs eagerly for the rest of the process
    (``failed``). A device that failed the self-check (``ensure_checked``) runs every
    region eagerly (``failed_on``). Thread-safe.
    """

    def __init__(self) -> None:
        self.failed = False
        self._lock = threading.Lock()
        # Self-check results by (device type, index, dtype, sizes), None = passed, and the
        # (device type, index) pairs whose regions run eagerly since a check failed there.
        self._checks: dict[tuple, str | None] = {}
        self._failed_devices: set[tuple[str, int | None]] = set()

    def failed_on(self, device: torch.device) -> bool:
        """Whether ``device`` failed a self-check (its regions run eagerly)."""
        return bool(self._failed_devices) and _device_key(device) in self._failed_devices

    def ensure_checked(
        self,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
        intermediate_size: int,
        eps: float = 1e-6,
    ) -> str | None:
        """Self-check the kernels on ``device`` for these sizes once per process (module
        docstring): None when they passed or no check applies, else the failure's reason,
        after one RuntimeWarning, with ``device``'s regions eager from then on."""
        device = torch.device(device)
        if not kernels.triton_device(device) or fused.compile_mode() == "off":
            return None
        if os.environ.get(IMPLEMENTATION_ENV, "").strip().lower() == "triton":
            return None  # forced: unchecked, as the attention kernels
        device_key = _device_key(device)
        sizes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "hidden_size": hidden_size, "intermediate_size": intermediate_size}  # fmt: skip
        key = (*device_key, dtype, *sizes.values())
        with self._lock:
            if key in self._checks:
                return self._checks[key]
        reason = triton_proof.proven_check_triton_fused(
            torch.device(*device_key), dtype, REFERENCE, eps=eps, identity=_reference_digest(),
            **sizes,
        )  # fmt: skip
        with self._lock:
            if key in self._checks:  # another thread checked meanwhile (and warned)
                return self._checks[key]
            self._checks[key] = reason
            if reason is not None:
                self._failed_devices.add(device_key)
        if reason is not None:
            where = torch.device(*device_key)
            warnings.warn(
                f"llm_operator: the native model's Triton elementwise kernels failed their "
                f"self-check on {where} ({str(dtype).removeprefix('torch.')}): {reason}. The "
                f"elementwise regions on {where} run eagerly instead (correct, slower); set "
                f"{IMPLEMENTATION_ENV}=triton to force the kernels anyway.",
                RuntimeWarning,
                stacklevel=3,
            )
        return reason

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() == 2 and weight.shape == x.shape[1:] and self._runs(x, weight):
            if x.shape[1] <= triton_fused.MAX_ROW_SIZE:
                return self._call(triton_fused.rms_norm, fused.rms_norm, x, weight, eps)
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
            args = (hidden, delta, weight, eps)
            return self._call(triton_fused.add_rms_norm, fused.add_rms_norm, *args)
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
            return self._call(triton_fused.qkv_rope, fused.qkv_rope, *args, head_dim)
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
            return self._call(
                triton_fused.qkv_rope_store, _eager_rope_store, *args, head_dim, *cache
            )
        return _eager_rope_store(*args, head_dim, *cache)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and self._runs(gate_up):
            return self._call(triton_fused.silu_mul, fused.silu_mul, gate_up)
        return fused.silu_mul(gate_up)

    # -- when the kernels run ----------------------------------------------------------
    def _rope_runs(
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
        device the kernels run on, ``first`` with tokens, no autograd, no earlier failure."""
        if self.failed or first.numel() == 0 or first.dtype not in _KERNEL_DTYPES:
            return False
        if not _same_place(first, *others) or not all(t.is_contiguous() for t in (first, *others)):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in (first, *others)):
            return False  # the kernels record no autograd graph
        return _kernel_device(first.device) and not self.failed_on(first.device)

    def _call(self, kernel: Callable[..., Any], reference: Callable[..., Any], *args: Any) -> Any:
        """``kernel(*args)``; on any exception, ``fail`` and ``reference(*args)``."""
        try:
            return kernel(*args)
        except Exception as error:  # noqa: BLE001 - a compile or launch failure of Triton
            self.fail(error)
            return reference(*args)

    def fail(self, error: BaseException) -> None:
        """Every region eager from now on, after one RuntimeWarning naming ``error``."""
        with self._lock:
            if self.failed:
                return
            self.failed = True
        text = str(error).strip()
        first_line = text.splitlines()[0][:300] if text else ""
        warnings.warn(
            f"the native model's Triton elementwise kernels failed ({type(error).__name__}: "
            f"{first_line}); they run eagerly for the rest of the process",
            RuntimeWarning,
            stacklevel=4,
        )


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _same_place(first: Tensor, *others: Tensor) -> bool:
    return all(t.dtype == first.dtype and t.device == first.device for t in others)


def _kernel_device(device: torch.device) -> bool:
    """CUDA, or the CPU when the Triton interpreter runs the kernels."""
    return device.type == "cuda" or (device.type == "cpu" and triton_fused.interpreted())


def _device_key(device: torch.device) -> tuple[str, int | None]:
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return device.type, index


def _reference_digest() -> str:
    """The reference's sources, which the self-check's outcome depends on."""
    digest = hashlib.sha256()
    for name in _REFERENCE_SOURCES:
        digest.update(Path(fused.__file__).with_name(name).read_bytes())
    return f"reference sources {digest.hexdigest()}"


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


def ensure_checked(device: torch.device | str, dtype: torch.dtype, config: Any) -> str | None:
    """``TRITON_OPS.ensure_checked`` with the sizes of ``config`` (a ``llama.NativeConfig``:
    heads, hidden and intermediate sizes, ``rms_norm_eps``)."""
    return TRITON_OPS.ensure_checked(
        device, dtype, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, eps=config.rms_norm_eps,
    )  # fmt: skip


def triton_ops_for(device: torch.device) -> TritonOps | None:
    """``TRITON_OPS`` for a forward on ``device`` (``fused.fused_ops`` asks): CUDA, or the CPU
    when ``LLM_OPERATOR_KERNELS=triton`` and the Triton interpreter runs the kernels; None
    for other devices, once the kernels failed in this process and on a device that
    failed their self-check (``ensure_checked``)."""
    if TRITON_OPS.failed or TRITON_OPS.failed_on(device):
        return None
    if device.type == "cuda":
        return TRITON_OPS
    forced = os.environ.get(IMPLEMENTATION_ENV, "").strip().lower() == "triton"
    if device.type == "cpu" and forced and triton_fused.interpreted():
        return TRITON_OPS
    return None
