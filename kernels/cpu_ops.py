"""Launchers of the compiled CPU kernels (``cpu_kernels.cpp``), their layouts and self-check.

The compiled module comes from ``cpu_extension.load()``; every launcher takes it as its
first argument and checks shapes, dtypes and devices (index values are the engine's, checked
once per step by ``layout.own_batch`` / ``prefix_batch``).

Layouts (see ``cpu_kernels.cpp``):

    packed weight  [ceil(N / 16), K, 16]            ``pack_linear_weight`` of W [N, K]
                   (bf16 with AVX512-BF16: [ceil(N / 16), ceil(K / 2), 16, 2], pairs of k)
    k_cache        [kv_heads, num_blocks, head_dim, block_size]
    v_cache        [kv_heads, num_blocks, block_size, head_dim]

``to_cpu_layout`` / ``from_cpu_layout`` convert caches from / to the reference layout
``[num_blocks, block_size, kv_heads, head_dim]``, so a test compares both on the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from llm_operator.kernels import layout, torch_attention
from llm_operator.kernels.layout import OwnBatch, PrefixBatch
from llm_operator.kernels.layout import align_batches as _aligned  # also the Triton path's

__all__ = [
    "CPU_DTYPES",
    "LANES",
    "SPLIT_KEYS",
    "AttentionItems",
    "attention",
    "attention_items",
    "from_cpu_layout",
    "kv_cache_shapes",
    "pack_linear_weight",
    "packed_linear",
    "self_check",
    "store_kv",
    "to_cpu_layout",
]

LANES = 16  # output columns of one packed weight block; keys of one score vector
CPU_DTYPES = (torch.float32, torch.bfloat16)
# Keys per unit of work for rows that fit one tile (decode rows): a long shared prefix is
# cut into this many keys per piece, so a few rows still keep every thread busy.
SPLIT_KEYS = 256


# ------------------------------------------------------------------ layouts


def kv_cache_shapes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (k_cache, v_cache) shapes of one layer in the CPU layout."""
    return (
        (num_kv_heads, num_blocks, head_dim, block_size),
        (num_kv_heads, num_blocks, block_size, head_dim),
    )


def to_cpu_layout(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Reference-layout caches [blocks, block_size, kv_heads, dim] -> CPU layout (copies)."""
    return k_cache.permute(2, 0, 3, 1).contiguous(), v_cache.permute(2, 0, 1, 3).contiguous()


def from_cpu_layout(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """CPU-layout caches -> the reference layout (copies)."""
    return k_cache.permute(1, 3, 0, 2).contiguous(), v_cache.permute(1, 2, 0, 3).contiguous()


# ------------------------------------------------------------------ linear


def pack_linear_weight(module: ModuleType, weight: Tensor) -> Tensor:
    """W [N, K] -> the layout ``packed_linear`` reads, in W's dtype: 16 output columns per
    block, each block one contiguous stream (``[ceil(N / 16), K, 16]``; bf16 on CPUs with
    AVX512-BF16 as pairs of k, ``[ceil(N / 16), ceil(K / 2), 16, 2]``), zero-padded."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    if weight.dtype not in CPU_DTYPES:
        raise TypeError(f"weight must be one of {CPU_DTYPES}, got {weight.dtype}")
    return module.pack_linear_weight(weight.contiguous())


def packed_linear(
    module: ModuleType, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int
) -> Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, out_features] in x's dtype, W given packed."""
    in_features = packed.shape[1] * (2 if packed.dim() == 4 else 1)
    if x.dim() != 2 or x.shape[1] not in (in_features, in_features - (packed.dim() == 4)):
        raise ValueError(
            f"x must be [rows, {in_features}] for this packed weight, got {tuple(x.shape)}"
        )
    if x.dtype != packed.dtype or x.dtype not in CPU_DTYPES:
        raise TypeError(
            f"x is {x.dtype} and the packed weight {packed.dtype}; want one of {CPU_DTYPES}"
        )
    return module.packed_linear(x, packed, bias, out_features)


# ------------------------------------------------------------------ attention


class AttentionItems(NamedTuple):
    """One step's attention work in the compiled kernel's terms (built once per step).

    items [I, 6] int32: (table list, table row, key_len, row_begin, row_count, causal);
    item_rows [N] int32: q rows, item i's at item_rows[row_begin : row_begin + row_count];
    tables: block tables, the own batch's first, then one per prefix batch;
    item_first [N] int32, aligned with item_rows: the first key of its item each row sees
    (sliding-window layers), or empty (every key).
    """

    items: Tensor
    item_rows: Tensor
    tables: list[Tensor]
    item_first: Tensor


# Keys per softmax step of the batch-invariant attention with aligned items (SUB_TILES runs of
# 16 keys in cpu_kernels.cpp; blocks of fewer keys make shorter steps that divide it).
INVARIANT_STEP_KEYS = 64


def invariant_split_keys(block_size: int, prefixes: Sequence[PrefixBatch]) -> int:
    """``attention``'s split_keys for the batch-invariant mode of this step: -1 (softmax
    steps of INVARIANT_STEP_KEYS keys, items aligned by ``attention_items(step_keys=...)``)
    where the blocks tile such steps and every segment ends on a block boundary, else 0 (one
    block a step: slower, and it needs segments on block boundaries too)."""
    tiles = INVARIANT_STEP_KEYS % block_size == 0 or block_size % INVARIANT_STEP_KEYS == 0
    aligned = all(length % block_size == 0 for p in prefixes for length in p.host_lengths)
    return -1 if tiles and aligned else 0


def attention_items(
    own: OwnBatch, prefixes: Sequence[PrefixBatch], step_keys: int | None = None
) -> AttentionItems:
    """The items of a step: each request's rows against its own K/V (causal), and each
    shared segment's rows against its K/V, one batch (chain level) after another.
    ``step_keys``: every item's keys start at a multiple of it (``_aligned``), for the
    batch-invariant mode's whole softmax steps (``attention(split_keys=-1)``)."""
    carried_in = [None] * len(prefixes)
    if step_keys is not None:
        own, prefixes, carried_in = _aligned(own, prefixes, step_keys)
    parts = [_items(0, own.context_lens, own.query_start.long(), causal=1)]
    rows = [torch.arange(own.num_rows)]
    offset = own.num_rows
    for index, prefix in enumerate(prefixes, start=1):
        parts.append(_items(index, prefix.lengths, prefix.row_start.long() + offset, causal=0))
        rows.append(prefix.rows.long())
        offset += len(prefix.host_rows)
    items = torch.cat(parts).to(torch.int32)
    keep = (items[:, 2] > 0) & (items[:, 4] > 0)  # no keys or no rows: nothing to do
    return AttentionItems(
        items[keep].contiguous(),
        torch.cat(rows).to(torch.int32),
        [own.block_tables.contiguous()] + [p.block_tables.contiguous() for p in prefixes],
        _item_first(own, prefixes, carried_in),
    )


def _items(table_list: int, key_lens: Tensor, row_start: Tensor, causal: int) -> Tensor:
    """The [n, 6] int64 items of one table list: n = len(key_lens), rows from row_start."""
    count = len(key_lens)
    return torch.stack(
        [
            torch.full((count,), table_list),
            torch.arange(count),
            key_lens.long(),
            row_start[:-1],
            row_start[1:] - row_start[:-1],
            torch.full((count,), causal),
        ],
        dim=1,
    )


def _item_first(own: OwnBatch, prefixes: Sequence[PrefixBatch], carried_in: Sequence) -> Tensor:
    """``AttentionItems.item_first`` of a sliding-window step (empty without a window), in
    the items' key coordinates: an own row's own position less the window plus one (keys
    carried in front by ``_aligned`` are counted in the position), a segment row's
    ``key_start`` plus the keys carried in front of its segment."""
    if not own.window and all(p.key_start is None for p in prefixes):
        return torch.empty(0, dtype=torch.int32)
    starts = np.asarray(own.host_query_start, dtype=np.int64)
    counts = np.diff(starts)
    request = np.repeat(np.arange(len(counts)), counts)
    lengths = np.asarray(own.host_context_lens, dtype=np.int64)
    position = lengths[request] - counts[request] + np.arange(own.num_rows) - starts[request]
    parts = [position - own.window + 1 if own.window else np.zeros(own.num_rows, np.int64)]
    for prefix, carried in zip(prefixes, carried_in):
        if prefix.host_key_start is None:
            parts.append(np.zeros(len(prefix.host_rows), dtype=np.int64))
            continue
        first = np.asarray(prefix.host_key_start, dtype=np.int64)
        if carried is not None:
            first = first + np.repeat(carried, np.diff(prefix.host_row_start))
        parts.append(first)
    return torch.from_numpy(np.clip(np.concatenate(parts), -(2**30), 2**30).astype(np.int32))


def _check_caches(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must be 4-D (the CPU layout)")
    num_kv_heads, num_blocks, head_dim, block_size = k_cache.shape
    if tuple(v_cache.shape) != (num_kv_heads, num_blocks, block_size, head_dim):
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} "
            "in the CPU layout"
        )
    if k_cache.dtype not in CPU_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"caches must be one of {CPU_DTYPES}, got {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q is {q.dtype} but the caches {k_cache.dtype}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q must be [tokens, heads, {head_dim}] with heads a multiple of {num_kv_heads}, "
            f"got {tuple(q.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def store_kv(
    module: ModuleType, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor
) -> None:
    """Write k, v [T, kv_heads, dim] at ``slots`` [T] int64 into CPU-layout caches."""
    _check_caches(k.reshape(k.shape[0], -1, k.shape[-1]), k_cache, v_cache)
    if k.shape != v.shape or k.shape[1:] != (k_cache.shape[0], k_cache.shape[2]):
        raise ValueError(
            f"k, v must be [tokens, kv_heads, dim] like the cache, got {tuple(k.shape)}"
        )
    if slots.dtype != torch.int64 or slots.shape != (k.shape[0],):
        raise ValueError(
            f"slots must be int64 [{k.shape[0]}], got {slots.dtype} {tuple(slots.shape)}"
        )
    module.store_kv(k_cache, v_cache, k.contiguous(), v.contiguous(), slots.contiguous())


def attention(
    module: ModuleType,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    work: AttentionItems,
    scale: float,
    split_keys: int = SPLIT_KEYS,
) -> Tensor:
    """Every row's attention over its own K/V and its shared segments, merged:
    q [T, heads, dim] -> out [T, heads, dim] in q's dtype (rows with no key get 0).
    split_keys: keys per piece of a long item (the default mode); 0 or -1: batch-invariant
    (one block a softmax step; or whole steps over items from ``attention_items`` with
    ``step_keys=INVARIANT_STEP_KEYS``)."""
    _check_caches(q, k_cache, v_cache)
    return module.paged_attention(
        q.contiguous(), k_cache, v_cache, work.tables, work.items, work.item_rows,
        work.item_first, layout.check_scale(scale), split_keys,
    )  # fmt: skip


# ------------------------------------------------------------------ self-check

_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _mismatch(name: str, actual: Tensor, expected: Tensor, dtype: torch.dtype) -> str | None:
    tolerance = _TOLERANCE[dtype]
    actual, expected = actual.float(), expected.float()
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.isfinite(actual).all():
        return f"{name}: non-finite output"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    bound = tolerance * (1.0 + expected.abs().max().item() if expected.numel() else 1.0)
    if error > bound:
        return f"{name}: max error {error:.3g} > {bound:.3g}"
    return None


def _check_linear(module: ModuleType, dtype: torch.dtype, generator: torch.Generator):
    for rows, out_features, in_features in ((1, 40, 24), (11, 48, 72), (20, 7, 5)):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for b in (None, bias):
            packed = pack_linear_weight(module, weight)
            out = packed_linear(module, x, packed, b, out_features)
            expected = torch.nn.functional.linear(
                x.float(), weight.float(), None if b is None else b.float()
            )
            reason = _mismatch(f"packed_linear {rows}x{in_features}->{out_features}", out,
                               expected, dtype)  # fmt: skip
            if reason:
                return reason
    return None


def _check_attention(
    module: ModuleType, dtype: torch.dtype, block_size: int, generator: torch.Generator
) -> str | None:
    """One mixed step: a prefill chunk, a decode row and a 4-row chunk, two chain levels;
    spare slots hold NaN so a stray read shows."""
    heads, kv_heads, dim = 6, 2, 24
    num_blocks = 64
    order = torch.randperm(num_blocks, generator=generator).tolist()

    def take(tokens: int) -> list[int]:
        return [order.pop() for _ in range(-(-tokens // block_size))]

    own_lens, own_rows = [19, 6, 9], [19, 1, 4]
    tables = [take(n) for n in own_lens]
    starts = [0, 19, 20, 24]
    level1, level2 = take(37), [take(3), take(20)]
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    refs = [torch.full(cache_shape, float("nan")).to(dtype) for _ in range(2)]  # k, v
    new_slots = []
    for table, tokens in [*zip(tables, own_lens), (level1, 37), (level2[0], 3), (level2[1], 20)]:
        for i in range(tokens):
            slot = (table[i // block_size], i % block_size)
            for ref in refs:
                ref[slot] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
    for table, tokens, rows in zip(tables, own_lens, own_rows):  # this step's own tokens
        new_slots += [table[i // block_size] * block_size + i % block_size
                      for i in range(tokens - rows, tokens)]  # fmt: skip
    q = torch.randn(starts[-1], heads, dim, generator=generator).to(dtype)
    shape = {"block_size": block_size, "num_blocks": num_blocks}
    own = layout.own_batch(starts, tables, own_lens, **shape)
    prefixes = [
        layout.prefix_batch([list(range(24))], [level1], [37], num_rows=24, **shape),
        layout.prefix_batch(
            [[19], list(range(20, 24))], level2, [3, 20], num_rows=24, **shape
        ),  # fmt: skip
    ]
    scale = dim**-0.5
    parts = [torch_attention.own_attention(q, *refs, own, scale)]
    parts += [torch_attention.prefix_attention(q, *refs, p, scale) for p in prefixes]
    expected = torch_attention.merge_attention_states(parts).out
    # store: this step's K/V go through store_kv into a cache that lacks them
    slots = torch.tensor(new_slots, dtype=torch.int64)
    new = [ref.view(-1, kv_heads, dim)[slots].clone() for ref in refs]
    missing = [ref.clone() for ref in refs]
    for cache in missing:
        cache.view(-1, kv_heads, dim)[slots] = 0
    k_cpu, v_cpu = to_cpu_layout(*missing)
    store_kv(module, k_cpu, v_cpu, *new, slots)
    back = from_cpu_layout(k_cpu, v_cpu)
    if not all(torch.equal(b.nan_to_num(), ref.nan_to_num()) for b, ref in zip(back, refs)):
        return f"store_kv (block_size {block_size}): the cache differs from the reference's"
    work = attention_items(own, prefixes)
    for split in (SPLIT_KEYS, 5):
        out = attention(module, q, k_cpu, v_cpu, work, scale, split_keys=split)
        reason = _mismatch(f"paged_attention (block_size {block_size}, split {split})", out,
                           expected, dtype)  # fmt: skip
        if reason:
            return reason
    return None


def self_check(module: ModuleType) -> str | None:
    """Run every operation on small seeded cases against the torch reference, fp32 and
    bf16; None when all agree, else a one-line reason naming the first that did not."""
    generator = torch.Generator().manual_seed(20261203)
    for dtype in CPU_DTYPES:
        reason = _check_linear(module, dtype, generator)
        for block_size in (16, 5, 32):
            reason = reason or _check_attention(module, dtype, block_size, generator)
        if reason:
            return f"{reason} ({str(dtype).removeprefix('torch.')})"
    return None
