"""Torch reference for the native engine's attention over a paged KV cache.

Shared-prefix attention (Hydragen, FlashInfer cascade, BatchLLM) splits a request's
attention over ``[shared prefix ; own tokens]`` into two parts over disjoint keys:

- ``prefix_attention``: the query rows of every request sharing one prefix segment,
  against ONE copy of that segment's K/V, non-causal (the prefix lies wholly before
  every row);
- ``own_attention``: each request's rows against its own K/V, causal;

and ``merge_attention_states`` combines the ``(out, lse)`` results by log-sum-exp.
These functions are the CPU path of the engine and the oracle for the Triton kernels
that will share their signatures.

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
host; the Triton launchers will check shapes, strides and dtypes only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "AttentionOutput",
    "merge_attention_states",
    "own_attention",
    "prefix_attention",
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


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


# ---------------------------------------------------------------- core


def _gather_slots(cache: Tensor, slots: Tensor) -> Tensor:
    """Rows of one cache at the given slots, KV head first, fp32 and contiguous (so the
    batched matmuls that follow get BLAS-friendly operands, with no copy inside matmul).

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; slots: [*S] int64
    returns [num_kv_heads, *S, head_dim] float32
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat_slots = slots.flatten()  # [S]
    if cache.is_contiguous():
        # One head_dim row per (slot, KV head); pick them KV head first in one pass.
        head = torch.arange(num_kv_heads, device=cache.device)
        row_ids = (head[:, None] + flat_slots[None, :] * num_kv_heads).flatten()  # [kv * S]
        gathered = cache.view(-1, head_dim).index_select(0, row_ids).float()
        return gathered.view(num_kv_heads, *slots.shape, head_dim)
    rows = cache[flat_slots // block_size, flat_slots % block_size]  # [S, kv, dim]
    gathered = torch.empty(
        (num_kv_heads, flat_slots.shape[0], head_dim), dtype=torch.float32, device=cache.device
    )
    gathered.copy_(rows.movedim(1, 0))  # one pass: transpose and convert to fp32
    return gathered.unflatten(1, slots.shape)


def _pack_heads(x: Tensor, num_kv_heads: int) -> Tensor:
    # x: [*batch, rows, num_heads, head_dim] -> [num_kv_heads, *batch, rows * group, head_dim]
    x = x.float().unflatten(-2, (num_kv_heads, -1))  # [*batch, rows, kv, group, dim]
    return x.movedim(-3, 0).flatten(-3, -2)


def _unpack_out(x: Tensor, rows: int) -> Tensor:
    # x: [num_kv_heads, *batch, rows * group, head_dim] -> [*batch, rows, num_heads, head_dim]
    x = x.unflatten(-2, (rows, -1))  # [kv, *batch, rows, group, dim]
    return x.movedim(0, -3).flatten(-3, -2)


def _unpack_lse(x: Tensor, rows: int) -> Tensor:
    # x: [num_kv_heads, *batch, rows * group] -> [*batch, rows, num_heads]
    x = x.unflatten(-1, (rows, -1))  # [kv, *batch, rows, group]
    return x.movedim(0, -2).flatten(-2, -1)


def _attend(
    queries: Tensor, keys: Tensor, values: Tensor, scale: float, visible: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Softmax attention in fp32. queries: [..., rows, dim]; keys, values: [..., keys, dim];
    visible: bool broadcastable to [..., rows, keys] (True = attend) or None."""
    scores = torch.matmul(queries * scale, keys.transpose(-1, -2))  # [..., rows, keys]
    if visible is not None:
        scores.masked_fill_(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [..., rows]
    # A row that sees no key has lse = -inf: shift it by 0 so its weights are exp(-inf) = 0.
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = scores.sub_(shift.unsqueeze(-1)).exp_()
    return torch.matmul(weights, values), lse


# ---------------------------------------------------------------- public operations


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write this step's keys and values into the paged cache, in place.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k, v:             [T, num_kv_heads, head_dim], the cache's dtype and device
    slot_mapping:     [T] int64 (int32 accepted), distinct slots in
                      [0, num_blocks * block_size); token t goes to block
                      slot // block_size at offset slot % block_size.
    Only those T slots change; the cache may have any strides.
    """
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
    _check_range("slot_mapping", slot_mapping, num_blocks * block_size)
    slots = slot_mapping.long()
    block_ids, offsets = slots // block_size, slots % block_size  # [T], [T]
    k_cache[block_ids, offsets] = k
    v_cache[block_ids, offsets] = v


def prefix_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    prefix_len: int,
    scale: float,
) -> AttentionOutput:
    """All query rows of the requests sharing one prefix segment against its K/V, non-causal.

    q:           [T, num_heads, head_dim], decode rows and prefill chunks alike; every
                 row sees all prefix_len tokens
    k_cache,
    v_cache:     [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device
    block_table: [num_segment_blocks] int32/int64, the segment's blocks in order; the
                 first ceil(prefix_len / block_size) are read (the last may be partly
                 filled), any further entries are ignored
    prefix_len:  tokens in the segment, >= 0 (0 gives out = 0, lse = -inf)
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32).

    GQA: the query heads of one KV head are packed into the row dimension
    (q -> [num_kv_heads, T * group, head_dim]), so the prefix K/V is read once for
    all rows of all requests, one matrix-matrix product per KV head.
    """
    num_blocks, block_size, num_kv_heads, _ = _check_kv_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    _check_index("block_table", block_table, 1, "[num_segment_blocks]", q.device)
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, numbers.Integral):
        raise TypeError(f"prefix_len must be an int, got {type(prefix_len).__name__}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    scale = _check_scale(scale)
    blocks_needed = -(-prefix_len // block_size)
    if blocks_needed > block_table.shape[0]:
        raise ValueError(
            f"prefix_len {prefix_len} needs {blocks_needed} blocks of {block_size} tokens "
            f"but block_table has {block_table.shape[0]}"
        )
    blocks = block_table[:blocks_needed].long()
    _check_range("block_table", blocks, num_blocks)

    num_rows, num_heads, _ = q.shape
    out = torch.zeros_like(q)  # [T, num_heads, head_dim]
    lse = torch.full((num_rows, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    if prefix_len == 0 or num_rows == 0:
        return AttentionOutput(out, lse)
    position = torch.arange(prefix_len, device=q.device)  # [L]
    slots = blocks[position // block_size] * block_size + position % block_size  # [L]
    # keys, values: [num_kv_heads, prefix_len, head_dim] fp32, gathered once for every row
    keys, values = _gather_slots(k_cache, slots), _gather_slots(v_cache, slots)
    tile_rows = max(1, MAX_SCORE_ELEMENTS // (num_heads * prefix_len))
    for start in range(0, num_rows, tile_rows):
        rows = min(tile_rows, num_rows - start)
        packed = _pack_heads(q[start : start + rows], num_kv_heads)  # [kv, rows * group, dim]
        tile_out, tile_lse = _attend(packed, keys, values, scale, None)
        out[start : start + rows] = _unpack_out(tile_out, rows).to(q.dtype)
        lse[start : start + rows] = _unpack_lse(tile_lse, rows)
    return AttentionOutput(out, lse)


class _Piece(NamedTuple):
    """Consecutive query rows of one request; its last row sees key_len own keys."""

    request: int
    first_row: int  # index into q
    rows: int
    key_len: int


def _plan_pieces(
    starts: list[int], context_lens: list[int], num_heads: int, kv_elements: int
) -> list[list[_Piece]]:
    """Cut requests into row tiles, then group tiles of similar shape under the budget.

    Tiles are bucketed by rows.bit_length() (padding wastes < 2x rows) and sorted by key
    length within a bucket; kv_elements = 2 * num_kv_heads * head_dim per key.
    """
    longest = max(context_lens, default=0)
    tile_rows = max(1, (MAX_SCORE_ELEMENTS // max(1, longest) - kv_elements) // num_heads)
    pieces = []
    for request, context_len in enumerate(context_lens):
        first, count = starts[request], starts[request + 1] - starts[request]
        for offset in range(0, count, tile_rows):
            rows = min(tile_rows, count - offset)
            key_len = context_len - count + offset + rows
            pieces.append(_Piece(request, first + offset, rows, key_len))
    pieces.sort(key=lambda piece: (piece.rows.bit_length(), piece.key_len))
    groups: list[list[_Piece]] = []
    max_rows = 0
    for piece in pieces:
        if groups and groups[-1][-1].rows.bit_length() == piece.rows.bit_length():
            rows = max(max_rows, piece.rows)
            cost = (len(groups[-1]) + 1) * piece.key_len * (num_heads * rows + kv_elements)
            if cost <= MAX_SCORE_ELEMENTS:
                groups[-1].append(piece)
                max_rows = rows
                continue
        groups.append([piece])
        max_rows = piece.rows
    return groups


def _own_group(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    pieces: list[_Piece],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of a group of pieces, padded to its largest; returns the valid rows' q
    indices [N], out [N, num_heads, head_dim] (q.dtype) and lse [N, num_heads] fp32."""
    device, block_size, num_kv_heads = q.device, k_cache.shape[1], k_cache.shape[2]

    def column(field: str) -> Tensor:
        return torch.tensor([getattr(p, field) for p in pieces], dtype=torch.long, device=device)

    request, first_row, rows, key_len = (column(f) for f in _Piece._fields)  # [P] each
    max_rows, max_keys = int(rows.max()), int(key_len.max())
    row = torch.arange(max_rows, device=device)  # [R]
    key = torch.arange(max_keys, device=device)  # [L]
    row_valid = row < rows[:, None]  # [P, R]
    row_index = torch.where(row_valid, first_row[:, None] + row, 0)  # [P, R]
    # Padding keys (past key_len) read own position 0 instead: a written, finite token
    # whose score the mask drops. Stale slots (even NaN) and table padding are never read.
    key_position = torch.where(key < key_len[:, None], key, 0)  # [P, L]
    table = block_tables[request].long()  # [P, max_blocks]
    block_ids = table.gather(1, key_position // block_size)  # [P, L]
    slots = block_ids * block_size + key_position % block_size  # [P, L]
    keys, values = _gather_slots(k_cache, slots), _gather_slots(v_cache, slots)  # [kv, P, L, dim]
    # Causal: row i of a piece sits at own position key_len - rows + i.
    position = key_len[:, None] - rows[:, None] + row  # [P, R]
    visible = (key <= position[:, :, None]) & row_valid[:, :, None]  # [P, R, L]
    group = q.shape[1] // num_kv_heads
    visible = visible.repeat_interleave(group, dim=1)  # [P, R * group, L]
    packed = _pack_heads(q[row_index], num_kv_heads)  # [kv, P, R * group, dim]
    out, lse = _attend(packed, keys, values, scale, visible)
    out, lse = _unpack_out(out, max_rows), _unpack_lse(lse, max_rows)  # [P, R, heads, (dim)]
    return row_index[row_valid], out[row_valid].to(q.dtype), lse[row_valid]


def own_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> AttentionOutput:
    """Each request's query rows against its own paged K/V, causal, variable length.

    q:            [T, num_heads, head_dim]; request b owns rows
                  query_start[b]:query_start[b + 1] (n_b rows, possibly 0)
    k_cache,
    v_cache:      [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device,
                  already holding this step's new tokens (store_kv)
    query_start:  [B + 1] int32/int64, cumulative: query_start[0] = 0, query_start[B] = T
    block_tables: [B, max_blocks] int32/int64, request b's own blocks in order; entries
                  past its ceil(context_lens[b] / block_size) used blocks may hold any value
    context_lens: [B] int32/int64, own K/V length after this step, n_b <= it <=
                  max_blocks * block_size
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32).

    Row j of request b sits at own position context_lens[b] - n_b + j and attends own
    positions 0 .. that position. Requests are cut into row tiles and batched in groups
    of similar shape (padded, masked), so decode rows run together in one step.
    """
    num_blocks, block_size, num_kv_heads, head_dim = _check_kv_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    device = q.device
    _check_index("block_tables", block_tables, 2, "[num_requests, max_blocks]", device)
    num_requests, max_blocks = block_tables.shape
    _check_index("query_start", query_start, 1, "[num_requests + 1]", device)
    _check_index("context_lens", context_lens, 1, "[num_requests]", device)
    if query_start.shape[0] != num_requests + 1:
        raise ValueError(
            f"query_start must have num_requests + 1 = {num_requests + 1} entries "
            f"(block_tables has {num_requests} rows), got {query_start.shape[0]}"
        )
    if context_lens.shape[0] != num_requests:
        raise ValueError(
            f"context_lens must have num_requests = {num_requests} entries "
            f"(block_tables has {num_requests} rows), got {context_lens.shape[0]}"
        )
    scale = _check_scale(scale)
    starts, lengths = query_start.tolist(), context_lens.tolist()
    num_rows, num_heads, _ = q.shape
    if starts[0] != 0 or starts[-1] != num_rows:
        raise ValueError(
            f"query_start must run from 0 to q's {num_rows} rows, got {starts[0]} .. {starts[-1]}"
        )
    counts = [end - start for start, end in zip(starts, starts[1:])]
    if min(counts, default=0) < 0:
        raise ValueError(f"query_start must be non-decreasing, got {starts}")
    for request, (count, length) in enumerate(zip(counts, lengths)):
        if not count <= length <= max_blocks * block_size:
            raise ValueError(
                f"context_lens[{request}] = {length} must be >= its {count} query rows and "
                f"<= max_blocks * block_size = {max_blocks * block_size}"
            )
    blocks_used = (context_lens.long() + block_size - 1) // block_size  # [B]
    used = torch.arange(max_blocks, device=device) < blocks_used[:, None]  # [B, max_blocks]
    _check_range("block_tables (used entries)", block_tables[used], num_blocks)

    out = torch.zeros_like(q)  # [T, num_heads, head_dim]
    lse = torch.full((num_rows, num_heads), -math.inf, dtype=torch.float32, device=device)
    kv_elements = 2 * num_kv_heads * head_dim
    for pieces in _plan_pieces(starts, lengths, num_heads, kv_elements):
        rows, group_out, group_lse = _own_group(q, k_cache, v_cache, block_tables, pieces, scale)
        out[rows] = group_out
        lse[rows] = group_lse
    return AttentionOutput(out, lse)


def merge_attention_states(parts: Sequence[tuple[Tensor, Tensor]]) -> AttentionOutput:
    """Merge attention results of the same query rows over disjoint key sets.

    parts: one or more (out [T, num_heads, head_dim], lse [T, num_heads]) pairs, outs of
           one dtype, all on one device; lse may be -inf where a part saw no key (its out
           there is ignored, even NaN).
    Returns AttentionOutput(out = sum_i exp(lse_i - lse) * out_i in the parts' out dtype,
    lse = logsumexp_i lse_i in fp32); rows where every part is -inf get out 0, lse -inf.
    """
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
    lse_stack = torch.stack([lse.float() for lse in lses])  # [parts, T, heads]
    merged_lse = torch.logsumexp(lse_stack, dim=0)  # [T, heads]; -inf where all parts are
    shift = torch.where(torch.isneginf(merged_lse), torch.zeros_like(merged_lse), merged_lse)
    weights = torch.exp(lse_stack - shift)  # [parts, T, heads]; 0 where a part saw no key
    merged = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for weight, out in zip(weights, outs):
        weight = weight.unsqueeze(-1)  # [T, heads, 1]
        merged += torch.where(weight > 0, weight * out.float(), 0.0)
    return AttentionOutput(merged.to(outs[0].dtype), merged_lse)
