"""Self-check of the Triton kernels against the torch reference on one device and dtype.

``check_triton(device, dtype)`` runs each Triton operation on a small, seeded case (one
mixed engine step) and compares it with ``torch_attention.py`` computed on the CPU, the
oracle the kernel tests use. It returns None when every operation agrees within
``OUT_TOLERANCE`` / ``LSE_TOLERANCE`` (exact for ``store_kv``), else a one-line reason
naming the first operation that disagreed (and by how much) or raised (an import or
compile error, a launch failure).

The case (block_size 16, blocks shuffled, spare blocks NaN so a stray read shows)::

    request 0: 5 own tokens, 1 decode row          reads level 1 and level-2 segment A
    request 1: 24 own tokens, 8 rows of a chunk    reads level 1
    request 2: P own tokens, P rows of a prefill   reads level-2 segment B
    level 1:   one segment of LEVEL1_LENGTH tokens
    level 2:   segment A of 7 tokens, segment B of 20

P rows fill one row tile of the largest tile configuration for the dtype and head shape
(the prefill configuration), so the launches cover both ends: ``own_attention`` on all
rows (largest tile) and on each request's last row alone (a decode step, smallest tile);
``prefix_attention`` on level 1 (small tile; on a GPU, decode rows on a long segment
split its keys and run the combine kernel) and level 2 (largest tile).
``store_kv`` writes the new tokens of requests 0 and 1 into a cache that holds the rest
(its launch configuration depends on the head shape only), and
``merge_attention_states`` merges the reference's three parts, so a merge error is not
blamed on the attention before it. Pass the model's head shape to check the kernel
specializations the model will launch.

``windowed=True`` (a model with sliding-window layers) also checks the sliding-window
kernel: the same step under a window of ``WINDOW`` keys (``layout.windowed``, every row
kept in its segments): ``own_attention`` (rows masked before their window) and
``prefix_attention`` on level 1 (the rows see its last keys only: the key tiles before
them are skipped) and level 2 (segment B partly seen, wholly missed by its later rows:
out 0, lse -inf). Three launches more.

Cost: tiny shapes, a dozen launches and a CPU oracle; the first run in a fresh Triton
cache also compiles the kernels (most of which the model's first steps would compile
anyway). Under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) it takes a
fraction of a second.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from llm_operator.kernels import layout, torch_attention

__all__ = ["LEVEL1_LENGTH", "LSE_TOLERANCE", "OUT_TOLERANCE", "WINDOW", "check_triton"]

# The Triton tests' tolerances (same inputs, fp32 inside, outputs rounded to the dtype),
# defined in tests/test_kernels_torch.py; tests/test_kernels_self_check.py asserts
# these copies equal them. On a GPU, fp16/bf16 inputs also round the softmax weights for
# the tensor cores, which should stay well inside these bounds on this small case.
OUT_TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
LSE_TOLERANCE: dict[str, float] = {"atol": 2e-5, "rtol": 1e-5}

# Long enough for two key splits of 256 keys when decode rows leave a GPU mostly idle
# (the interpreter never splits).
LEVEL1_LENGTH = 520
_LEVEL2_LENGTHS = (7, 20)
# The sliding window of ``windowed=True``: shorter than request 1's own tokens (its rows
# are masked), level 1 and segment B (each partly seen; B wholly missed by later rows).
WINDOW = 20
_BLOCK_SIZE = 16
_SEED = 20240917
_MAX_REASON = 300


def check_triton(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    windowed: bool = False,
) -> str | None:
    """None when the Triton kernels agree with the torch reference on ``device`` and
    ``dtype``, else one line saying which operation failed and how.

    device:    where the kernels run ("cuda:N"; CPU tensors need TRITON_INTERPRET=1 set
               before triton is imported, else the reason says so)
    dtype:     float16, bfloat16 or float32 (q and the cache)
    num_heads, num_kv_heads, head_dim: the attention shape to check with (num_heads a
               multiple of num_kv_heads)
    windowed:  also check the sliding-window kernel (three more launches)
    Raises ValueError for a bad dtype or head shape only: any other exception (triton
    missing, a compile error, a launch error) becomes the reason. Leaves no state behind
    but Triton's caches.
    """
    device = torch.device(device)
    if dtype not in OUT_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(map(str, OUT_TOLERANCE))}, got {dtype}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    operation = "import triton_attention"
    try:
        from llm_operator.kernels import triton_attention as kernels

        operation = "setup"
        group = num_heads // num_kv_heads
        probe = torch.empty((0, num_heads, head_dim), dtype=dtype)
        largest_tile = kernels._tile_config(probe, 1 << 16, group)[0]
        case = _Case(device, dtype, num_heads, num_kv_heads, head_dim, largest_tile // group)

        operation = "store_kv"
        k_cache, v_cache = case.device_caches()
        kernels.store_kv(k_cache, v_cache, case.new_k, case.new_v, case.new_slots)
        reason = _compare_cache("k_cache", k_cache, case.expected_k_cache) or _compare_cache(
            "v_cache", v_cache, case.expected_v_cache
        )
        if reason:
            return f"store_kv: {reason}"

        expected = case.expected()
        parts = [(out.to(device), lse.to(device)) for out, lse in (*expected.prefix, expected.own)]
        cache, scale = (k_cache, v_cache), case.scale
        checks: list[tuple[str, Callable, tuple, layout.AttentionOutput]] = [
            ("prefix_attention (level 1)", kernels.prefix_attention,
             (case.q, *cache, case.prefix_batches[0], scale), expected.prefix[0]),
            ("prefix_attention (level 2)", kernels.prefix_attention,
             (case.q, *cache, case.prefix_batches[1], scale), expected.prefix[1]),
            ("own_attention", kernels.own_attention,
             (case.q, *cache, case.own_batch, scale), expected.own),
            ("own_attention (decode)", kernels.own_attention,
             (case.decode_q, *cache, case.decode_batch, scale), expected.decode),
            ("merge_attention_states", kernels.merge_attention_states, (parts,), expected.merged),
        ]  # fmt: skip
        if windowed:
            operation = "windowed setup"
            own, levels = case.windowed(on_device=True)
            own_cpu, levels_cpu = case.windowed(on_device=False)
            cpu_cache = (case.expected_k_cache, case.expected_v_cache)
            for name, batch, batch_cpu in zip(("level 1", "level 2"), levels, levels_cpu):
                want = torch_attention.prefix_attention(case.q_cpu, *cpu_cache, batch_cpu, scale)
                label = f"prefix_attention ({name}, window {WINDOW})"
                args = (case.q, *cache, batch, scale)
                checks.append((label, kernels.prefix_attention, args, want))
            want = torch_attention.own_attention(case.q_cpu, *cpu_cache, own_cpu, scale)
            checks.append((f"own_attention (window {WINDOW})", kernels.own_attention,
                           (case.q, *cache, own, scale), want))  # fmt: skip
        for operation, function, args, want in checks:
            reason = _compare_output(function(*args), want, dtype)
            if reason:
                return f"{operation}: {reason}"
    except Exception as error:  # noqa: BLE001 - every failure is a reason, by contract
        message = " ".join(str(error).split()) or "(no message)"
        return _clip(f"{operation} raised {type(error).__name__}: {message}")
    return None


class _Expected(NamedTuple):
    """The reference's results on the CPU."""

    prefix: list[layout.AttentionOutput]  # per level
    own: layout.AttentionOutput
    decode: layout.AttentionOutput  # each request's last row alone
    merged: layout.AttentionOutput  # of prefix levels 1, 2 and own


class _Batches(NamedTuple):
    own: layout.OwnBatch
    decode: layout.OwnBatch
    prefix: list[layout.PrefixBatch]


class _Case:
    """The seeded inputs on ``device`` (for Triton) and on the CPU (for the oracle)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        prefill_rows: int,
    ) -> None:
        generator = torch.Generator().manual_seed(_SEED)
        self.device = device
        self.scale = head_dim**-0.5
        prefill_rows = max(1, prefill_rows)
        requests = [(5, 1), (24, 8), (prefill_rows, prefill_rows)]  # (own tokens, rows)
        # Token runs in the cache: segments, then requests; (length, tokens store_kv writes).
        runs = [(LEVEL1_LENGTH, 0)] + [(n, 0) for n in _LEVEL2_LENGTHS]
        runs += [(5, 1), (24, 8), (prefill_rows, 0)]
        blocks_per = [-(-length // _BLOCK_SIZE) for length, _ in runs]
        num_blocks = sum(blocks_per) + 2  # spare blocks stay NaN
        order = torch.randperm(num_blocks, generator=generator).tolist()
        owned = []
        for count in blocks_per:
            owned.append(order[:count])
            order = order[count:]

        slots, is_new = [], []
        for blocks, (length, new) in zip(owned, runs):
            slots += [
                blocks[p // _BLOCK_SIZE] * _BLOCK_SIZE + p % _BLOCK_SIZE for p in range(length)
            ]
            is_new += [p >= length - new for p in range(length)]
        slot_tensor = torch.tensor(slots, dtype=torch.int64)
        new_mask = torch.tensor(is_new)
        kv_shape = (len(slots), num_kv_heads, head_dim)
        k = torch.randn(kv_shape, generator=generator).to(dtype)
        v = torch.randn(kv_shape, generator=generator).to(dtype)
        cache_shape = (num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim)
        old_k = torch.full(cache_shape, math.nan, dtype=dtype)
        old_v = torch.full(cache_shape, math.nan, dtype=dtype)
        old = ~new_mask
        torch_attention.store_kv(old_k, old_v, k[old], v[old], slot_tensor[old])
        self._old_caches = (old_k, old_v)
        self.expected_k_cache, self.expected_v_cache = old_k.clone(), old_v.clone()
        new = (k[new_mask], v[new_mask], slot_tensor[new_mask])
        torch_attention.store_kv(self.expected_k_cache, self.expected_v_cache, *new)
        self.new_k, self.new_v, self.new_slots = (t.to(device) for t in new)

        starts = [0]
        for _, count in requests:
            starts.append(starts[-1] + count)
        num_rows = starts[-1]
        self.q_cpu = torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype)
        self.q = self.q_cpu.to(device)
        last_rows = [end - 1 for end in starts[1:]]
        # each row's position in its sequence (its segments' tokens, then its own)
        prefixes = [LEVEL1_LENGTH + _LEVEL2_LENGTHS[0], LEVEL1_LENGTH, _LEVEL2_LENGTHS[1]]
        self._positions = [
            prefix + own - count + j
            for prefix, (own, count) in zip(prefixes, requests)
            for j in range(count)
        ]
        self.decode_q = self.q[last_rows]
        self._decode_q_cpu = self.q_cpu[last_rows]

        segment_blocks = owned[: 1 + len(_LEVEL2_LENGTHS)]
        own_tables, own_lengths = owned[len(segment_blocks) :], [n for n, _ in requests]
        rows = [list(range(start, end)) for start, end in zip(starts, starts[1:])]
        levels = [
            ([rows[0] + rows[1]], segment_blocks[:1], [LEVEL1_LENGTH]),
            ([rows[0], rows[2]], segment_blocks[1:], list(_LEVEL2_LENGTHS)),
        ]
        cache = {"block_size": _BLOCK_SIZE, "num_blocks": num_blocks}

        def batches(on: torch.device) -> _Batches:
            return _Batches(
                layout.own_batch(starts, own_tables, own_lengths, device=on, **cache),
                layout.own_batch(
                    list(range(len(requests) + 1)), own_tables, own_lengths, device=on, **cache
                ),
                [
                    layout.prefix_batch(*level, num_rows=num_rows, device=on, **cache)
                    for level in levels
                ],
            )

        device_batches = self._device_batches = batches(device)
        self.own_batch, self.decode_batch = device_batches.own, device_batches.decode
        self.prefix_batches = device_batches.prefix
        self._cpu_batches = batches(torch.device("cpu"))

    def windowed(self, on_device: bool) -> tuple[layout.OwnBatch, list[layout.PrefixBatch]]:
        """The step's batches (on the device, or the CPU's for the oracle) under the
        sliding window ``WINDOW``, every row kept in its segments (``drop=False``: a row
        that sees none of one gets out 0, lse -inf there)."""
        batches = self._device_batches if on_device else self._cpu_batches
        starts = [[0], [LEVEL1_LENGTH, 0]]  # segment A follows level 1, B starts a sequence
        return layout.windowed(
            batches.own, batches.prefix, self._positions, starts, WINDOW, drop=False
        )

    def device_caches(self) -> tuple[Tensor, Tensor]:
        """Fresh device copies of the caches before this step's store."""
        return self._old_caches[0].to(self.device), self._old_caches[1].to(self.device)

    def expected(self) -> _Expected:
        """The reference on the CPU (its fp32 matmuls there, whatever the GPU's settings)."""
        batches = self._cpu_batches
        cache = (self.expected_k_cache, self.expected_v_cache)
        prefix = [
            torch_attention.prefix_attention(self.q_cpu, *cache, batch, self.scale)
            for batch in batches.prefix
        ]
        own = torch_attention.own_attention(self.q_cpu, *cache, batches.own, self.scale)
        decode = torch_attention.own_attention(
            self._decode_q_cpu, *cache, batches.decode, self.scale
        )
        merged = torch_attention.merge_attention_states([*prefix, own])
        return _Expected(prefix, own, decode, merged)


def _clip(reason: str) -> str:
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."


def _compare_cache(name: str, actual: Tensor, expected: Tensor) -> str | None:
    """None when ``actual`` equals ``expected`` exactly (NaN where it is NaN)."""
    actual = actual.cpu()
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    if bool(same.all()):
        return None
    wrong = int((~same).sum())
    return f"{name} differs from the reference's at {wrong} of {same.numel()} values"


def _compare_tensor(
    name: str, actual: Tensor, expected: Tensor, atol: float, rtol: float
) -> str | None:
    """None when ``actual`` is within atol + rtol * |expected| (infinities equal), else why."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            f"{name} is {tuple(actual.shape)} {actual.dtype}, the reference's "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    actual, expected = actual.cpu().double(), expected.double()
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol)
    if bool(close.all()):
        return None
    error = torch.where(actual == expected, 0.0, (actual - expected).abs())
    worst = float(error.max()) if not bool(error.isnan().any()) else math.nan
    return (
        f"{name} max error {worst:.3g} (atol {atol:g}, rtol {rtol:g}) at "
        f"{int((~close).sum())} of {close.numel()} values"
    )


def _compare_output(
    result: object, expected: layout.AttentionOutput, dtype: torch.dtype
) -> str | None:
    """None when (out, lse) agree with the reference's within the tests' tolerances."""
    if not isinstance(result, tuple) or len(result) != 2:
        return f"returned {type(result).__name__}, not an (out, lse) pair"
    out, lse = result
    tolerance = OUT_TOLERANCE[dtype]
    return _compare_tensor("out", out, expected.out, **tolerance) or _compare_tensor(
        "lse", lse, expected.lse, **LSE_TOLERANCE
    )
