"""The index layout of one attention step over a paged KV cache, and the launch checks.

Every implementation of the native engine's attention (``torch_attention.py``,
``triton_attention.py``, ``cpu_ops.py``) reads one step's layout from two kinds of batch,
built and validated once per step on the host and reused by every layer:

- ``OwnBatch`` (``own_batch``): each request's q rows, block table and own length, for
  ``own_attention`` (causal);
- ``PrefixBatch`` (``prefix_batch``: one level of shared segments, each read by the rows
  of every request sharing it), for ``prefix_attention`` (non-causal).

Layout of one layer's cache (a token's slot is ``block_id * block_size + offset``)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

GQA: query head ``h`` reads KV head ``h // group`` (``group = num_heads // num_kv_heads``),
the order ``repeat_interleave`` gives. Inputs may be fp16, bf16 or fp32 (q and the cache
alike); scores, softmax and sums run in fp32; ``out`` comes back in q's dtype and ``lse``
(natural log of the softmax denominator over scaled scores) in fp32 (``AttentionOutput``).
A row that sees no key gets ``out = 0`` and ``lse = -inf``.

Index values (block ids, lengths, rows) are checked here, on the host, when a batch is
built. ``check_launch``, ``check_store``, ``check_scale`` and ``check_merge_parts`` check
every call's shapes, dtypes and devices (no host sync) for all implementations; the Triton
launchers add only their strides and dtypes. No attention is computed here.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "AlignedKeys",
    "AttentionOutput",
    "OwnBatch",
    "PrefixBatch",
    "align_batches",
    "align_step_keys",
    "check_launch",
    "check_merge_parts",
    "check_scale",
    "check_store",
    "own_batch",
    "own_batch_arrays",
    "prefix_batch",
    "prefix_batch_arrays",
    "windowed",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class AttentionOutput(NamedTuple):
    """Attention over some keys: ``out`` [rows, num_heads, head_dim] in q's dtype,
    ``lse`` [rows, num_heads] float32 (-inf for a row that saw no key)."""

    out: Tensor
    lse: Tensor


# ---------------------------------------------------------------- argument checks


def _check_tensor(name: str, value: object, ndim: int, layout: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(value.shape)}")
    return value


def _check_kv_cache(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4, layout)
        if cache.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    _check_like_cache("v_cache", v_cache, k_cache)
    return tuple(k_cache.shape)


def _check_like_cache(name: str, value: Tensor, k_cache: Tensor) -> None:
    if value.dtype != k_cache.dtype:
        raise TypeError(f"{name} dtype {value.dtype} != k_cache dtype {k_cache.dtype}")
    if value.device != k_cache.device:
        raise ValueError(f"{name} is on {value.device} but k_cache on {k_cache.device}")


def _check_query(q: Tensor, k_cache: Tensor) -> int:
    """Check q [T, num_heads, head_dim] against the cache; return the GQA group size."""
    _check_tensor("q", q, 3, "[tokens, num_heads, head_dim]")
    _check_like_cache("q", q, k_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim != cache_head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_heads {num_heads} is not a multiple of k_cache num_kv_heads {num_kv_heads}"
        )
    return num_heads // num_kv_heads


def _check_index(name: str, value: object, ndim: int, layout: str, device: torch.device) -> Tensor:
    tensor = _check_tensor(name, value, ndim, layout)
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but q and the cache on {device}")
    return tensor


def _check_range(name: str, values: Tensor, upper: int) -> None:
    if values.numel() == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= upper:
        raise ValueError(f"{name} values must lie in [0, {upper}), got min {low} and max {high}")


def check_scale(scale: object) -> float:
    """The softmax scale as a finite float (shared by every implementation)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def check_store(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor):
    """Shapes, dtypes and devices of store_kv's arguments (shared by every implementation;
    slot values are not read). Returns (num_blocks, block_size)."""
    num_blocks, block_size, num_kv_heads, head_dim = _check_kv_cache(k_cache, v_cache)
    layout = "[tokens, num_kv_heads, head_dim]"
    for name, value in (("k", k), ("v", v)):
        _check_tensor(name, value, 3, layout)
        _check_like_cache(name, value, k_cache)
        if tuple(value.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be {layout} with num_kv_heads {num_kv_heads} and head_dim "
                f"{head_dim} (from k_cache), got shape {tuple(value.shape)}"
            )
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    _check_index("slot_mapping", slot_mapping, 1, "[tokens]", k_cache.device)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots but k has {k.shape[0]} tokens"
        )
    return num_blocks, block_size


def check_merge_parts(parts: object) -> tuple[list[Tensor], list[Tensor]]:
    """Check merge_attention_states' parts (shared by every implementation); (outs, lses)."""
    if isinstance(parts, Tensor) or not isinstance(parts, Sequence):
        raise TypeError(f"parts must be a sequence of (out, lse) pairs, got {type(parts).__name__}")
    if len(parts) == 0:
        raise ValueError("parts must hold at least one (out, lse) pair, got none")
    outs, lses = [], []
    for index, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise TypeError(f"parts[{index}] must be an (out, lse) pair, got {part!r:.80}")
        out = _check_tensor(f"parts[{index}] out", part[0], 3, "[tokens, num_heads, head_dim]")
        lse = _check_tensor(f"parts[{index}] lse", part[1], 2, "[tokens, num_heads]")
        if out.dtype not in FLOAT_DTYPES or lse.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"parts[{index}] out and lse must be floating point, got {out.dtype}, {lse.dtype}"
            )
        if tuple(lse.shape) != tuple(out.shape[:2]):
            raise ValueError(
                f"parts[{index}] lse shape {tuple(lse.shape)} != out shape[:2] "
                f"{tuple(out.shape[:2])}"
            )
        if index and (out.shape != outs[0].shape or out.dtype != outs[0].dtype):
            raise ValueError(
                f"parts[{index}] out is {tuple(out.shape)} {out.dtype} but parts[0] out is "
                f"{tuple(outs[0].shape)} {outs[0].dtype}"
            )
        if out.device != lse.device or (index and out.device != outs[0].device):
            raise ValueError(f"parts[{index}] is not on parts[0]'s device {outs[0].device}")
        outs.append(out)
        lses.append(lse)
    return outs, lses


# ---------------------------------------------------------------- batches (built once per step)


@dataclass(eq=False)
class OwnBatch:
    """One step's own-attention layout, validated once by ``own_batch``, reused by every layer.

    Request b owns q rows ``query_start[b]:query_start[b + 1]`` (n_b rows, possibly 0) and
    the own K/V at its blocks ``block_tables[b]``; after this step it holds
    ``context_lens[b]`` own tokens, and its row j sits at own position
    ``context_lens[b] - n_b + j`` (causal: it sees own positions 0 .. that one).
    """

    query_start: Tensor  # [B + 1] int32, cumulative, query_start[B] = num_rows
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0 past the used blocks
    context_lens: Tensor  # [B] int32
    num_rows: int  # T, rows of q
    block_size: int  # of the cache this batch was validated for
    num_blocks: int
    max_query_rows: int  # max n_b (for launch grids)
    max_context_len: int  # max context_lens[b]
    host_query_start: tuple[int, ...]
    host_context_lens: tuple[int, ...]
    # Sliding-window attention: row j of request b (own position p = context_lens[b] - n_b
    # + j) sees own positions p - window + 1 .. p only; 0: every earlier position.
    window: int = 0
    # Per-implementation launch data derived on first use and reused by later layers.
    derived: dict = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class PrefixBatch:
    """One step's rows against shared prefix segments (one level of the segment chains),
    validated once by ``prefix_batch``; each q row reads at most one segment of the batch.

    Segment s is read by q rows ``rows[row_start[s]:row_start[s + 1]]`` (decode rows and
    prefill chunks of every request sharing it), non-causally: each of them sees all
    ``lengths[s]`` tokens at the blocks ``block_tables[s]``.
    """

    rows: Tensor  # [N] int64, q row indices grouped by segment, each row at most once
    row_start: Tensor  # [S + 1] int32, cumulative, row_start[S] = N
    block_tables: Tensor  # [S, max_blocks] int32, padded with 0 past the used blocks
    lengths: Tensor  # [S] int32, tokens in each segment (>= 0)
    num_rows: int  # T, rows of q (rows in no segment get out 0, lse -inf)
    block_size: int
    num_blocks: int
    max_segment_rows: int  # max rows of one segment (for launch grids)
    max_length: int  # longest segment
    host_rows: tuple[int, ...]
    host_row_start: tuple[int, ...]
    host_lengths: tuple[int, ...]
    # Sliding-window attention: [N] int32 aligned with ``rows``: the first key of its
    # segment each row sees (keys before it lie outside the row's window; <= 0: all of
    # them; >= the segment's length: none); None: all keys. The step builder leaves a row
    # whose window misses a segment wholly out of that batch (but the batch-invariant CPU
    # mode, whose items must match the window-less layout's).
    key_start: Tensor | None = None
    host_key_start: tuple[int, ...] | None = None
    derived: dict = field(default_factory=dict, repr=False)


def _int_list(name: str, value: object, ndim: int) -> list:
    """A host copy of integer indices given as a tensor or nested sequences of ints."""
    if isinstance(value, Tensor):
        if value.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
        if value.dim() != ndim:
            raise ValueError(
                f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}"
            )
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints or an int tensor, got {value!r:.60}")
    items = list(value)
    if ndim == 1:
        for item in items:
            if isinstance(item, bool) or not isinstance(item, numbers.Integral):
                raise TypeError(f"{name} must hold ints, got {item!r:.40}")
        return [int(item) for item in items]
    return [_int_list(f"{name}[{i}]", item, ndim - 1) for i, item in enumerate(items)]


def _check_count(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def own_batch(
    query_start: Sequence[int] | Tensor,
    block_tables: Sequence[Sequence[int]] | Tensor,
    context_lens: Sequence[int] | Tensor,
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    window: int = 0,
) -> OwnBatch:
    """Validate one step's own-attention layout on the host and put it on ``device``
    (``own_batch_arrays`` from lists or tensors: tests and self-checks).

    query_start:  B + 1 cumulative row counts from 0
    block_tables: B rows of block ids (entries past a request's used blocks are ignored)
    context_lens: B own lengths after this step, each >= the request's rows
    block_size, num_blocks: the cache's (block ids must lie in [0, num_blocks))
    """
    block_size = _check_count("block_size", block_size, 1)
    num_blocks = _check_count("num_blocks", num_blocks, 0)
    tables = _int_list("block_tables", block_tables, 2)
    lengths = _int_list("context_lens", context_lens, 1)
    _check_rows_have_blocks("block_tables", tables, lengths, block_size)
    return own_batch_arrays(
        np.array(_int_list("query_start", query_start, 1), dtype=np.int64),
        _padded(tables),
        np.array(lengths, dtype=np.int64),
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        window=window,
    )


def _check_rows_have_blocks(name: str, tables: list[list[int]], lengths: list[int], size: int):
    """ValueError naming the first row whose blocks cannot hold its tokens."""
    for b, (table, length) in enumerate(zip(tables, lengths)):
        needed = -(-length // size)
        if needed > len(table):
            raise ValueError(
                f"{name}[{b}]: {length} tokens need {needed} blocks of {size} but it has "
                f"{len(table)}"
            )


def _padded(rows: list[list[int]]) -> np.ndarray:
    width = max((len(row) for row in rows), default=0)
    return np.array([row + [0] * (width - len(row)) for row in rows], dtype=np.int64).reshape(
        len(rows), width
    )


def device_tensor(array: np.ndarray, device: torch.device | str) -> Tensor:
    """A host array on ``device``: shared memory on the CPU, one non-blocking copy from
    pinned memory on CUDA (no sync)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _used_blocks(
    name: str, tables: np.ndarray, lengths: np.ndarray, block_size: int, num_blocks: int
) -> np.ndarray:
    """``tables`` [B, width] cut to the blocks ``lengths`` [B] tokens use, int32, padding
    past each row's used blocks zeroed; ValueError when a row has too few columns or a used
    block id lies outside [0, num_blocks)."""
    needed = -(-lengths // block_size)
    width = int(needed.max()) if needed.size else 0
    if width > tables.shape[1]:
        b = int(np.argmax(needed))
        raise ValueError(
            f"{name}[{b}]: {int(lengths[b])} tokens need {width} blocks of {block_size} "
            f"but the table has {tables.shape[1]} columns"
        )
    used = tables[:, :width].astype(np.int32)
    used[np.arange(width)[None, :] >= needed[:, None]] = 0  # padding past the used blocks
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        b = int(np.argmax(((used < 0) | (used >= num_blocks)).any(axis=1)))
        raise ValueError(f"{name}[{b}] values must lie in [0, {num_blocks}), got {used[b]}")
    return used


def own_batch_arrays(
    query_start: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    window: int = 0,
) -> OwnBatch:
    """``own_batch`` from a step builder's arrays, with the same checks vectorized (a
    thousand decode rows cost microseconds, not milliseconds).

    query_start:  [B + 1] integers, cumulative row counts from 0
    block_tables: [B, width] integers; entries past a request's used blocks are ignored
    context_lens: [B] integers, each >= the request's rows
    window:       sliding-window attention (``OwnBatch.window``; 0: none)
    """
    window = _check_count("window", window, 0)
    starts = np.asarray(query_start, dtype=np.int64)
    lengths = np.asarray(context_lens, dtype=np.int64)
    tables = np.asarray(block_tables)
    if starts.ndim != 1 or lengths.ndim != 1 or tables.ndim != 2:
        raise ValueError(
            f"query_start, block_tables and context_lens must be 1-D, 2-D and 1-D, got "
            f"{starts.shape}, {tables.shape} and {lengths.shape}"
        )
    count = tables.shape[0]
    if starts.shape[0] != count + 1:
        raise ValueError(
            f"query_start must have num_requests + 1 = {count + 1} entries (block_tables has "
            f"{count} rows), got {starts.shape[0]}"
        )
    if lengths.shape[0] != count:
        raise ValueError(
            f"context_lens must have num_requests = {count} entries (block_tables has {count} "
            f"rows), got {lengths.shape[0]}"
        )
    if starts[0] != 0:
        raise ValueError(f"query_start must run from 0, got {int(starts[0])}")
    rows = np.diff(starts)
    if count and rows.min() < 0:
        raise ValueError("query_start must be non-decreasing")
    if count and (lengths < rows).any():
        b = int(np.argmax(lengths < rows))
        raise ValueError(
            f"context_lens[{b}] = {int(lengths[b])} must be >= its {int(rows[b])} query rows"
        )
    used = _used_blocks("block_tables", tables, lengths, block_size, num_blocks)
    return OwnBatch(
        query_start=device_tensor(starts.astype(np.int32), device),
        block_tables=device_tensor(used, device),
        context_lens=device_tensor(lengths.astype(np.int32), device),
        num_rows=int(starts[-1]),
        block_size=block_size,
        num_blocks=num_blocks,
        max_query_rows=int(rows.max()) if count else 0,
        max_context_len=int(lengths.max()) if count else 0,
        host_query_start=tuple(starts.tolist()),
        host_context_lens=tuple(lengths.tolist()),
        window=window,
    )


def prefix_batch_arrays(
    rows: np.ndarray,
    row_start: np.ndarray,
    block_tables: np.ndarray,
    lengths: np.ndarray,
    *,
    num_rows: int,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    key_start: np.ndarray | None = None,
) -> PrefixBatch:
    """``prefix_batch`` from a step builder's arrays (rows already grouped by segment),
    with the same checks vectorized.

    rows:         [N] q rows, segment s's at ``rows[row_start[s]:row_start[s + 1]]``
    row_start:    [S + 1] cumulative from 0
    block_tables: [S, width] each segment's blocks (entries past its length are ignored)
    lengths:      [S] tokens of each segment (>= 0)
    key_start:    [N] or None: each row's first visible key of its segment
                  (``PrefixBatch.key_start``)
    """
    flat = np.asarray(rows, dtype=np.int64)
    starts = np.asarray(row_start, dtype=np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)
    tables = np.asarray(block_tables)
    segments = sizes.shape[0]
    if starts.shape != (segments + 1,) or tables.ndim != 2 or tables.shape[0] != segments:
        raise ValueError(
            f"row_start, block_tables and lengths must have one entry per segment (and "
            f"row_start one more), got {starts.shape}, {tables.shape} and {sizes.shape}"
        )
    if starts[0] != 0 or starts[-1] != flat.shape[0] or (np.diff(starts) < 0).any():
        raise ValueError("row_start must run from 0 to len(rows), non-decreasing")
    if segments and sizes.min() < 0:
        raise ValueError("lengths must be >= 0")
    if flat.size:
        if flat.min() < 0 or flat.max() >= num_rows:
            raise ValueError(f"rows values must lie in [0, {num_rows})")
        if np.bincount(flat, minlength=num_rows).max() > 1:
            raise ValueError("a q row is in two segments of one batch")
    used = _used_blocks("segment_blocks", tables, sizes, block_size, num_blocks)
    counts = np.diff(starts)
    firsts = None
    if key_start is not None:
        firsts = np.asarray(key_start, dtype=np.int64)
        if firsts.shape != flat.shape:
            raise ValueError(f"key_start must be [{flat.shape[0]}] like rows, got {firsts.shape}")
    return PrefixBatch(
        rows=device_tensor(flat, device),
        row_start=device_tensor(starts.astype(np.int32), device),
        block_tables=device_tensor(used, device),
        lengths=device_tensor(sizes.astype(np.int32), device),
        num_rows=num_rows,
        block_size=block_size,
        num_blocks=num_blocks,
        max_segment_rows=int(counts.max()) if segments else 0,
        max_length=int(sizes.max()) if segments else 0,
        host_rows=tuple(flat.tolist()),
        host_row_start=tuple(starts.tolist()),
        host_lengths=tuple(sizes.tolist()),
        key_start=None if firsts is None else device_tensor(firsts.astype(np.int32), device),
        host_key_start=None if firsts is None else tuple(firsts.tolist()),
    )


def prefix_batch(
    segment_rows: Sequence[Sequence[int]],
    segment_blocks: Sequence[Sequence[int]] | Tensor,
    lengths: Sequence[int] | Tensor,
    *,
    num_rows: int,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    key_start: Sequence[Sequence[int]] | None = None,
) -> PrefixBatch:
    """Validate one level of shared segments on the host and put it on ``device``
    (``prefix_batch_arrays`` from lists or tensors: tests and self-checks).

    segment_rows:   per segment, the q rows that read it (each row in at most one segment)
    segment_blocks: per segment, its blocks in order (the last may be partly filled;
                    entries past ceil(length / block_size) are ignored)
    lengths:        per segment, its tokens (>= 0; 0 contributes nothing)
    num_rows:       T, rows of the q this batch will be used with
    key_start:      per segment, each of its rows' first visible key (``PrefixBatch``)
    """
    num_rows = _check_count("num_rows", num_rows, 0)
    block_size = _check_count("block_size", block_size, 1)
    num_blocks = _check_count("num_blocks", num_blocks, 0)
    row_lists = _int_list("segment_rows", segment_rows, 2)
    tables = _int_list("segment_blocks", segment_blocks, 2)
    sizes = _int_list("lengths", lengths, 1)
    if not len(row_lists) == len(tables) == len(sizes):
        raise ValueError(
            f"segment_rows, segment_blocks and lengths must have one entry per segment, got "
            f"{len(row_lists)}, {len(tables)} and {len(sizes)}"
        )
    _check_rows_have_blocks("segment_blocks", tables, [max(0, n) for n in sizes], block_size)
    firsts = None
    if key_start is not None:
        keys = _int_list("key_start", key_start, 2)
        if [len(k) for k in keys] != [len(rows) for rows in row_lists]:
            raise ValueError("key_start must hold one entry per row of every segment")
        firsts = np.array([first for k in keys for first in k], dtype=np.int64)
    return prefix_batch_arrays(
        np.array([row for rows in row_lists for row in rows], dtype=np.int64),
        np.array(list(itertools.accumulate(map(len, row_lists), initial=0)), dtype=np.int64),
        _padded(tables),
        np.array(sizes, dtype=np.int64),
        num_rows=num_rows,
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        key_start=firsts,
    )


def check_launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch, kind: type) -> int:
    """Shape, dtype and device checks shared by every implementation (no host sync).
    Returns the GQA group size."""
    if not isinstance(batch, kind):
        raise TypeError(f"batch must be a {kind.__name__}, got {type(batch).__name__}")
    num_blocks, block_size, _, _ = _check_kv_cache(k_cache, v_cache)
    group = _check_query(q, k_cache)
    if (num_blocks, block_size) != (batch.num_blocks, batch.block_size):
        raise ValueError(
            f"the cache has {num_blocks} blocks of {block_size} but the batch was built for "
            f"{batch.num_blocks} blocks of {batch.block_size}"
        )
    if q.shape[0] != batch.num_rows:
        raise ValueError(f"q has {q.shape[0]} rows but the batch was built for {batch.num_rows}")
    batch_device = batch.block_tables.device
    if batch_device != q.device:
        raise ValueError(f"the batch is on {batch_device} but q on {q.device}")
    return group


def windowed(
    own: OwnBatch,
    prefixes: Sequence[PrefixBatch],
    positions: np.ndarray,
    segment_starts: Sequence[np.ndarray],
    window: int,
    *,
    drop: bool = True,
) -> tuple[OwnBatch, list[PrefixBatch]]:
    """A step's batches for sliding-window layers: a query at position p sees keys at
    positions p - window + 1 .. p only (Hugging Face's sliding window).

    positions:      [T] each q row's position in its sequence (shared prefix included)
    segment_starts: per batch of ``prefixes``, [S] the position of each segment's first key
    drop:           leave a row out of a segment its window misses wholly (the segment is
                    skipped, not masked); False keeps every row (the batch-invariant CPU
                    mode, whose items follow the window-less layout)

    The own batch gets ``window`` (its rows' own keys are in the same coordinates as their
    positions, shifted by the prefix, so the window applies as is); each prefix batch
    gets ``key_start`` per row: ``position - window + 1 - segment start``.
    """
    window = _check_count("window", window, 1)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.shape != (own.num_rows,):
        raise ValueError(f"positions must be [{own.num_rows}], got {positions.shape}")
    if len(segment_starts) != len(prefixes):
        raise ValueError("segment_starts must have one entry per prefix batch")
    own = replace(own, window=window, derived={})
    batches = []
    for prefix, starts in zip(prefixes, segment_starts):
        rows = np.asarray(prefix.host_rows, dtype=np.int64)
        row_start = np.asarray(prefix.host_row_start, dtype=np.int64)
        lengths = np.asarray(prefix.host_lengths, dtype=np.int64)
        counts = np.diff(row_start)
        segment_of = np.repeat(np.arange(len(lengths)), counts)
        first = positions[rows] - window + 1 - np.asarray(starts, dtype=np.int64)[segment_of]
        if drop:
            keep = first < lengths[segment_of]
            rows, first, segment_of = rows[keep], first[keep], segment_of[keep]
            counts = np.bincount(segment_of, minlength=len(lengths))
            row_start = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(counts, out=row_start[1:])
        device = prefix.block_tables.device
        batches.append(
            replace(
                prefix,
                rows=device_tensor(rows, device),
                row_start=device_tensor(row_start.astype(np.int32), device),
                max_segment_rows=int(counts.max()) if counts.size else 0,
                host_rows=tuple(rows.tolist()),
                host_row_start=tuple(row_start.tolist()),
                key_start=device_tensor(first.astype(np.int32), device),
                host_key_start=tuple(first.tolist()),
                derived={},
            )
        )
    return own, batches


# ---------------------------------------------------------------- batch-invariant key steps


class AlignedKeys(NamedTuple):
    """``align_step_keys``' result: the step's own and per-level arrays, every item's keys
    starting at a multiple of the step (``carried_in``: per level, the keys carried in front
    of each segment's own)."""

    own_tables: np.ndarray  # [B, width] int32
    context_lens: np.ndarray  # [B] int64
    level_tables: list[np.ndarray]  # per level [S, width] int32
    level_lengths: list[np.ndarray]  # per level [S] int64
    carried_in: list[np.ndarray]  # per level [S] int64


def align_step_keys(
    query_start: np.ndarray,
    own_tables: np.ndarray,
    context_lens: np.ndarray,
    levels: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    *,
    block_size: int,
    step_keys: int,
) -> AlignedKeys:
    """A step's layout (host arrays) with every item's keys starting at a multiple of
    ``step_keys``, for the batch-invariant attention (the compiled CPU kernel's and the
    Triton one's): the keys of a segment past its last multiple are left to the next item
    of its rows (a deeper segment, or the row's own keys), whose table gets those blocks in
    front. A row's keys are then cut into softmax steps at the same positions whatever its
    segments, so the kernels can take whole steps.

    levels: per chain level (rows, row_start, tables, lengths) as ``prefix_batch_arrays``
    takes them. Every segment must end on a block boundary (ValueError otherwise), and the
    rows of one segment (and of one request) must carry the same keys into it, as they do
    when each row reads every segment of its chain (ValueError otherwise: a sliding-window
    layout that left rows out of segments, ``windowed(drop=True)``)."""
    starts = np.asarray(query_start, dtype=np.int64)
    own_tables = np.asarray(own_tables)
    lengths = np.asarray(context_lens, dtype=np.int64)
    num_rows = int(starts[-1]) if starts.size else 0
    if num_rows == 0:
        return AlignedKeys(
            own_tables, lengths, [np.asarray(level[2]) for level in levels],
            [np.asarray(level[3], dtype=np.int64) for level in levels],
            [np.zeros(len(level[3]), np.int64) for level in levels],
        )  # fmt: skip
    size = block_size
    most = max(1, step_keys // size)  # blocks a row can carry (fewer than a step's keys)
    carried = np.zeros(num_rows, dtype=np.int64)  # keys carried, per q row
    carry = np.zeros((num_rows, most), dtype=np.int32)
    level_tables, level_lengths, carried_in = [], [], []
    for rows, row_start, tables, segment_lengths in levels:
        rows = np.asarray(rows, dtype=np.int64)
        row_start = np.asarray(row_start, dtype=np.int64)
        tables = np.asarray(tables)
        new_tables, new_lengths = [], []
        carried_in.append(np.zeros(len(segment_lengths), dtype=np.int64))
        for s, length in enumerate(np.asarray(segment_lengths, dtype=np.int64).tolist()):
            readers = rows[row_start[s] : row_start[s + 1]]
            if length % size:
                raise ValueError(
                    f"segment {s} has {length} tokens, not a multiple of the block size {size}"
                )
            before = int(carried[readers[0]]) if len(readers) else 0
            if len(readers) and (carried[readers] != before).any():
                raise ValueError(
                    f"the rows of segment {s} carry different keys into it: a row left out "
                    "of an earlier segment of its chain (windowed(drop=True))?"
                )
            carried_in[-1][s] = before
            blocks = np.concatenate(
                [carry[readers[0], : before // size] if len(readers) else carry[0, :0],
                 tables[s, : length // size]]
            )  # fmt: skip
            total = before + length
            done = total - total % step_keys
            new_tables.append(blocks)
            new_lengths.append(done)
            left = (total - done) // size
            carry[readers, :left] = blocks[done // size : total // size]
            carried[readers] = total - done
        width = max([len(t) for t in new_tables] + [1])
        table = np.zeros((len(new_tables), width), dtype=np.int32)
        for s, blocks in enumerate(new_tables):
            table[s, : len(blocks)] = blocks
        level_tables.append(table)
        level_lengths.append(np.asarray(new_lengths, dtype=np.int64))
    if own_tables.shape[1] == 0:
        own_tables = np.zeros((own_tables.shape[0], 1), dtype=np.int32)
    first = np.minimum(starts[:-1], num_rows - 1)
    has_rows = starts[1:] > starts[:-1]
    before = np.where(has_rows, carried[first], 0)
    request = np.repeat(np.arange(len(first)), np.diff(starts))
    if (carried != before[request]).any():
        raise ValueError(
            "the rows of a request carry different keys into its own: a row left out of a "
            "segment of its chain (windowed(drop=True))?"
        )
    shift = before // size  # carried blocks go in front of the own ones
    columns = np.arange(most + own_tables.shape[1])[None, :]
    source = columns - shift[:, None]
    table = np.where(
        source >= 0,
        np.take_along_axis(own_tables, np.clip(source, 0, own_tables.shape[1] - 1), axis=1),
        np.take_along_axis(carry[first], np.clip(columns, 0, most - 1), axis=1),
    ).astype(np.int32)
    return AlignedKeys(table, lengths + before, level_tables, level_lengths, carried_in)


def align_batches(
    own: OwnBatch, prefixes: Sequence[PrefixBatch], step_keys: int
) -> tuple[OwnBatch, list[PrefixBatch], list[np.ndarray]]:
    """The step's batches with every item's keys starting at a multiple of ``step_keys``
    (``align_step_keys`` on their host fields and tables; the tables are read back from
    the batches' device). Also returns, per prefix batch, the keys carried in front of
    each segment's own. ``key_start`` (sliding windows) is left as is: add ``carried_in``
    to it for the aligned items' coordinates."""
    if own.num_rows == 0:
        return own, list(prefixes), [np.zeros(len(p.host_lengths), np.int64) for p in prefixes]
    levels = [
        (p.host_rows, p.host_row_start, p.block_tables.cpu().numpy(), p.host_lengths)
        for p in prefixes
    ]
    aligned = align_step_keys(
        own.host_query_start, own.block_tables.cpu().numpy(), own.host_context_lens, levels,
        block_size=own.block_size, step_keys=step_keys,
    )  # fmt: skip
    batches = []
    for prefix, table, lengths in zip(prefixes, aligned.level_tables, aligned.level_lengths):
        device = prefix.block_tables.device
        batches.append(
            replace(
                prefix,
                block_tables=device_tensor(table, device),
                lengths=device_tensor(lengths.astype(np.int32), device),
                host_lengths=tuple(lengths.tolist()),
                max_length=int(lengths.max(initial=0)),
                derived={},  # launch data of the original tables does not apply
            )
        )
    lengths = aligned.context_lens
    device = own.block_tables.device
    own = replace(
        own,
        block_tables=device_tensor(aligned.own_tables, device),
        context_lens=device_tensor(lengths.astype(np.int32), device),
        host_context_lens=tuple(int(v) for v in lengths),
        max_context_len=int(lengths.max(initial=0)),
        derived={},
    )
    return own, batches, aligned.carried_in
