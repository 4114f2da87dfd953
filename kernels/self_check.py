"""Self-checks of the Triton kernel families against their torch references on one device
and dtype, run once per process, in process, at engine start-up (``engine.factory``).

``check_triton`` runs the attention kernels (``triton_attention``) on one mixed engine step
and compares with ``torch_attention`` computed on the CPU (the kernel tests' oracle). The
step (block_size 16, blocks shuffled, spare blocks NaN so a stray read shows)::

    request 0: 5 own tokens, 1 decode row          reads level 1 and level-2 segment A
    request 1: 24 own tokens, 8 rows of a chunk    reads level 1
    request 2: P own tokens, P rows of a prefill   reads level-2 segment B
    level 1:   one segment of LEVEL1_LENGTH tokens
    level 2:   segment A of 7 tokens, segment B of 20

P rows fill one tile of the largest tile configuration for the dtype and head shape, so
``own_attention`` runs on all rows (largest tile) and on each request's last row (decode,
smallest tile); ``prefix_attention`` on level 1 (small tile; on a GPU its keys split) and
level 2 (largest tile). ``store_kv`` writes requests 0 and 1's new tokens into a cache that
holds the rest; ``merge_attention_states`` merges the reference's three parts. ``windowed``
also runs the step under a sliding window of ``WINDOW`` keys (every row kept in its
segments: segment B wholly missed by later rows, out 0, lse -inf): both levels and own.

``check_triton_fused`` runs the elementwise kernels (``triton_fused``) on a decode step (1
token) and a batch (``BATCH_TOKENS``: a masked second program) and compares with
``reference`` on the same device: the eager regions (``models.fused.FusedOps``'s contract;
this layer imports nothing above it). ``qkv_rope`` runs without and with the q/k norm,
``qkv_rope_store`` into a NaN cache, one token's slot -1 (skipped).

Tolerances, the kernel tests': attention ``OUT_TOLERANCE`` / ``LSE_TOLERANCE``; exact for
caches, the residual sum, ``v`` and RoPE without the q/k norm; fp32 norms and SiLU within
``FP32_ULPS`` ulp, q and k after the q/k norm within ``QK_NORM_FP32_TOLERANCE``; fp16/bf16
norms and SiLU bitwise but for rare flips (at most ``MAX_FLIP_FRACTION`` of the values,
each at most ``MAX_FLIP_ULPS`` ulp, same sign).
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llm_operator.kernels import layout, torch_attention

__all__ = ["check_triton", "check_triton_fused"]

# The kernel tests' tolerances (tests/test_kernels_torch.py, tests/test_triton_fused.py);
# tests/test_kernels_self_check.py asserts these copies equal them.
OUT_TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
LSE_TOLERANCE: dict[str, float] = {"atol": 2e-5, "rtol": 1e-5}
FP32_ULPS = 4  # an RMSNorm's fp32 sum order, exp's implementation
MAX_FLIP_ULPS = 2  # one ulp of the normalized value, widened to two by the weight
MAX_FLIP_FRACTION = 0.01
QK_NORM_FP32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}  # RoPE after the norm can cancel
EXACT, ULPS = "exact", "ulps"  # the other tolerances: equal (NaN where NaN), or in ulps

# Long enough for two key splits of 256 keys when decode rows leave a GPU mostly idle.
LEVEL1_LENGTH = 520
_LEVEL2_LENGTHS = (7, 20)
# Shorter than request 1's own tokens, level 1 and segment B: each partly seen.
WINDOW = 20
BATCH_TOKENS = 19  # more rows than one fused program takes (at most 16): a masked second one
_SEED = 20240917
_MAX_REASON = 300

# A check: (operation, call(ops, inputs) -> its outputs, {output name: tolerance}); the
# kernels' module and the reference each run ``call`` on their own inputs.
_Check = tuple[str, Callable[[Any, dict], Any], dict[str, Any]]


def check_triton(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    windowed: bool = False,
) -> str | None:
    """None when the Triton attention kernels agree with the torch reference on ``device``
    ("cuda:N"; CPU tensors need TRITON_INTERPRET=1) and ``dtype`` for this head shape (and,
    ``windowed``, under a sliding window), else one line saying which operation failed and
    how. Raises ValueError for a bad dtype or head shape only."""
    _check_arguments(dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    heads, group = (num_heads, num_kv_heads, head_dim), num_heads // num_kv_heads
    scale = head_dim**-0.5
    pair = {"out": OUT_TOLERANCE[dtype], "lse": LSE_TOLERANCE}

    def attend(operation: str, batch: str, q: str = "q") -> Callable[[Any, dict], Any]:
        return lambda ops, x: getattr(ops, operation)(x[q], *x["cache"], x[batch], scale)

    checks: list[_Check] = [
        ("store_kv", _store_kv, {"k_cache": EXACT, "v_cache": EXACT}),
        ("prefix_attention (level 1)", attend("prefix_attention", "level 1"), pair),
        ("prefix_attention (level 2)", attend("prefix_attention", "level 2"), pair),
        ("own_attention", attend("own_attention", "own"), pair),
        ("own_attention (decode)", attend("own_attention", "decode", "decode_q"), pair),
        ("merge_attention_states", lambda ops, x: ops.merge_attention_states(x["parts"]), pair),
    ]
    if windowed:
        window = f"window {WINDOW}"
        checks += [
            (f"prefix_attention (level 1, {window})", attend("prefix_attention", "w1"), pair),
            (f"prefix_attention (level 2, {window})", attend("prefix_attention", "w2"), pair),
            (f"own_attention ({window})", attend("own_attention", "w own"), pair),
        ]

    def cases(kernels: Any) -> list[tuple[dict, dict]]:
        prefill_rows = kernels.tile_config(dtype, head_dim, 1 << 16, group)[0] // group
        return [_attention_inputs(device, dtype, heads, prefill_rows, windowed)]

    return _first_failure("triton_attention", torch_attention, cases, checks)


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
    """None when the Triton elementwise kernels agree with ``reference`` (the eager regions)
    on ``device`` and ``dtype`` at the model's sizes, else one line saying which launcher
    failed and how. Raises ValueError for a bad dtype or size only."""
    sizes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
             "hidden_size": hidden_size, "intermediate_size": intermediate_size}  # fmt: skip
    _check_arguments(dtype, **sizes)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates two halves), got {head_dim}")
    heads = (num_heads, num_kv_heads, head_dim)
    qk_normed = QK_NORM_FP32_TOLERANCE if dtype == torch.float32 else ULPS

    def rope(ops: Any, x: dict, norms: tuple) -> tuple[Tensor, Tensor, Tensor]:
        return ops.qkv_rope(*x["rope"], *norms, eps, *heads)

    def store(ops: Any, x: dict) -> tuple[Tensor, ...]:
        """``qkv_rope_store`` (no q/k norm) into fresh NaN caches; the reference: its
        ``qkv_rope``, then ``torch_attention.store_kv`` of the rows with a slot."""
        slots = x["slots"]
        caches = [torch.full(x["cache_shape"], math.nan, dtype=dtype, device=slots.device)
                  for _ in range(2)]  # fmt: skip
        if ops is reference:
            q, k, v = rope(ops, x, (None, None))
            torch_attention.store_kv(*caches, k[slots >= 0], v[slots >= 0], slots[slots >= 0])
        else:
            q, k, v = ops.qkv_rope_store(*x["rope"], None, None, eps, *heads, *caches, slots)
        return q, k, v, *caches

    checks: list[_Check] = [
        ("rms_norm", lambda ops, x: ops.rms_norm(x["hidden"], x["weight"], eps), {"normed": ULPS}),
        ("add_rms_norm", lambda ops, x: ops.add_rms_norm(*x["add"], eps),
         {"sum": EXACT, "normed": ULPS}),
        ("qkv_rope", lambda ops, x: rope(ops, x, (None, None)), dict.fromkeys("qkv", EXACT)),
        ("qkv_rope (q/k norm)", lambda ops, x: rope(ops, x, x["norms"]),
         {"q normed": qk_normed, "k normed": qk_normed, "v": EXACT}),
        ("qkv_rope_store", store, dict.fromkeys(("q", "k", "v", "k_cache", "v_cache"), EXACT)),
        ("silu_mul", lambda ops, x: ops.silu_mul(x["gate_up"]), {"activated": ULPS}),
    ]  # fmt: skip

    def cases(kernels: Any) -> list[tuple[dict, dict]]:
        inputs = [_fused_inputs(n, dtype, torch.device(device), sizes) for n in (1, BATCH_TOKENS)]
        return [(x, x) for x in inputs]

    return _first_failure("triton_fused", reference, cases, checks)


def _check_arguments(dtype: torch.dtype, **sizes: int) -> None:
    """ValueError naming the first bad one: a dtype the kernels do not take, a size that is
    not a positive int."""
    if dtype not in OUT_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(map(str, OUT_TOLERANCE))}, got {dtype}")
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def _first_failure(
    module: str, reference: Any, cases: Callable[[Any], list], checks: list[_Check]
) -> str | None:
    """Import ``llm_operator.kernels.<module>``, build the cases (pairs of the kernels' and
    the reference's inputs), and run each check on every case with both: None when all
    agree, else the first mismatch or exception, as one line."""
    operation = f"import {module}"
    try:
        kernels = importlib.import_module(f"llm_operator.kernels.{module}")
        operation = "setup"
        pairs = cases(kernels)
        for operation, call, tolerances in checks:
            got = [call(kernels, inputs) for inputs, _ in pairs]
            want = [call(reference, inputs) for _, inputs in pairs]
            reason = _compare(got, want, tolerances)
            if reason:
                return _clip(f"{operation}: {reason}")
    except Exception as error:  # noqa: BLE001 - every failure is a reason, by contract
        message = " ".join(str(error).split()) or "(no message)"
        return _clip(f"{operation} raised {type(error).__name__}: {message}")
    return None


def _attention_inputs(
    device: torch.device | str,
    dtype: torch.dtype,
    heads: tuple[int, int, int],
    prefill_rows: int,
    windowed: bool,
) -> tuple[dict, dict]:
    """The seeded step (module docstring) as (the kernels' inputs on ``device``, the
    reference's on the CPU): q, the caches before and after the store, the store's tokens,
    the batches by name and the reference's parts for the merge."""
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(_SEED)
    prefill_rows, block_size = max(1, prefill_rows), 16
    requests = [(5, 1), (24, 8), (prefill_rows, prefill_rows)]  # (own tokens, rows)
    # Token runs in the cache: segments, then requests; (length, tokens store_kv writes).
    runs = [(LEVEL1_LENGTH, 0)] + [(n, 0) for n in _LEVEL2_LENGTHS]
    runs += [(5, 1), (24, 8), (prefill_rows, 0)]
    blocks_per = [-(-length // block_size) for length, _ in runs]
    num_blocks = sum(blocks_per) + 2  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=generator).tolist()
    ends = itertools.accumulate(blocks_per)
    owned = [order[end - count : end] for count, end in zip(blocks_per, ends)]
    slots, is_new = [], []
    for blocks, (length, new) in zip(owned, runs):
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        is_new += [p >= length - new for p in range(length)]
    slots, new = torch.tensor(slots, dtype=torch.int64), torch.tensor(is_new)
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    old_cache = [torch.full(cache_shape, math.nan, dtype=dtype) for _ in range(2)]
    torch_attention.store_kv(*old_cache, k[~new], v[~new], slots[~new])
    cache = [c.clone() for c in old_cache]
    torch_attention.store_kv(*cache, k[new], v[new], slots[new])

    starts = [0, *itertools.accumulate(count for _, count in requests)]
    q = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(dtype)
    # each row's position in its sequence (its segments' tokens, then its own)
    prefixes = [LEVEL1_LENGTH + _LEVEL2_LENGTHS[0], LEVEL1_LENGTH, _LEVEL2_LENGTHS[1]]
    positions = [prefix + own - count + j
                 for prefix, (own, count) in zip(prefixes, requests) for j in range(count)]  # fmt: skip
    own_tables, own_lengths = owned[3:], [n for n, _ in requests]
    rows = [list(range(start, end)) for start, end in zip(starts, starts[1:])]
    levels = {
        "level 1": ([rows[0] + rows[1]], owned[:1], [LEVEL1_LENGTH]),
        "level 2": ([rows[0], rows[2]], owned[1:3], list(_LEVEL2_LENGTHS)),
    }

    def inputs(on: torch.device | str, parts: list | None) -> dict:
        shape = {"block_size": block_size, "num_blocks": num_blocks, "device": on}
        decode = list(range(len(requests) + 1))  # each request's last row alone
        x = {
            "q": q.to(on),
            "decode_q": q[[end - 1 for end in starts[1:]]].to(on),
            "old_cache": [c.to(on) for c in old_cache],
            "new": [t[new].to(on) for t in (k, v, slots)],
            "cache": [c.to(on) for c in cache],
            "own": layout.own_batch(starts, own_tables, own_lengths, **shape),
            "decode": layout.own_batch(decode, own_tables, own_lengths, **shape),
        }
        for name, level in levels.items():
            x[name] = layout.prefix_batch(*level, num_rows=starts[-1], **shape)
        if windowed:  # segment A follows level 1, B starts a sequence
            batches = (x["own"], [x["level 1"], x["level 2"]])
            starts_of = [[0], [LEVEL1_LENGTH, 0]]
            x["w own"], (x["w1"], x["w2"]) = layout.windowed(
                *batches, positions, starts_of, WINDOW, drop=False
            )
        if parts is None:  # the reference's, on the CPU (its fp32 matmuls, whatever the GPU's)
            scale = head_dim**-0.5
            parts = [torch_attention.prefix_attention(x["q"], *x["cache"], x[name], scale)
                     for name in levels]  # fmt: skip
            parts.append(torch_attention.own_attention(x["q"], *x["cache"], x["own"], scale))
        x["parts"] = [(out.to(on), lse.to(on)) for out, lse in parts]
        return x

    on_cpu = inputs("cpu", None)
    return inputs(device, on_cpu["parts"]), on_cpu


def _store_kv(ops: Any, x: dict) -> tuple[Tensor, Tensor]:
    """``store_kv`` of the step's new tokens into a copy of the cache that lacks them."""
    k_cache, v_cache = (c.clone() for c in x["old_cache"])
    ops.store_kv(k_cache, v_cache, *x["new"])
    return k_cache, v_cache


def _fused_inputs(tokens: int, dtype: torch.dtype, device: torch.device, sizes: dict) -> dict:
    """Seeded inputs of ``tokens`` rows on ``device`` (as tests/test_triton_fused.py draws)."""
    head_dim, num_kv_heads = sizes["head_dim"], sizes["num_kv_heads"]
    generator = torch.Generator().manual_seed(_SEED + tokens)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype).to(device)

    hidden = randn(tokens, sizes["hidden_size"], scale=3.0)
    weight = randn(sizes["hidden_size"])
    qkv = randn(tokens, (sizes["num_heads"] + 2 * num_kv_heads) * head_dim, scale=2.0)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.3
    angles = torch.cat([angles, angles], dim=-1)  # as RotaryEmbedding builds them
    cos, sin = (t.to(dtype).to(device) for t in (angles.cos(), angles.sin()))
    # The cache: 2 spare blocks of 4 past the tokens' slots; slots shuffled, one -1 (skipped).
    num_blocks = -(-tokens // 4) + 2
    slots = torch.randperm(num_blocks * 4, generator=generator)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    return {
        "hidden": hidden,
        "weight": weight,
        "add": (hidden, randn(tokens, sizes["hidden_size"]), weight),
        "rope": (qkv, cos, sin),
        "norms": (randn(head_dim), randn(head_dim)),
        "cache_shape": (num_blocks, 4, num_kv_heads, head_dim),
        "slots": slots.to(device),
        "gate_up": randn(tokens, 2 * sizes["intermediate_size"], scale=4.0),
    }


def _compare(got: list, want: list, tolerances: dict[str, Any]) -> str | None:
    """None when each output of the results ``got`` (one per case) agrees with ``want``'s
    within its tolerance: EXACT (equal, NaN where NaN), ULPS (``_compare_ulps``) or
    atol + rtol * |expected| (infinities equal); else why."""
    names = list(tolerances)
    if len(names) == 1:
        got, want = [[g] for g in got], [[w] for w in want]
    for result in got:
        if not isinstance(result, tuple | list) or len(result) != len(names):
            return f"returned {type(result).__name__}, not ({', '.join(names)})"
    for index, (name, tolerance) in enumerate(tolerances.items()):
        for actual, expected in ((g[index], w[index]) for g, w in zip(got, want)):
            if not isinstance(actual, Tensor):
                return f"{name} is a {type(actual).__name__}, not a tensor"
            if actual.shape != expected.shape or actual.dtype != expected.dtype:
                return (
                    f"{name} is {tuple(actual.shape)} {actual.dtype}, the reference's "
                    f"{tuple(expected.shape)} {expected.dtype}"
                )
        actual = torch.cat([g[index].reshape(-1) for g in got]).cpu()
        expected = torch.cat([w[index].reshape(-1) for w in want]).cpu()
        if tolerance == EXACT:
            wrong = ~((actual == expected) | (actual.isnan() & expected.isnan()))
            reason = _differs(name, wrong) if bool(wrong.any()) else None
        elif tolerance == ULPS:
            reason = _compare_ulps(name, actual, expected)
        else:
            reason = _compare_close(name, actual.double(), expected.double(), tolerance)
        if reason:
            return reason
    return None


def _compare_close(name: str, actual: Tensor, expected: Tensor, tolerance: dict) -> str | None:
    """None when ``actual`` is within atol + rtol * |expected| (infinities equal), else why."""
    close = torch.isclose(actual, expected, **tolerance)
    if bool(close.all()):
        return None
    error = torch.where(actual == expected, 0.0, (actual - expected).abs())
    worst = math.nan if bool(error.isnan().any()) else float(error.max())
    atol, rtol = tolerance["atol"], tolerance["rtol"]
    wrong = f"{int((~close).sum())} of {close.numel()} values"
    return f"{name} max error {worst:.3g} (atol {atol:g}, rtol {rtol:g}) at {wrong}"


def _compare_ulps(name: str, actual: Tensor, expected: Tensor) -> str | None:
    """fp32: within FP32_ULPS ulp; fp16/bf16: bitwise but for rare flips (module docstring)."""
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
        limit = f"at most {MAX_FLIP_FRACTION:.0%}, each at most {MAX_FLIP_ULPS} ulp"
        return f"{_differs(name, flipped)} ({limit})"
    return None


def _differs(name: str, wrong: Tensor) -> str:
    return f"{name} differs from the reference's at {int(wrong.sum())} of {wrong.numel()} values"


def _ordered(x: Tensor) -> Tensor:
    """Float bits as integers that step by one between adjacent values of x's dtype."""
    bits = x.view({4: torch.int32, 2: torch.int16}[x.element_size()]).long()
    sign = {4: 1 << 31, 2: 1 << 15}[x.element_size()]
    return torch.where(bits < 0, -(bits + sign), bits)


def _clip(reason: str) -> str:
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."
