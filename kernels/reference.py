"""Torch reference for the native engine's attention over a paged KV cache.

Shared-prefix attention (Hydragen, FlashInfer cascade, BatchLLM) splits a request's
attention over ``[shared prefix ; own tokens]`` into two parts over disjoint keys:

- ``prefix_attention``: the query rows of every request sharing one prefix segment,
  against ONE copy of that segment's K/V, non-causal (the prefix lies wholly before
  every row);
- ``own_attention``: each request's rows against its own K/V, causal;

and ``merge_attention_states`` combines the ``(out, lse)`` results by log-sum-exp.
These functions are the CPU path of the engine and the oracle for the Triton kernels
(``triton_attention.py``), which share their signatures and semantics.

Layout of one layer's cache (a token's slot is ``block_id * block_size + offset``)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

GQA: query head ``h`` reads KV head ``h // group`` (``group = num_heads // num_kv_heads``),
the order ``repeat_interleave`` gives. Inputs may be fp16, bf16 or fp32 (q and the cache
alike); scores, softmax and sums run in fp32; ``out`` comes back in q's dtype and ``lse``
(natural log of the softmax denominator over scaled scores) in fp32. A row that sees no
key gets ``out = 0`` and ``lse = -inf``.

Work is split into row tiles and request groups so one batched matmul materializes at
most about ``MAX_SCORE_ELEMENTS`` fp32 values; the loops run over tiles and groups,
never over tokens. Index values (slots, block ids, lengths) are checked here, on the
host; the Triton launchers check shapes, strides and dtypes only.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "AttentionOutput",
    "OwnBatch",
    "PrefixBatch",
    "chain_batch",
    "check_launch",
    "check_merge_parts",
    "check_scale",
    "check_store",
    "merge_attention_states",
    "own_attention",
    "own_batch",
    "prefix_attention",
    "prefix_batch",
    "store_kv",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# Most fp32 elements (scores plus gathered K/V) one batched step materializes: 64 MiB.
MAX_SCORE_ELEMENTS = 1 << 24


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
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache on {k_cache.device}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


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


# ---------------------------------------------------------------- core


def _head_rows(group: _Group, num_kv_heads: int) -> Tensor:
    """[P, kv, S] rows of a cache viewed as [-1, head_dim] holding the group's keys, KV
    head first (derived once per step and reused by every layer)."""
    key = ("head_rows", num_kv_heads)
    if key not in group.derived:
        head = torch.arange(num_kv_heads, device=group.slots.device)
        group.derived[key] = group.slots[:, None, :] * num_kv_heads + head[None, :, None]
    return group.derived[key]


def _gather_slots(cache: Tensor, group: _Group, contiguous: bool) -> Tensor:
    """Rows of one cache at the group's slots, KV head first, fp32.

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; group.slots: [P, S] int64
    returns [P, num_kv_heads, S, head_dim] float32: contiguous (one gather of head_dim
    rows, for plain matmuls) or a strided view of one gather of whole slots (for the
    fused kernel, which reads any strides).
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    slots = group.slots
    flat_slots = slots.flatten()  # [P * S]
    if contiguous and cache.is_contiguous():
        row_ids = _head_rows(group, num_kv_heads)  # [P, kv, S]
        gathered = cache.view(-1, head_dim).index_select(0, row_ids.flatten())
        return gathered.view(*row_ids.shape, head_dim).float()
    if cache.is_contiguous():
        rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    else:
        rows = cache[flat_slots // block_size, flat_slots % block_size]  # [P * S, kv, dim]
    return rows.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2).float()


def _group_queries(q: Tensor, group: _Group) -> Tensor:
    """The group's query rows, heads first: q [T, num_heads, head_dim] ->
    [P, num_heads, R, head_dim] float32 (a strided view of q when q is read in place)."""
    pieces, rows = group.row_index.shape
    picked = q if group.identity else q.index_select(0, group.row_index.flatten())  # [P * R, ...]
    return picked.view(pieces, rows, *q.shape[1:]).transpose(1, 2).float()


# Fused CPU flash attention that also returns the log-sum-exp (a private ATen op; the
# explicit path below is used where it is missing or the tensors are not on the CPU).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_reads_gqa() -> bool:
    """Whether the fused CPU op takes fewer K/V heads than query heads (newer torch)."""
    if _FLASH_CPU is None:
        return False
    try:
        q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
        out, _ = _FLASH_CPU(q, kv, kv, scale=1.0)
    except RuntimeError:
        return False
    return tuple(out.shape) == (1, 2, 1, 8)


_FLASH_GQA = _flash_reads_gqa()
# Non-causal attention of at most this many scores (pieces x heads x rows x keys) runs as
# plain matmuls: measured here, decode rows run 2-5x faster so than in the fused kernel.
SMALL_ATTENTION_ELEMENTS = 1 << 18


def _is_small(group: _Group, num_heads: int) -> bool:
    """Whether a group's attention runs as plain matmuls (see SMALL_ATTENTION_ELEMENTS)."""
    pieces, rows = group.row_index.shape
    return not group.causal and pieces * num_heads * rows * group.slots.shape[1] <= (
        SMALL_ATTENTION_ELEMENTS
    )


def _attend(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scale: float,
    bias: Tensor | None,
    causal: bool,
    small: bool,
) -> tuple[Tensor, Tensor]:
    """Softmax attention in fp32 per piece and head.

    queries: [P, heads, rows, dim]; keys, values: [P, kv_heads, keys, dim]; all fp32, any
             strides; query head h reads KV head h // (heads // kv_heads)
    bias:    [P, 1, rows or 1, keys] fp32, 0 where visible and -inf where masked, or None
    causal:  row i sees keys 0..i (rows == keys; applied besides any bias)
    small:   not causal and little work (``_is_small``): plain matmuls, keys contiguous
    Returns out [P, heads, rows, dim], lse [P, heads, rows]. Every valid row sees >= 1 key
    (rows that see none are padding, dropped by the caller).
    """
    pieces, num_heads, rows, head_dim = queries.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    if small:
        # Decode-sized: a few small matmuls cost less than the fused kernel's set-up. The
        # query heads of one KV head are packed into the rows, so K/V are read as they are.
        packed = queries.reshape(pieces, num_kv_heads, group * rows, head_dim)
        scores = torch.matmul(packed, keys.transpose(-1, -2)).mul_(scale)  # [P, kv, g * R, L]
        if bias is not None:  # [P, 1, R or 1, L]: the same for every head of the group
            scores = scores.view(pieces, num_kv_heads, group, rows, num_keys).add_(
                bias.unsqueeze(1)
            )
        scores = scores.view(pieces, num_kv_heads, group * rows, num_keys)
        top = scores.amax(dim=-1, keepdim=True)  # [P, kv, g * R, 1], finite: >= 1 key
        weights = scores.sub_(top).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        out = torch.matmul(weights, values).div_(total)  # [P, kv, g * R, dim]
        lse = top.add_(total.log_()).squeeze(-1)  # [P, kv, g * R]
        return out.view(pieces, num_heads, rows, head_dim), lse.view(pieces, num_heads, rows)
    on_cpu = _FLASH_CPU is not None and queries.device.type == "cpu"
    if group > 1 and not (on_cpu and _FLASH_GQA):
        keys = keys.repeat_interleave(group, dim=1)  # [P, heads, keys, dim]
        values = values.repeat_interleave(group, dim=1)
    if on_cpu:
        return _FLASH_CPU(queries, keys, values, is_causal=causal, attn_mask=bias, scale=scale)[:2]
    scores = torch.matmul(queries * scale, keys.transpose(-1, -2))  # [P, heads, rows, keys]
    if bias is not None:
        scores += bias
    if causal:
        rows, count = scores.shape[-2:]
        hidden = torch.ones(rows, count, dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [P, heads, rows]
    weights = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(weights, values), lse


# ---------------------------------------------------------------- public operations


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


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write this step's keys and values into the paged cache, in place.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k, v:             [T, num_kv_heads, head_dim], the cache's dtype and device
    slot_mapping:     [T] int64 (int32 accepted), distinct slots in
                      [0, num_blocks * block_size); token t goes to block
                      slot // block_size at offset slot % block_size.
    Only those T slots change; the cache may have any strides.
    """
    num_blocks, block_size = check_store(k_cache, v_cache, k, v, slot_mapping)
    _check_range("slot_mapping", slot_mapping, num_blocks * block_size)
    slots = slot_mapping.long()
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)  # one slot per row
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
        return
    block_ids, offsets = slots // block_size, slots % block_size  # [T], [T]
    k_cache[block_ids, offsets] = k
    v_cache[block_ids, offsets] = v


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
    # chain_batch only: [S, max_length] int64 cache slots of each segment's keys in order
    # (block_tables is then [S, 0]); the torch path reads any slot list, Triton does not.
    slot_tables: Tensor | None = None
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


def _check_blocks(name: str, blocks: list[int], length: int, block_size: int, num_blocks: int):
    needed = -(-length // block_size)
    if needed > len(blocks):
        raise ValueError(
            f"{name}: {length} tokens need {needed} blocks of {block_size} but it has {len(blocks)}"
        )
    for block in blocks[:needed]:
        if not 0 <= block < num_blocks:
            raise ValueError(f"{name} values must lie in [0, {num_blocks}), got {block}")
    return blocks[:needed]


def _table(rows: list[list[int]], device) -> Tensor:
    width = max((len(row) for row in rows), default=0)
    padded = [row + [0] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(rows), width)


def own_batch(
    query_start: Sequence[int] | Tensor,
    block_tables: Sequence[Sequence[int]] | Tensor,
    context_lens: Sequence[int] | Tensor,
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
) -> OwnBatch:
    """Validate one step's own-attention layout on the host and put it on ``device``.

    query_start:  B + 1 cumulative row counts from 0
    block_tables: B rows of block ids (entries past a request's used blocks are ignored)
    context_lens: B own lengths after this step, each >= the request's rows
    block_size, num_blocks: the cache's (block ids must lie in [0, num_blocks))
    """
    block_size = _check_count("block_size", block_size, 1)
    num_blocks = _check_count("num_blocks", num_blocks, 0)
    starts = _int_list("query_start", query_start, 1)
    tables = _int_list("block_tables", block_tables, 2)
    lengths = _int_list("context_lens", context_lens, 1)
    if len(starts) != len(tables) + 1:
        raise ValueError(
            f"query_start must have num_requests + 1 = {len(tables) + 1} entries "
            f"(block_tables has {len(tables)} rows), got {len(starts)}"
        )
    if len(lengths) != len(tables):
        raise ValueError(
            f"context_lens must have num_requests = {len(tables)} entries "
            f"(block_tables has {len(tables)} rows), got {len(lengths)}"
        )
    if starts[0] != 0:
        raise ValueError(f"query_start must run from 0, got {starts[0]}")
    counts = [end - start for start, end in zip(starts, starts[1:])]
    if min(counts, default=0) < 0:
        raise ValueError(f"query_start must be non-decreasing, got {starts}")
    used = []
    for b, (count, length, table) in enumerate(zip(counts, lengths, tables)):
        if length < count:
            raise ValueError(f"context_lens[{b}] = {length} must be >= its {count} query rows")
        used.append(_check_blocks(f"block_tables[{b}]", table, length, block_size, num_blocks))
    return OwnBatch(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        block_tables=_table(used, device),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        num_rows=starts[-1],
        block_size=block_size,
        num_blocks=num_blocks,
        max_query_rows=max(counts, default=0),
        max_context_len=max(lengths, default=0),
        host_query_start=tuple(starts),
        host_context_lens=tuple(lengths),
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
) -> PrefixBatch:
    """Validate one level of shared segments on the host and put it on ``device``.

    segment_rows:   per segment, the q rows that read it (each row in at most one segment)
    segment_blocks: per segment, its blocks in order (the last may be partly filled;
                    entries past ceil(length / block_size) are ignored)
    lengths:        per segment, its tokens (>= 0; 0 contributes nothing)
    num_rows:       T, rows of the q this batch will be used with
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
    for s, length in enumerate(sizes):
        if length < 0:
            raise ValueError(f"lengths[{s}] must be >= 0, got {length}")
    used = [
        _check_blocks(f"segment_blocks[{s}]", table, length, block_size, num_blocks)
        for s, (table, length) in enumerate(zip(tables, sizes))
    ]
    shape = {"num_rows": num_rows, "block_size": block_size, "num_blocks": num_blocks}
    return _segment_batch(row_lists, sizes, _table(used, device), None, device=device, **shape)


def _segment_batch(
    row_lists: list[list[int]],
    sizes: list[int],
    block_tables: Tensor,
    slot_tables: Tensor | None,
    *,
    num_rows: int,
    block_size: int,
    num_blocks: int,
    device: torch.device | str,
) -> PrefixBatch:
    """The PrefixBatch of prefix_batch and chain_batch, after checking that every row lies
    in [0, num_rows) and in at most one segment."""
    seen: set[int] = set()
    for s, rows in enumerate(row_lists):
        for row in rows:
            if not 0 <= row < num_rows:
                raise ValueError(f"segment_rows[{s}] values must lie in [0, {num_rows}), got {row}")
            if row in seen:
                raise ValueError(f"q row {row} is in two segments of one batch (segment {s})")
            seen.add(row)
    flat = [row for rows in row_lists for row in rows]
    starts = list(itertools.accumulate((len(rows) for rows in row_lists), initial=0))
    return PrefixBatch(
        rows=torch.tensor(flat, dtype=torch.int64, device=device),
        row_start=torch.tensor(starts, dtype=torch.int32, device=device),
        block_tables=block_tables,
        lengths=torch.tensor(sizes, dtype=torch.int32, device=device),
        num_rows=num_rows,
        block_size=block_size,
        num_blocks=num_blocks,
        max_segment_rows=max((len(rows) for rows in row_lists), default=0),
        max_length=max(sizes, default=0),
        host_rows=tuple(flat),
        host_row_start=tuple(starts),
        host_lengths=tuple(sizes),
        slot_tables=slot_tables,
    )


def chain_batch(
    chain_rows: Sequence[Sequence[int]],
    chain_segments: Sequence[Sequence[tuple[Sequence[int], int]]],
    *,
    num_rows: int,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
) -> PrefixBatch:
    """Every level of the segment chains in one batch (torch path only): like
    ``prefix_batch``, but each entry is a whole chain, its keys the tokens of its
    segments in order, so a row's shared prefix is one attention part however many
    levels it has.

    chain_rows:     per chain, the q rows that read it (each row in at most one chain)
    chain_segments: per chain, its segments outermost first, each (blocks, length)
    num_rows:       T, rows of the q this batch will be used with
    """
    num_rows = _check_count("num_rows", num_rows, 0)
    block_size = _check_count("block_size", block_size, 1)
    num_blocks = _check_count("num_blocks", num_blocks, 0)
    row_lists = _int_list("chain_rows", chain_rows, 2)
    if len(row_lists) != len(chain_segments):
        raise ValueError(
            f"chain_rows and chain_segments must have one entry per chain, got "
            f"{len(row_lists)} and {len(chain_segments)}"
        )
    slot_lists: list[list[int]] = []
    for c, segments in enumerate(chain_segments):
        slots: list[int] = []
        for blocks, length in segments:
            name = f"chain_segments[{c}]"
            blocks = _check_blocks(name, _int_list(name, blocks, 1), length, block_size, num_blocks)
            slots.extend(
                blocks[i // block_size] * block_size + i % block_size for i in range(length)
            )
        slot_lists.append(slots)
    sizes = [len(slots) for slots in slot_lists]
    no_blocks = torch.zeros((len(sizes), 0), dtype=torch.int32, device=device)
    slot_tables = _table(slot_lists, device).long()
    shape = {"num_rows": num_rows, "block_size": block_size, "num_blocks": num_blocks}
    return _segment_batch(row_lists, sizes, no_blocks, slot_tables, device=device, **shape)


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


# ---------------------------------------------------------------- padded groups


class _Piece(NamedTuple):
    """Query rows of one request or segment; the last row sees key_len keys."""

    table: int  # row of the batch's block_tables
    rows: tuple[int, ...]  # q row indices
    key_len: int


class _Group(NamedTuple):
    """Pieces padded to one shape, batched in one matmul (indices computed once per step)."""

    row_index: Tensor  # [P, R] q rows (padding reads row 0)
    row_valid: Tensor  # [P, R] bool
    rows: Tensor  # [N] the valid rows' q indices, in row_index[row_valid] order
    slots: Tensor  # [P, L] cache slots (padding keys read a written slot of the piece)
    bias: Tensor | None  # [P, 1, R or 1, L] fp32: 0 visible, -inf masked; None: none
    causal: bool  # row i of every piece sees keys 0..i (fresh chunks: R == L, no bias)
    valid_positions: Tensor | None  # [N] positions of the valid rows in row_index.flatten()
    identity: bool  # row_index.flatten() is 0 .. T-1: q is read and written in place
    derived: dict  # index tensors derived on first use (e.g. head-first gather rows)


# What one padded group costs beyond its arithmetic (a K/V gather, one fused attention
# call, a scatter), in score elements of work: measured here at ~150 us a group on the
# CPU, about the time of 2**17 score elements. Small pieces (decode rows) share a group
# even when padded more than 2x, because the padding costs less than a call of their own.
GROUP_OVERHEAD_ELEMENTS = 1 << 17


def _group_pieces(pieces: list[_Piece], num_heads: int, kv_elements: int) -> list[list[_Piece]]:
    """Group pieces of similar shape under the work budget.

    Pieces are sorted by (rows, key length) and taken greedily: a piece joins the current
    group while the group's padded work stays within twice its useful work plus one
    group's overhead (GROUP_OVERHEAD_ELEMENTS) and within MAX_SCORE_ELEMENTS. Work counts
    scores and gathered keys: key_len * (num_heads * rows + kv_elements) per piece, with
    kv_elements = 2 * num_kv_heads * head_dim per key.
    """
    pieces = sorted(pieces, key=lambda p: (len(p.rows), p.key_len))
    groups: list[list[_Piece]] = []
    max_rows = max_keys = useful = 0
    for piece in pieces:
        rows, keys = len(piece.rows), piece.key_len
        work = keys * (num_heads * rows + kv_elements)
        if groups:
            widest, longest = max(max_rows, rows), max(max_keys, keys)
            padded = (len(groups[-1]) + 1) * longest * (num_heads * widest + kv_elements)
            if padded <= MAX_SCORE_ELEMENTS and padded <= 2 * (useful + work) + (
                GROUP_OVERHEAD_ELEMENTS
            ):
                groups[-1].append(piece)
                max_rows, max_keys, useful = widest, longest, useful + work
                continue
        groups.append([piece])
        max_rows, max_keys, useful = rows, keys, work
    # In row order inside a group: one group of every row in order reads q in place.
    return [sorted(group, key=lambda p: p.rows[:1]) for group in groups]


def _pad_group(
    pieces: list[_Piece],
    block_tables: Tensor,
    block_size: int,
    causal: bool,
    num_rows: int,
    slot_tables: Tensor | None = None,
) -> _Group:
    device = block_tables.device

    def column(values) -> Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    counts = column(len(p.rows) for p in pieces)  # [P]
    key_len = column(p.key_len for p in pieces)  # [P]
    max_rows, max_keys = int(counts.max()), int(key_len.max())
    row_lists = [list(p.rows) + [0] * (max_rows - len(p.rows)) for p in pieces]
    row_index = torch.tensor(row_lists, dtype=torch.long, device=device)  # [P, R]
    row = torch.arange(max_rows, device=device)  # [R]
    key = torch.arange(max_keys, device=device)  # [L]
    row_valid = row < counts[:, None]  # [P, R]
    # Padding keys (past key_len) read position 0 instead: a written, finite token
    # whose score the mask drops. Stale slots (even NaN) and table padding are never read.
    key_position = torch.where(key < key_len[:, None], key, 0)  # [P, L]
    if slot_tables is not None:  # a chain batch: each piece's key slots are listed
        slots = slot_tables[column(p.table for p in pieces)].gather(1, key_position)  # [P, L]
    else:
        table = block_tables[column(p.table for p in pieces)].long()  # [P, max_blocks]
        block_ids = table.gather(1, key_position // block_size)  # [P, L]
        slots = block_ids * block_size + key_position % block_size  # [P, L]
    square = causal and all(len(p.rows) == p.key_len for p in pieces)
    if square:
        # Fresh chunks: row i sees own positions 0..i, padding rows and keys come last.
        hidden = None
    elif causal:
        # Row i of a piece sits at position key_len - rows + i.
        position = key_len[:, None] - counts[:, None] + row  # [P, R]
        hidden = key > position[:, :, None]  # [P, R, L]
    elif bool((key_len < max_keys).any()):
        hidden = (key >= key_len[:, None])[:, None, :]  # [P, 1, L]
    else:
        hidden = None
    bias = None
    if hidden is not None:
        zeros = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
        bias = zeros.masked_fill_(hidden, -math.inf).unsqueeze(1)
    flat_valid = row_valid.flatten()
    valid_positions = None if bool(flat_valid.all()) else flat_valid.nonzero().flatten()
    rows = row_index[row_valid]
    identity = valid_positions is None and [r for p in pieces for r in p.rows] == list(
        range(num_rows)
    )
    return _Group(row_index, row_valid, rows, slots, bias, square, valid_positions, identity, {})


def _run_groups(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, groups: list[_Group], scale: float
) -> AttentionOutput:
    num_rows, num_heads, head_dim = q.shape
    if len(groups) == 1 and groups[0].identity:  # one group holds every row, in order
        out = lse = None
    else:
        out = torch.zeros_like(q)  # [T, num_heads, head_dim]
        lse = torch.full((num_rows, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    for g in groups:
        small = _is_small(g, num_heads)
        keys = _gather_slots(k_cache, g, small)  # [P, kv, L, dim] fp32
        values = _gather_slots(v_cache, g, small)
        queries = _group_queries(q, g)  # [P, heads, R, dim] fp32
        group_out, group_lse = _attend(queries, keys, values, scale, g.bias, g.causal, small)
        # [P, heads, R, dim] -> [P * R, heads, dim]; [P, heads, R] -> [P * R, heads]
        group_out = group_out.transpose(1, 2).reshape(-1, num_heads, head_dim).to(q.dtype)
        group_lse = group_lse.transpose(1, 2).reshape(-1, num_heads)
        if g.valid_positions is not None:
            group_out = group_out.index_select(0, g.valid_positions)  # [N, heads, dim]
            group_lse = group_lse.index_select(0, g.valid_positions)
        if out is None:
            return AttentionOutput(group_out, group_lse)
        out.index_copy_(0, g.rows, group_out)
        lse.index_copy_(0, g.rows, group_lse)
    return AttentionOutput(out, lse)


def _tile_rows(longest: int, num_heads: int, kv_elements: int) -> int:
    return max(1, (MAX_SCORE_ELEMENTS // max(1, longest) - kv_elements) // num_heads)


def _groups(batch: OwnBatch | PrefixBatch, num_heads: int, num_kv_heads: int, head_dim: int):
    """The batch's padded groups (causal for an OwnBatch), derived on first use and cached
    in ``batch.derived`` for later layers."""
    key = ("reference", num_heads, num_kv_heads, head_dim)
    if key not in batch.derived:
        kv_elements = 2 * num_kv_heads * head_dim
        causal = isinstance(batch, OwnBatch)
        if causal:
            listed = _own_pieces(batch, _tile_rows(batch.max_context_len, num_heads, kv_elements))
        else:
            listed = _prefix_pieces(batch, _tile_rows(batch.max_length, num_heads, kv_elements))
        batch.derived[key] = [
            _pad_group(
                g,
                batch.block_tables,
                batch.block_size,
                causal,
                batch.num_rows,
                getattr(batch, "slot_tables", None),
            )
            for g in _group_pieces(listed, num_heads, kv_elements)
        ]
    return batch.derived[key]


def _own_pieces(batch: OwnBatch, tile: int) -> list[_Piece]:
    """Each request's rows in tiles; a tile's last row sees its own position + 1 keys."""
    starts, lengths = batch.host_query_start, batch.host_context_lens
    pieces = []
    for b, length in enumerate(lengths):
        first, count = starts[b], starts[b + 1] - starts[b]
        for offset in range(0, count, tile):
            rows = min(tile, count - offset)
            key_len = length - count + offset + rows
            pieces.append(_Piece(b, tuple(range(first + offset, first + offset + rows)), key_len))
    return pieces


def _prefix_pieces(batch: PrefixBatch, tile: int) -> list[_Piece]:
    """Each segment's rows in tiles, every row seeing the whole segment."""
    starts, rows = batch.host_row_start, batch.host_rows
    pieces = []
    for s, length in enumerate(batch.host_lengths):
        if length == 0:
            continue  # sees no key: out 0, lse -inf
        for first in range(starts[s], starts[s + 1], tile):
            pieces.append(_Piece(s, rows[first : min(first + tile, starts[s + 1])], length))
    return pieces


# ---------------------------------------------------------------- attention


def own_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: OwnBatch, scale: float
) -> AttentionOutput:
    """Each request's query rows against its own paged K/V, causal, variable length.

    q:       [T, num_heads, head_dim], T = batch.num_rows
    k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device, the
             shape the batch was built for, already holding this step's tokens (store_kv)
    batch:   OwnBatch from own_batch() (which rows are whose, block tables, lengths)
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32).

    Requests are cut into row tiles and batched in groups of similar shape (padded,
    masked), so decode rows run together in one matmul; the grouping and index tensors
    are derived once per batch and reused by every layer.
    """
    check_launch(q, k_cache, v_cache, batch, OwnBatch)
    scale = check_scale(scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    groups = _groups(batch, num_heads, k_cache.shape[2], head_dim)
    return _run_groups(q, k_cache, v_cache, groups, scale)


def prefix_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: PrefixBatch, scale: float
) -> AttentionOutput:
    """The query rows of every request sharing a prefix segment against ONE copy of its
    K/V, non-causal, for every segment of the batch.

    q:       [T, num_heads, head_dim], T = batch.num_rows; decode rows and prefill
             chunks alike
    k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device
    batch:   PrefixBatch from prefix_batch() or chain_batch()
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32);
    rows in no segment of the batch get out 0 and lse -inf.

    Each segment's K/V is read once for all rows of all its requests (one matrix-matrix
    product per head; the fused CPU kernel reads GQA K/V in place, decode-sized groups
    pack the query heads of one KV head into the rows); segments of similar length are
    batched together.
    """
    check_launch(q, k_cache, v_cache, batch, PrefixBatch)
    scale = check_scale(scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    groups = _groups(batch, num_heads, k_cache.shape[2], head_dim)
    return _run_groups(q, k_cache, v_cache, groups, scale)


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


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Merge attention results of the same query rows over disjoint key sets.

    parts: one or more (out [T, num_heads, head_dim], lse [T, num_heads]) pairs, outs of
           one dtype, all on one device; lse may be -inf where a part saw no key (its out
           there is ignored, even NaN).
    Returns AttentionOutput(out = sum_i exp(lse_i - lse) * out_i in the parts' out dtype,
    lse = logsumexp_i lse_i in fp32); rows where every part is -inf get out 0, lse -inf.
    """
    outs, lses = check_merge_parts(parts)
    lse_stack = torch.stack([lse.float() for lse in lses])  # [parts, T, heads]
    merged_lse = torch.logsumexp(lse_stack, dim=0)  # [T, heads]; -inf where all parts are
    shift = torch.where(torch.isneginf(merged_lse), torch.zeros_like(merged_lse), merged_lse)
    weights = torch.exp(lse_stack - shift)  # [parts, T, heads]; 0 where a part saw no key
    if bool((weights > 0).all()):  # every part weighs on every row: no out to ignore
        merged = outs[0].float() * weights[0].unsqueeze(-1)  # a new tensor: inputs stay
        for weight, out in zip(weights[1:], outs[1:]):
            merged.addcmul_(out.float(), weight.unsqueeze(-1))
        return AttentionOutput(merged.to(outs[0].dtype), merged_lse)
    merged = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for weight, out in zip(weights, outs):
        weight = weight.unsqueeze(-1)  # [T, heads, 1]
        merged += torch.where(weight > 0, weight * out.float(), 0.0)
    return AttentionOutput(merged.to(outs[0].dtype), merged_lse)
