"""Self-check of the Triton elementwise kernels (``triton_fused``) against their torch
references on one device and dtype, for one model's shapes.

``check_triton_fused(device, dtype, reference, ...)`` runs each launcher on small seeded
cases, a decode step (1 token) and a batch (``BATCH_TOKENS``, more than one program of
rows), and compares with ``reference``'s results on the same device: ``reference`` is an
object with the eager regions' methods (``rms_norm``, ``add_rms_norm``, ``qkv_rope``,
``silu_mul``: ``llm_operator.models.fused.FusedOps``'s contract), or a ``"module:attribute"``
naming one (so a child process can import it; this layer imports nothing above it). It
returns None when every launcher agrees, else one line naming the first that disagreed
(and how) or raised (an import or compile error, a launch failure).

The launches: ``rms_norm`` and ``add_rms_norm`` on rows of ``hidden_size``; ``qkv_rope``
without and with the q/k norm; ``qkv_rope_store`` into a paged cache whose spare slots hold
NaN, one token's slot -1 (skipped); ``silu_mul`` on rows of ``2 * intermediate_size``. Pass
the model's sizes and head shape: they are the kernels' compile-time constants.

Tolerances (``tests/test_triton_fused.py``'s, where ``tests/test_kernels_self_check.py``
asserts they are the same): exact for the residual sum, ``v``, RoPE without the q/k norm
and the cache; fp32 norms and SiLU within ``FP32_ULPS`` ulp, q and k after the q/k norm
within ``QK_NORM_FP32_TOLERANCE``; fp16/bf16 outputs bitwise but for rare flips (at most
``MAX_FLIP_FRACTION`` of an output's elements, each at most ``MAX_FLIP_ULPS`` ulp, same
sign). Under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) a check takes
well under a second at the tiny test models' sizes.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llm_operator.kernels import torch_attention

__all__ = [
    "BATCH_TOKENS",
    "FP32_ULPS",
    "MAX_FLIP_FRACTION",
    "MAX_FLIP_ULPS",
    "QK_NORM_FP32_TOLERANCE",
    "check_arguments",
    "check_triton_fused",
]

FP32_ULPS = 4  # an RMSNorm's fp32 sum order, exp's implementation
MAX_FLIP_ULPS = 2  # one ulp of the normalized value, widened to two by the weight
MAX_FLIP_FRACTION = 0.01
QK_NORM_FP32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}  # RoPE after the norm can cancel
BATCH_TOKENS = 19  # more rows than one program takes (at most 16): a masked second one
_BLOCK_SIZE = 4
_SEED = 20240917
_MAX_REASON = 300
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Outputs without a reduction or a transcendental: the same IEEE ops as eager, bit for bit.
_EXACT = ("sum", "q", "k", "v", "k_cache", "v_cache")


def check_triton_fused(
    device: torch.device | str,
    dtype: torch.dtype,
    reference: Any,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    eps: float = 1e-6,
) -> str | None:
    """None when the Triton elementwise kernels agree with ``reference`` on ``device`` and
    ``dtype`` at these sizes, else one line saying which launcher failed and how.

    device:    where the kernels run ("cuda:N"; CPU tensors need TRITON_INTERPRET=1 set
               before triton is imported, else the reason says so)
    dtype:     float16, bfloat16 or float32
    reference: the eager regions (module docstring), or "module:attribute" naming them
    num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, eps: the model's
    Raises ValueError for a bad dtype or size only: any other exception (triton missing, a
    compile error, a launch error, a reference that cannot be imported) becomes the reason.
    """
    device = torch.device(device)
    check_arguments(
        dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        hidden_size=hidden_size, intermediate_size=intermediate_size,
    )  # fmt: skip
    operation = "import triton_fused"
    try:
        from llm_operator.kernels import triton_fused as kernels

        operation = "import the reference"
        if isinstance(reference, str):
            reference = _resolve(reference)
        operation = "setup"
        heads = (num_heads, num_kv_heads, head_dim)
        cases = [_inputs(tokens, dtype, device, heads, hidden_size, intermediate_size)
                 for tokens in (1, BATCH_TOKENS)]  # fmt: skip
        checks: list[tuple[str, Callable[[dict], list[Tensor]], Callable[[dict], list[Tensor]],
                           list[str]]] = [
            ("rms_norm", lambda x: [kernels.rms_norm(x["hidden"], x["weight"], eps)],
             lambda x: [reference.rms_norm(x["hidden"], x["weight"], eps)], ["normed"]),
            ("add_rms_norm", lambda x: list(kernels.add_rms_norm(*x["add"], eps)),
             lambda x: list(reference.add_rms_norm(*x["add"], eps)), ["sum", "normed"]),
            ("qkv_rope", lambda x: list(kernels.qkv_rope(*x["rope"], None, None, eps, *heads)),
             lambda x: list(reference.qkv_rope(*x["rope"], None, None, eps, *heads)),
             ["q", "k", "v"]),
            ("qkv_rope (q/k norm)",
             lambda x: list(kernels.qkv_rope(*x["rope"], *x["norms"], eps, *heads)),
             lambda x: list(reference.qkv_rope(*x["rope"], *x["norms"], eps, *heads)),
             ["q normed", "k normed", "v"]),
            ("qkv_rope_store", lambda x: _store(kernels.qkv_rope_store, x, eps, heads),
             lambda x: _reference_store(reference, x, eps, heads),
             ["q", "k", "v", "k_cache", "v_cache"]),
            ("silu_mul", lambda x: [kernels.silu_mul(x["gate_up"])],
             lambda x: [reference.silu_mul(x["gate_up"])], ["activated"]),
        ]  # fmt: skip
        for operation, run, expect, names in checks:
            got = [run(case) for case in cases]
            want = [expect(case) for case in cases]
            for index, name in enumerate(names):
                reason = _compare(name, [g[index] for g in got], [w[index] for w in want], dtype)
                if reason:
                    return _clip(f"{operation}: {reason}")
    except Exception as error:  # noqa: BLE001 - every failure is a reason, by contract
        message = " ".join(str(error).split()) or "(no message)"
        return _clip(f"{operation} raised {type(error).__name__}: {message}")
    return None


def check_arguments(dtype: torch.dtype, **sizes: int) -> None:
    """ValueError naming the first bad one: a dtype the kernels do not take, a size that is
    not a positive int, an odd ``head_dim``."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if sizes.get("head_dim", 2) % 2:
        raise ValueError(
            f"head_dim must be even (RoPE rotates two halves), got {sizes['head_dim']}"
        )


def _resolve(reference: str) -> Any:
    """The object ``"module:attribute"`` names."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reference must be 'module:attribute', got {reference!r}")
    return getattr(importlib.import_module(module_name), attribute)


def _inputs(
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    heads: tuple[int, int, int],
    hidden_size: int,
    intermediate_size: int,
) -> dict[str, Any]:
    """Seeded inputs of ``tokens`` rows on ``device`` (as tests/test_triton_fused.py draws)."""
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(_SEED + tokens)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        values = scale * torch.randn(*shape, generator=generator)
        return values.to(dtype).to(device)

    hidden = randn(tokens, hidden_size, scale=3.0)
    weight = randn(hidden_size)
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, scale=2.0)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.3
    angles = torch.cat([angles, angles], dim=-1)  # as RotaryEmbedding builds them
    cos, sin = (t.to(dtype).to(device) for t in (angles.cos(), angles.sin()))
    # The cache: 2 spare blocks past the tokens' slots, NaN; slots shuffled, one -1.
    num_blocks = -(-tokens // _BLOCK_SIZE) + 2
    slots = torch.randperm(num_blocks * _BLOCK_SIZE, generator=generator)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # skipped
    return {
        "hidden": hidden,
        "weight": weight,
        "add": (hidden, randn(tokens, hidden_size), weight),
        "rope": (qkv, cos, sin),
        "norms": (randn(head_dim), randn(head_dim)),
        "cache_shape": (num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim),
        "slots": slots.to(device),
        "gate_up": randn(tokens, 2 * intermediate_size, scale=4.0),
    }


def _caches(x: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Fresh k and v caches of NaN."""
    options = {"dtype": x["hidden"].dtype, "device": x["hidden"].device}
    return (
        torch.full(x["cache_shape"], math.nan, **options),
        torch.full(x["cache_shape"], math.nan, **options),
    )


def _store(launcher: Callable, x: dict[str, Any], eps: float, heads: tuple) -> list[Tensor]:
    """``qkv_rope_store`` (no q/k norm: the engine's Llama case) into fresh NaN caches:
    [q, k, v, k_cache, v_cache]."""
    k_cache, v_cache = _caches(x)
    q, k, v = launcher(*x["rope"], None, None, eps, *heads, k_cache, v_cache, x["slots"])
    return [q, k, v, k_cache, v_cache]


def _reference_store(reference: Any, x: dict[str, Any], eps: float, heads: tuple) -> list[Tensor]:
    """The reference ``qkv_rope``, then the torch reference ``store_kv`` of the rows whose
    slots lie in the cache."""
    q, k, v = reference.qkv_rope(*x["rope"], None, None, eps, *heads)
    k_cache, v_cache = _caches(x)
    kept = x["slots"] >= 0
    torch_attention.store_kv(k_cache, v_cache, k[kept], v[kept], x["slots"][kept])
    return [q, k, v, k_cache, v_cache]


def _compare(name: str, got: list[Tensor], want: list[Tensor], dtype: torch.dtype) -> str | None:
    """None when each of ``got`` (one per case) agrees with ``want`` within the tolerance
    for ``name`` (module docstring), else why."""
    for actual, expected in zip(got, want, strict=True):
        if not isinstance(actual, Tensor):
            return f"{name} is a {type(actual).__name__}, not a tensor"
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return (
                f"{name} is {tuple(actual.shape)} {actual.dtype}, the reference's "
                f"{tuple(expected.shape)} {expected.dtype}"
            )
    actual = torch.cat([g.reshape(-1) for g in got]).cpu()
    expected = torch.cat([w.reshape(-1) for w in want]).cpu()
    if name in _EXACT:
        same = (actual == expected) | (actual.isnan() & expected.isnan())
        if bool(same.all()):
            return None
        return (
            f"{name} differs from the reference's at {int((~same).sum())} of {same.numel()} values"
        )
    if dtype == torch.float32 and name in ("q normed", "k normed"):
        close = torch.isclose(actual, expected, **QK_NORM_FP32_TOLERANCE)
        if bool(close.all()):
            return None
        worst = float((actual - expected).abs().nan_to_num(math.inf).max())
        atol, rtol = QK_NORM_FP32_TOLERANCE["atol"], QK_NORM_FP32_TOLERANCE["rtol"]
        wrong = f"{int((~close).sum())} of {close.numel()} values"
        return f"{name} max error {worst:.3g} (atol {atol:g}, rtol {rtol:g}) at {wrong}"
    return _compare_ulps(name, actual, expected)


def _compare_ulps(name: str, actual: Tensor, expected: Tensor) -> str | None:
    """fp32: within FP32_ULPS ulp; fp16/bf16: rare flips (module docstring)."""
    steps = (_ordered(actual) - _ordered(expected)).abs()
    if actual.dtype == torch.float32:
        worst = int(steps.max()) if steps.numel() else 0
        return None if worst <= FP32_ULPS else f"{name} is {worst} ulp off (at most {FP32_ULPS})"
    flipped = actual != expected
    if not bool(flipped.any()):
        return None
    worst = int(steps[flipped].max())
    same_sign = bool((actual[flipped].float() * expected[flipped].float() > 0).all())
    if worst > MAX_FLIP_ULPS or not same_sign:
        return f"{name} is {worst} ulp off at {int(flipped.sum())} of {flipped.numel()} values"
    if int(flipped.sum()) > MAX_FLIP_FRACTION * flipped.numel():
        return (
            f"{name} differs from the reference's at {int(flipped.sum())} of {flipped.numel()} "
            f"values (at most {MAX_FLIP_FRACTION:.0%}, each at most {MAX_FLIP_ULPS} ulp)"
        )
    return None


def _ordered(x: Tensor) -> Tensor:
    """Float bits as integers that step by one between adjacent values of x's dtype."""
    bits = x.view({4: torch.int32, 2: torch.int16}[x.element_size()]).long()
    sign = {4: 1 << 31, 2: 1 << 15}[x.element_size()]
    return torch.where(bits < 0, -(bits + sign), bits)


def _clip(reason: str) -> str:
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."
