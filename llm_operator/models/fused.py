"""The decoder layer's elementwise work as three fused regions, compiled by inductor.

Besides its GEMMs and attention, a layer runs ~35 small ops: RMSNorms, residual adds,
the q/k/v split, Qwen3's q/k norm, RoPE on q and k, SiLU(gate) * up. Eagerly each is a
torch dispatch, which is much of a decode step of a few rows. Here they form three
regions per layer (the linears, ``gemm.linear``, and the attention callback stay eager
between them):

    add_rms_norm   residual add + RMSNorm (the input norm, fed the previous layer's MLP
                   output; the post-attention norm, fed o_proj's output; the final norm)
    qkv_rope       split q/k/v, [per-head q/k RMSNorm,] RoPE on q and k, v contiguous
    silu_mul       SiLU(gate) * up (only for hidden_act "silu"; other activations eager)

The functions below are the reference: Hugging Face's arithmetic, op for op. Each is
compiled ahead of time by AOTInductor (``torch.export``, then inductor's C++ codegen on the
CPU, Triton on CUDA) per (region, dtype, device, shapes but the token count, eps, threads),
with the token count dynamic (1 included), and runs through the package's C++ runner:
~2-8 us a call on a 2-core CPU. (``torch.compile``'s guards and Python wrappers cost ~20 us
a call there, more than the ~2 us dispatches a region saves: decode steps got slower.)
Packages are cached under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``): built
once per machine in ~5 s each, loaded by later processes in milliseconds. Each is proven
in a child process before its first load (``aot_packages``: loaded, run and compared with
its region's eager module; a few seconds once per machine kind, the verdict cached beside
the package), so a package that would crash the process falls back to eager instead.

Numerics: inductor's ``emulate_precision_casts`` keeps every bf16/fp16 rounding eager
makes, so those outputs are bitwise equal but for rare flips of RMSNorm outputs by one or
two ulp (the fp32 sum of squares runs in another order: 5 in a million of SmolLM2's bf16
norm outputs), enough to change some greedy bf16 tokens after a few dozen steps. fp32
outputs agree to a few ulp (same greedy tokens on the doc-qa workload).

On the CPU each region has two builds: one thread (no OpenMP region: small inputs, e.g.
decode steps) and ``torch.get_num_threads()`` threads for inputs of at least
``PARALLEL_MIN_ELEMENTS`` elements (prefill chunks).

``LLM_OPERATOR_COMPILE``: ``auto`` (default: the Triton kernels on CUDA, compiled on the CPU
for fp32 and bf16), ``1``/``on`` (Triton on CUDA, compiled for any other device and dtype),
``0``/``off`` (eager everywhere). On CUDA the regions are Triton kernels, one launch each
(``models/triton_ops.py``, ``kernels/triton_fused.py``), never these packages (loading one
crashed the process there, issue 29); eager where Triton is missing. CPU tensors take the
Triton kernels too when ``LLM_OPERATOR_KERNELS=triton`` and the Triton interpreter runs them
(``TRITON_INTERPRET=1``): how the tests run the CUDA path on a CPU. If compiling, loading or
running a compiled region (or a Triton kernel) raises, every region runs eagerly for the rest
of the process, after one RuntimeWarning naming the error (a failed proof included).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llm_operator.models.aot_packages import PackageCache
from llm_operator.models.rope import apply_rotary

COMPILE_ENV = "LLM_OPERATOR_COMPILE"
_MODES = {"": "auto", "auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}
_AUTO_CPU_DTYPES = (torch.float32, torch.bfloat16)
# CPU inputs with at least this many elements take the multi-threaded build (ATen's grain).
PARALLEL_MIN_ELEMENTS = 1 << 15


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
    class), compiled (``CompiledOps``) or as Triton kernels (``triton_ops.TritonOps``): same
    contract."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, hidden: Tensor, delta: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return add_rms_norm(hidden, delta, weight, eps)

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
        return qkv_rope(
            qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads, head_dim
        )

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return silu_mul(gate_up)


# -- export wrappers: a region with its non-tensor arguments fixed ------------------------
class _AddRmsNorm(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, hidden: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return add_rms_norm(hidden, delta, weight, self.eps)


class _QkvRope(nn.Module):
    def __init__(self, eps: float, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.eps, self.heads = eps, (num_heads, num_kv_heads, head_dim)

    def forward(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return qkv_rope(qkv, cos, sin, None, None, self.eps, *self.heads)


class _QkvNormRope(_QkvRope):
    def forward(  # type: ignore[override]
        self, qkv: Tensor, cos: Tensor, sin: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return qkv_rope(qkv, cos, sin, q_norm_weight, k_norm_weight, self.eps, *self.heads)


class _SiluMul(nn.Module):
    def forward(self, gate_up: Tensor) -> Tensor:
        return silu_mul(gate_up)


class _Fallback:
    """Whether a compiled region failed in this process (then every region runs eagerly)."""

    def __init__(self) -> None:
        self.failed = False
        self._lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        text = str(error).strip()
        first_line = text.splitlines()[0][:300] if text else ""
        warnings.warn(
            f"compiling the native model's fused ops failed ({type(error).__name__}: "
            f"{first_line}); they run eagerly for the rest of the process "
            f"({COMPILE_ENV}=0 skips compiling)",
            RuntimeWarning,
            stacklevel=4,
        )


FALLBACK = _Fallback()
_SOURCES = tuple(
    Path(__file__).parent / name for name in ("fused.py", "rope.py", "aot_packages.py")
)


class CompiledOps(FusedOps):
    """The regions through AOTInductor packages (``PackageCache``), one per key, built or
    loaded on first use; ``packages.log`` says which, and how long it took.

    Contract: each method returns what ``FusedOps``'s returns (up to the rounding in the
    module docstring). Inputs the packages are not built for (non-contiguous, mixed dtypes
    or devices, zero tokens, shapes that disagree, tensors that need gradients) run eagerly. Any exception from
    building, loading or running a package calls ``FALLBACK.fail`` (every region eager
    from then on, one RuntimeWarning) and returns the eager result. Thread-safe.
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.packages = PackageCache(cache_dir, _SOURCES)

    def add_rms_norm(
        self, hidden: Tensor, delta: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        if (
            hidden.dim() == 2
            and hidden.shape == delta.shape
            and weight.shape == hidden.shape[1:]
            and _uniform(hidden, delta, weight)
        ):
            key = ("add_rms_norm", hidden.dtype, hidden.device, hidden.shape[1], eps)
            outputs = self._run(key, [hidden, delta, weight], hidden.numel(), _AddRmsNorm, eps)
            if outputs is not None:
                return outputs[0], outputs[1]
        return add_rms_norm(hidden, delta, weight, eps)

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
        heads = (num_heads, num_kv_heads, head_dim)
        args = [qkv, cos, sin]
        module, norm_eps, fits = _QkvRope, None, True  # without norms: one package for any eps
        if q_norm_weight is not None and k_norm_weight is not None:
            args += (q_norm_weight, k_norm_weight)
            module, norm_eps = _QkvNormRope, eps
            fits = q_norm_weight.shape == k_norm_weight.shape == (head_dim,)
        if (
            fits
            and qkv.dim() == 2
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.shape == sin.shape == (qkv.shape[0], head_dim)
            and _uniform(*args)
        ):
            key = ("qkv_rope", qkv.dtype, qkv.device, heads, norm_eps)
            outputs = self._run(key, args, qkv.numel(), module, eps, *heads)
            if outputs is not None:
                return outputs[0], outputs[1], outputs[2]
        return qkv_rope(qkv, cos, sin, q_norm_weight, k_norm_weight, eps, *heads)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and _uniform(gate_up):
            key = ("silu_mul", gate_up.dtype, gate_up.device, gate_up.shape[1])
            outputs = self._run(key, [gate_up], gate_up.numel(), _SiluMul)
            if outputs is not None:
                return outputs[0]
        return silu_mul(gate_up)

    def _run(
        self, key: tuple, args: list[Tensor], elements: int, module: type[nn.Module], *init: Any
    ) -> list[Tensor] | None:
        """``key``'s package (``module(*init)``) on ``args``, the largest of which has
        ``elements`` elements; None when the caller must run eagerly (after a failure)."""
        if FALLBACK.failed or elements == 0:
            return None
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            return None  # packages record no autograd graph
        threads = 0  # the CPU build: one thread for small inputs, all of them for large ones
        if key[2].type == "cpu":
            threads = torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1
        key = (*key, threads)
        try:
            runner = self.packages.runners.get(key)
            if runner is None:
                reference = (f"{module.__module__}:{module.__qualname__}", init)
                runner = self.packages.build(key, module(*init), args, threads, reference)
            return runner(args)
        except Exception as error:  # noqa: BLE001 - any compiler, loader or runtime failure
            FALLBACK.fail(error)
            return None


def _uniform(first: Tensor, *others: Tensor) -> bool:
    """All contiguous, with ``first``'s dtype and device."""
    dtype, device = first.dtype, first.device
    if not first.is_contiguous():
        return False
    for other in others:
        if other.dtype != dtype or other.device != device or not other.is_contiguous():
            return False
    return True


EAGER_OPS = FusedOps()
COMPILED_OPS = CompiledOps()


def compile_mode() -> str:
    """``LLM_OPERATOR_COMPILE`` as "auto", "on" or "off"; ValueError for another value."""
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value not in _MODES:
        raise ValueError(f"{COMPILE_ENV} must be one of auto, 1, on, 0, off; got {value!r}")
    return _MODES[value]


def fused_ops(device: torch.device, dtype: torch.dtype) -> FusedOps:
    """The regions for a forward on ``device`` in ``dtype``: EAGER_OPS when the mode is off;
    ``triton_ops.TRITON_OPS`` on CUDA (EAGER_OPS without Triton or after a kernel failed),
    and for CPU tensors when ``LLM_OPERATOR_KERNELS=triton`` under the Triton interpreter;
    else COMPILED_OPS unless the mode, the device, the dtype or an earlier failure says
    EAGER_OPS."""
    mode = compile_mode()
    if mode == "off":
        return EAGER_OPS
    forced = os.environ.get("LLM_OPERATOR_KERNELS", "").strip().lower()  # kernels/__init__.py
    if device.type == "cuda" or forced == "triton":
        try:
            from llm_operator.models.triton_ops import triton_ops_for
        except ImportError:  # no Triton: the CPU carries on below, CUDA runs eagerly
            triton_ops_for = None
        triton_ops = None if triton_ops_for is None else triton_ops_for(device)
        if triton_ops is not None:
            return triton_ops
        if device.type == "cuda":  # never the AOT packages there
            return EAGER_OPS
    if FALLBACK.failed:
        return EAGER_OPS
    if mode == "auto" and not (device.type == "cpu" and dtype in _AUTO_CPU_DTYPES):
        return EAGER_OPS
    return COMPILED_OPS
