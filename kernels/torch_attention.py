"""Torch attention over a paged KV cache: the engine's CPU fallback path, and the
oracle of the Triton and compiled CPU kernels.

Shared-prefix attention (Hydragen, FlashInfer cascade, BatchLLM) splits a request's
attention over ``[shared prefix ; own tokens]`` into two parts over disjoint keys:

- ``prefix_attention``: the query rows of every request sharing one prefix segment,
  against ONE copy of that segment's K/V, non-causal (the prefix lies wholly before
  every row);
- ``own_attention``: each request's rows against its own K/V, causal;

and ``merge_attention_states`` combines the ``(out, lse)`` results by log-sum-exp;
``store_kv`` writes a step's K/V into the cache. The engine runs them where no faster
kernel applies (CPU tensors the compiled CPU kernels do not take or could not be built
for, a device whose Triton kernels failed their self-check, ``kernels="torch"``); the
Triton kernels (``triton_attention.py``) share their signatures and semantics.

The cache layout, the step's batches (``OwnBatch``, ``PrefixBatch``), GQA, the dtypes
and the argument checks are in ``layout.py``.

Work is split into row tiles and request groups so one batched matmul materializes at
most about ``MAX_SCORE_ELEMENTS`` fp32 values; the loops run over tiles and groups,
never over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from llm_operator.kernels.layout import (
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    _check_range,
    check_launch,
    check_merge_parts,
    check_scale,
    check_store,
)

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "merge_attention_states",
    "own_attention",
    "prefix_attention",
    "store_kv",
]

# Most fp32 elements (scores plus gathered K/V) one batched step materializes: 64 MiB.
MAX_SCORE_ELEMENTS = 1 << 24


# ---------------------------------------------------------------- core


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
        # [P, kv, S] rows of cache.view(-1, head_dim), derived once per step for every layer
        key = ("head_rows", num_kv_heads)
        if key not in group.derived:
            head = torch.arange(num_kv_heads, device=slots.device)
            group.derived[key] = slots[:, None, :] * num_kv_heads + head[None, :, None]
        row_ids = group.derived[key]
        gathered = cache.view(-1, head_dim).index_select(0, row_ids.flatten())
        return gathered.view(*row_ids.shape, head_dim).float()
    if cache.is_contiguous():
        rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    else:
        rows = cache[flat_slots // block_size, flat_slots % block_size]  # [P * S, kv, dim]
    return rows.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2).float()


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


def _attend(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scale: float,
    bias: Tensor | None,
    causal: bool,
    small: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention in fp32 per piece and head.

    queries: [P, heads, rows, dim]; keys, values: [P, kv_heads, keys, dim]; all fp32, any
             strides; query head h reads KV head h // (heads // kv_heads)
    bias:    [P, 1, rows or 1, keys] fp32, 0 where visible and -inf where masked, or None
    causal:  row i sees keys 0..i (rows == keys; applied besides any bias)
    small:   not causal, at most SMALL_ATTENTION_ELEMENTS scores: plain matmuls, keys contiguous
    softcap: scaled scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)
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
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
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
    on_cpu = _FLASH_CPU is not None and queries.device.type == "cpu" and softcap is None
    if group > 1 and not (on_cpu and _FLASH_GQA):
        keys = keys.repeat_interleave(group, dim=1)  # [P, heads, keys, dim]
        values = values.repeat_interleave(group, dim=1)
    if on_cpu:
        return _FLASH_CPU(queries, keys, values, is_causal=causal, attn_mask=bias, scale=scale)[:2]
    if softcap is None:
        scores = torch.matmul(queries * scale, keys.transpose(-1, -2))  # [P, heads, rows, keys]
    else:  # as HF: scaled scores, then capped
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
        scores = scores.div_(softcap).tanh_().mul_(softcap)
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


# ---------------------------------------------------------------- padded groups


class _Piece(NamedTuple):
    """Query rows of one request or segment; the last row sees key_len keys."""

    table: int  # row of the batch's block_tables
    rows: tuple[int, ...]  # q row indices
    key_len: int
    # sliding window: each row's first visible key (None: key 0); the keys before the
    # lowest are not read at all
    lows: tuple[int, ...] | None = None


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
) -> _Group:
    device = block_tables.device

    def column(values) -> Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    counts = column(len(p.rows) for p in pieces)  # [P]
    key_len = column(p.key_len for p in pieces)  # [P]
    windowed = any(p.lows is not None for p in pieces)
    # the first key each piece reads (its lowest row's window start; 0 without a window)
    begin = column(max(0, min(p.lows)) if p.lows else 0 for p in pieces)  # [P]
    span = key_len - begin  # [P] keys read
    max_rows, max_keys = int(counts.max()), int(span.max())
    row_lists = [list(p.rows) + [0] * (max_rows - len(p.rows)) for p in pieces]
    row_index = torch.tensor(row_lists, dtype=torch.long, device=device)  # [P, R]
    row = torch.arange(max_rows, device=device)  # [R]
    key = torch.arange(max_keys, device=device)  # [L]
    absolute = begin[:, None] + key  # [P, L] the key's index in the piece's keys
    row_valid = row < counts[:, None]  # [P, R]
    # Padding keys (past key_len) read the first key read instead: a written, finite token
    # whose score the mask drops. Stale slots (even NaN) and table padding are never read.
    key_position = torch.where(key < span[:, None], absolute, begin[:, None])  # [P, L]
    table = block_tables[column(p.table for p in pieces)].long()  # [P, max_blocks]
    block_ids = table.gather(1, key_position // block_size)  # [P, L]
    slots = block_ids * block_size + key_position % block_size  # [P, L]
    square = causal and not windowed and all(len(p.rows) == p.key_len for p in pieces)
    hidden = None  # square (fresh chunks): row i sees own positions 0..i, padding comes last
    if causal and not square:
        # Row i of a piece sits at position key_len - rows + i.
        position = key_len[:, None] - counts[:, None] + row  # [P, R]
        hidden = absolute[:, None, :] > position[:, :, None]  # [P, R, L]
    elif not causal and bool((span < max_keys).any()):
        hidden = (key >= span[:, None])[:, None, :]  # [P, 1, L]
    if windowed:  # keys before a row's window start are masked too
        lows = [list(p.lows or [0] * len(p.rows)) for p in pieces]
        low = torch.tensor([r + [0] * (max_rows - len(r)) for r in lows], device=device)
        before = absolute[:, None, :] < low[:, :, None]  # [P, R, L]
        hidden = before if hidden is None else hidden | before
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
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    groups: list[_Group],
    scale: float,
    softcap: float | None = None,
) -> AttentionOutput:
    num_rows, num_heads, head_dim = q.shape
    if len(groups) == 1 and groups[0].identity:  # one group holds every row, in order
        out = lse = None
    else:
        out = torch.zeros_like(q)  # [T, num_heads, head_dim]
        lse = torch.full((num_rows, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    for g in groups:
        pieces, rows = g.row_index.shape
        scores = pieces * num_heads * rows * g.slots.shape[1]
        small = not g.causal and scores <= SMALL_ATTENTION_ELEMENTS  # plain matmuls
        keys = _gather_slots(k_cache, g, small)  # [P, kv, L, dim] fp32
        values = _gather_slots(v_cache, g, small)
        # the group's rows, heads first (a strided view of q when q is read in place)
        picked = q if g.identity else q.index_select(0, g.row_index.flatten())  # [P * R, ...]
        queries = picked.view(pieces, rows, num_heads, head_dim).transpose(1, 2).float()
        group_out, group_lse = _attend(
            queries, keys, values, scale, g.bias, g.causal, small, softcap
        )
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


def _groups(batch: OwnBatch | PrefixBatch, num_heads: int, num_kv_heads: int, head_dim: int):
    """The batch's padded groups (causal for an OwnBatch), derived on first use and cached
    in ``batch.derived`` for later layers."""
    key = ("torch", num_heads, num_kv_heads, head_dim)
    if key not in batch.derived:
        kv_elements = 2 * num_kv_heads * head_dim
        causal = isinstance(batch, OwnBatch)
        pieces, longest = (
            (_own_pieces, batch.max_context_len) if causal else (_prefix_pieces, batch.max_length)
        )
        tile = max(1, (MAX_SCORE_ELEMENTS // max(1, longest) - kv_elements) // num_heads)
        listed = pieces(batch, tile)
        batch.derived[key] = [
            _pad_group(g, batch.block_tables, batch.block_size, causal, batch.num_rows)
            for g in _group_pieces(listed, num_heads, kv_elements)
        ]
    return batch.derived[key]


def _own_pieces(batch: OwnBatch, tile: int) -> list[_Piece]:
    """Each request's rows in tiles; a tile's last row sees its own position + 1 keys."""
    starts, lengths, window = batch.host_query_start, batch.host_context_lens, batch.window
    pieces = []
    for b, length in enumerate(lengths):
        first, count = starts[b], starts[b + 1] - starts[b]
        for offset in range(0, count, tile):
            rows = min(tile, count - offset)
            key_len = length - count + offset + rows
            lows = None
            if window and key_len > window:  # row i sits at key_len - rows + i
                lows = tuple(range(key_len - rows - window + 1, key_len - window + 1))
            rows_of = tuple(range(first + offset, first + offset + rows))
            pieces.append(_Piece(b, rows_of, key_len, lows))
    return pieces


def _prefix_pieces(batch: PrefixBatch, tile: int) -> list[_Piece]:
    """Each segment's rows in tiles, every row seeing the whole segment."""
    starts, rows, firsts = batch.host_row_start, batch.host_rows, batch.host_key_start
    pieces = []
    for s, length in enumerate(batch.host_lengths):
        if length == 0:
            continue  # sees no key: out 0, lse -inf
        # sliding window: rows that see none of the segment are left out (out 0, lse -inf)
        seen = [i for i in range(starts[s], starts[s + 1]) if firsts is None or firsts[i] < length]
        for first in range(0, len(seen), tile):
            tile_of = seen[first : first + tile]
            lows = None if firsts is None else tuple(firsts[i] for i in tile_of)
            rows_of = tuple(rows[i] for i in tile_of)
            pieces.append(_Piece(s, rows_of, length, lows if lows and max(lows) > 0 else None))
    return pieces


# ---------------------------------------------------------------- attention


def own_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: OwnBatch,
    scale: float,
    softcap: float | None = None,
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
    return _attention(q, k_cache, v_cache, batch, OwnBatch, scale, softcap)


def prefix_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PrefixBatch,
    scale: float,
    softcap: float | None = None,
) -> AttentionOutput:
    """The query rows of every request sharing a prefix segment against ONE copy of its
    K/V, non-causal, for every segment of the batch.

    q:       [T, num_heads, head_dim], T = batch.num_rows; decode rows and prefill
             chunks alike
    k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device
    batch:   PrefixBatch from prefix_batch()
    Returns AttentionOutput(out [T, num_heads, head_dim] q.dtype, lse [T, num_heads] fp32);
    rows in no segment of the batch get out 0 and lse -inf.

    Each segment's K/V is read once for all rows of all its requests (one matrix-matrix
    product per head; the fused CPU kernel reads GQA K/V in place, decode-sized groups
    pack the query heads of one KV head into the rows); segments of similar length are
    batched together.
    """
    return _attention(q, k_cache, v_cache, batch, PrefixBatch, scale, softcap)


def _attention(q, k_cache, v_cache, batch, kind: type, scale, softcap) -> AttentionOutput:
    check_launch(q, k_cache, v_cache, batch, kind)
    scale = check_scale(scale)
    groups = _groups(batch, q.shape[1], k_cache.shape[2], q.shape[2])
    return _run_groups(q, k_cache, v_cache, groups, scale, softcap)


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
