"""One iteration's inputs from the scheduler's chunks, built with arrays, not lists of ints.

A decode step over a thousand rows changes one KV slot per row, so the host state that
describes the running rows is kept between steps (``StepBuilder``) and only updated:

    table   [rows, width] int32: one row per running sequence, its KV block ids in order;
            a sequence's row is written only where it gained blocks since the last step
            (a preemption replaces its block list: the row is then written again)

Everything else of a step (token ids, positions, KV slots, the own-attention layout and one
shared-prefix batch per level of the segment chains) is computed from the chunks' starts
and lengths with numpy, then validated once (``kernels.own_batch_arrays``,
``kernels.prefix_batch_arrays``) and put on the device, where every layer reads it
(``LayerAttention``: the forward's attention callback over that layout).

Region map of a step's token axis (``StepBatch``)::

    [ chunk 0 tokens | chunk 1 tokens | ... ]   chunk c: query_start[c] .. query_start[c + 1]
      own position i of chunk c sits at row query_start[c] + i - start[c]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_operator import kernels
from llm_operator.engine.native.sequence import KVSequence, ScheduledChunk
from llm_operator.kernels import device_tensor


@dataclass
class SegmentLevel:
    """One level of the step's segment chains, as host arrays (``kernels.prefix_batch_arrays``):
    segment s is read by q rows ``rows[row_start[s]:row_start[s + 1]]``."""

    segment_ids: np.ndarray  # [S] plan segment ids, ascending
    rows: np.ndarray  # [N] int64 q rows, grouped by segment
    row_start: np.ndarray  # [S + 1] int64
    tables: np.ndarray  # [S, width] int32 block ids
    lengths: np.ndarray  # [S] int64 tokens
    starts: np.ndarray  # [S] int64 position of each segment's first token (its chain's sum)


@dataclass
class HostStep:
    """One iteration's inputs as host arrays (``StepBuilder.plan``), before any device copy."""

    chunks: Sequence[ScheduledChunk]
    sampled: list[ScheduledChunk]  # the chunks that sample, in chunk (and last_rows) order
    num_tokens: int
    input_ids: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    slots: np.ndarray  # [tokens] int64 KV cache slots
    last_rows: np.ndarray  # [sampled] int64 token rows whose logits are sampled
    query_start: np.ndarray  # [chunks + 1] int64
    own_tables: np.ndarray  # [chunks, width] int32 each chunk's own blocks
    context_lens: np.ndarray  # [chunks] int64 own tokens after the step
    chains: list[tuple[int, ...]]  # distinct non-empty chains
    chain_ids: np.ndarray  # [chunks] index into chains, -1 for none
    levels: list[SegmentLevel]  # one per chain level
    # [n, 2] int64 (source, destination) KV blocks to copy before the step (tail copies)
    copies: np.ndarray | None = None

    @property
    def decode_only(self) -> bool:
        """Every chunk one token, every chunk sampled."""
        return self.num_tokens == len(self.chunks) == len(self.sampled)


@dataclass
class StepBatch:
    """One iteration's inputs on the device, built once and read by every layer."""

    input_ids: torch.Tensor  # [tokens] int64: every scheduled chunk's tokens, packed
    positions: torch.Tensor  # [tokens] int64: each token's position in its sequence
    step: kernels.AttentionStep  # the step's attention layout (the compiled decoder's input)
    last_rows: torch.Tensor  # [sampled chunks] int64: the row whose logits are sampled
    num_tokens: int
    sampled: list[ScheduledChunk]  # the chunks that sample, in chunk (and last_rows) order
    # the sliding-window layers' layout (``StepBuilder(window=...)``): ``step`` itself where
    # no row of the step reaches past its window
    window_step: kernels.AttentionStep | None = None


class LayerAttention:
    """The eager forward's attention over one step's layout (``LlamaModel``'s attention
    callback): ``attention(layer, q, k, v)`` stores the step's k, v and returns each row's
    attention over its own K/V and its shared segments, merged.

    It also offers the split the fused QKV + RoPE + K/V store takes (``DecoderLayer`` with
    ``fused_store``, on the Triton kernels' reference cache layout): ``cache(layer)`` gives
    the layer's (k_cache, v_cache, slot_mapping) to store into, then ``attend(layer, q)``
    attends without storing."""

    def __init__(
        self,
        step: kernels.AttentionStep,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        scale: float,
        window_step: kernels.AttentionStep | None = None,
        sliding: Sequence[bool] = (),
    ) -> None:
        """window_step: the layout of the layers marked in ``sliding`` (sliding-window
        attention, ``StepBatch.window_step``); the others take ``step``."""
        self.step, self.k_caches, self.v_caches, self.scale = step, k_caches, v_caches, scale
        self.steps = [
            window_step if window_step is not None and slides else step for slides in sliding
        ]

    def _step(self, layer: int) -> kernels.AttentionStep:
        return self.steps[layer] if layer < len(self.steps) else self.step

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return self._step(layer)(q, k, v, self.k_caches[layer], self.v_caches[layer], self.scale)

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_caches[layer], self.v_caches[layer], self.step.slot_mapping

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        step = self._step(layer)
        return step.attend(q, self.k_caches[layer], self.v_caches[layer], self.scale)


class StepBuilder:
    """Builds ``StepBatch``es for one run, keeping each running sequence's block table row.

    Contract: ``build(chunks)`` reads each chunk's sequence (``blocks``, ``tokens``,
    ``prefix_length``, ``chain``) as the scheduler left it for this iteration, and the
    READY segments through ``segment_blocks(segment_id)`` / ``segment_length(segment_id)``.
    ``release(seq)`` returns a finished sequence's table row (call it when the scheduler
    finishes or rejects a request that ran). Not thread-safe; one per run.
    """

    def __init__(
        self,
        *,
        block_size: int,
        pool_blocks: int,
        device: torch.device,
        implementation: str,
        segment_blocks: Callable[[int], Sequence[int]],
        segment_length: Callable[[int], int],
        invariant: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """invariant: the compiled CPU attention in its batch-invariant mode
        (``AttentionStep(invariant=True)``; the other implementations have none).
        window: the model's sliding window, if any layer has one: each step then also
        builds those layers' layout (``StepBatch.window_step``). softcap: the attention
        scores' soft cap (``AttentionStep.softcap``; the torch kernels only)."""
        self.invariant = invariant
        self.window, self.softcap = window, softcap
        self.block_size = block_size
        self.pool_blocks = pool_blocks  # the cache's blocks (>= the run's: a pool is reused)
        self.device = device
        self.implementation = implementation
        self.segment_blocks = segment_blocks
        self.segment_length = segment_length
        self.table = np.zeros((64, 8), dtype=np.int32)
        self._free_rows = list(range(63, -1, -1))  # pop() yields the lowest row

    # -- the persistent block table ------------------------------------------------------
    def release(self, seq: KVSequence) -> None:
        """The sequence will not run again: its table row is free for another."""
        if seq.table_row >= 0:
            self._free_rows.append(seq.table_row)
            seq.table_row, seq.synced_blocks, seq.synced_count = -1, None, 0

    def _sync(self, seq: KVSequence) -> None:
        """Copy the blocks ``seq`` gained since its last step into its table row."""
        if seq.table_row < 0:
            if not self._free_rows:
                old = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            seq.table_row = self._free_rows.pop()
            seq.synced_blocks = None
        blocks = seq.blocks
        first = seq.synced_count if blocks is seq.synced_blocks else 0
        if len(blocks) > self.table.shape[1]:
            width = max(len(blocks), 2 * self.table.shape[1])
            grown = np.zeros((self.table.shape[0], width), dtype=np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        self.table[seq.table_row, first : len(blocks)] = blocks[first:]
        seq.synced_blocks, seq.synced_count = blocks, len(blocks)

    # -- a step ------------------------------------------------------------------------
    def build(self, chunks: Sequence[ScheduledChunk]) -> StepBatch:
        """``to_device(plan(chunks))``."""
        return self.to_device(self.plan(chunks))

    def plan(
        self, chunks: Sequence[ScheduledChunk], copies: Sequence[tuple[int, int]] = ()
    ) -> HostStep:
        """The step's token-packed inputs and attention layout on the host (see the module
        docstring); ``copies``: the scheduler's block copies to make before it."""
        count = len(chunks)
        # one comprehension per field: a thousand decode rows cost ~0.1 ms a field
        seqs = [chunk[0] for chunk in chunks]
        for seq in seqs:
            if seq.blocks is not seq.synced_blocks or len(seq.blocks) != seq.synced_count:
                self._sync(seq)
        table_rows = [seq.table_row for seq in seqs]
        starts = [chunk[1] for chunk in chunks]
        lengths = [chunk[2] for chunk in chunks]
        prefixes = [seq.prefix_length for seq in seqs]
        if max(lengths, default=1) == 1:
            ids = [seq.tokens[start] for seq, start in zip(seqs, starts)]
        else:
            ids = [
                token
                for seq, start, length in zip(seqs, starts, lengths)
                for token in seq.tokens[start : start + length]
            ]
        chain_index = {(): -1}
        for chain in {seq.chain for seq in seqs}:
            if chain:
                chain_index[chain] = len(chain_index) - 1
        chain_ids = [chain_index[seq.chain] for seq in seqs]
        sample_at = [c for c, chunk in enumerate(chunks) if chunk[3]]
        sampled = [chunks[c] for c in sample_at]
        bs = self.block_size
        rows_np = np.array(table_rows, dtype=np.int64)
        start_np = np.array(starts, dtype=np.int64)
        length_np = np.array(lengths, dtype=np.int64)
        query_start = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(length_np, out=query_start[1:])
        tokens = int(query_start[-1])
        # own position of every token, and the chunk it belongs to
        if tokens == count:  # decode-only: one token per chunk
            chunk_of = np.arange(count)
            own = start_np
        else:
            chunk_of = np.repeat(np.arange(count), length_np)
            own = np.arange(tokens) - query_start[:-1][chunk_of] + start_np[chunk_of]
        table = self.table
        chains = list(chain_index)[1:]  # distinct non-empty chains, by index
        chain_array = np.array(chain_ids, dtype=np.int64)
        return HostStep(
            chunks=chunks,
            sampled=sampled,
            num_tokens=tokens,
            input_ids=np.array(ids, dtype=np.int64),
            positions=own + np.array(prefixes, dtype=np.int64)[chunk_of],
            slots=table[rows_np[chunk_of], own // bs].astype(np.int64) * bs + own % bs,
            last_rows=query_start[1:][np.array(sample_at, dtype=np.int64)] - 1,
            query_start=query_start,
            own_tables=table[rows_np],
            context_lens=start_np + length_np,
            chains=chains,
            chain_ids=chain_array,
            levels=self._levels(chains, chain_array, query_start),
            copies=np.array(copies, dtype=np.int64).reshape(-1, 2) if copies else None,
        )

    def to_device(self, host: HostStep) -> StepBatch:
        """The step's tensors on the device, its layout validated (one copy per array)."""
        device = self.device
        shape = {"block_size": self.block_size, "num_blocks": self.pool_blocks, "device": device}
        own_batch = kernels.own_batch_arrays(
            host.query_start, host.own_tables, host.context_lens, **shape
        )
        num_rows = host.num_tokens
        prefix_batches = [
            kernels.prefix_batch_arrays(
                level.rows, level.row_start, level.tables, level.lengths, num_rows=num_rows, **shape
            )
            for level in host.levels
        ]
        slots = device_tensor(host.slots, device)
        step = self._attention_step(own_batch, prefix_batches, slots)
        window_step = None
        if self.window is not None:
            window_step = step
            if host.num_tokens and int(host.positions.max()) >= self.window:
                window_step = self._window_step(host, own_batch, prefix_batches, slots)
        return StepBatch(
            input_ids=device_tensor(host.input_ids, device),
            positions=device_tensor(host.positions, device),
            step=step,
            last_rows=device_tensor(host.last_rows, device),
            num_tokens=num_rows,
            sampled=host.sampled,
            window_step=window_step,
        )

    def _window_step(self, host: HostStep, own_batch, prefix_batches, slots):
        """The sliding-window layers' step (``kernels.windowed``): a segment that lies wholly
        before a row's window is left out of that row's batch, but in the batch-invariant
        CPU mode, whose items must stay those of the full layout (the kernel then skips it)."""
        starts = [level.starts for level in host.levels]
        keep_all = self.invariant and self.implementation == "cpp"
        own, prefixes = kernels.windowed(
            own_batch, prefix_batches, host.positions, starts, self.window, drop=not keep_all
        )
        return self._attention_step(own, prefixes, slots)

    def _attention_step(self, own, prefixes, slots) -> kernels.AttentionStep:
        options = {"invariant": self.invariant, "softcap": self.softcap}
        return kernels.AttentionStep(self.implementation, own, prefixes, slots, **options)

    def _levels(
        self, chains: list[tuple[int, ...]], chain_ids: np.ndarray, query_start: np.ndarray
    ) -> list[SegmentLevel]:
        """One ``SegmentLevel`` per level of the chains (a row reads at most one segment a
        level)."""
        if not chains:
            return []
        depth = max(len(chain) for chain in chains)
        # level_segment[i, level]: the segment chain i reads at that level, -1 past its end
        level_segment = np.full((len(chains), depth), -1, dtype=np.int64)
        # level_start[i, level]: the position of that segment's first token in chain i
        level_start = np.zeros((len(chains), depth), dtype=np.int64)
        for i, chain in enumerate(chains):
            level_segment[i, : len(chain)] = chain
            lengths = [self.segment_length(s) for s in chain[:-1]]
            level_start[i, 1 : len(chain)] = np.cumsum(lengths, dtype=np.int64)
        reading = chain_ids >= 0
        counts_of_chunk = np.diff(query_start)
        levels = []
        for level in range(depth):
            segment_of = np.full(len(chain_ids), -1, dtype=np.int64)
            segment_of[reading] = level_segment[chain_ids[reading], level]
            chunks = np.flatnonzero(segment_of >= 0)
            order = chunks[np.argsort(segment_of[chunks], kind="stable")]
            ordered = segment_of[order]  # ascending: each segment's chunks together
            first = np.flatnonzero(np.diff(ordered, prepend=-1))  # first chunk of a segment
            segment_ids = ordered[first]
            segment_start = level_start[chain_ids[order[first]], level]
            row_start_of_chunk = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(counts_of_chunk[order], out=row_start_of_chunk[1:])
            blocks = [self.segment_blocks(int(s)) for s in segment_ids]
            width = max((len(b) for b in blocks), default=0)
            tables = np.zeros((len(blocks), width), dtype=np.int32)
            for s, b in enumerate(blocks):
                tables[s, : len(b)] = b
            levels.append(
                SegmentLevel(
                    segment_ids=segment_ids,
                    rows=_rows_of(order, query_start),
                    row_start=np.append(row_start_of_chunk[first], row_start_of_chunk[-1]),
                    tables=tables,
                    lengths=np.array(
                        [self.segment_length(int(s)) for s in segment_ids], dtype=np.int64
                    ),
                    starts=segment_start,
                )
            )
        return levels


def _rows_of(chunks: np.ndarray, query_start: np.ndarray) -> np.ndarray:
    """The token rows of ``chunks`` (indices into the step's chunks), chunk by chunk."""
    first, end = query_start[chunks], query_start[chunks + 1]
    counts = end - first
    if counts.size and (counts == 1).all():
        return first.copy()
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(first, counts) + offsets
