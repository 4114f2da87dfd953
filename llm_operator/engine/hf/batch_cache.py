"""The dense KV cache of the running batch (BATON's batch cache).

Region map of one layer's buffer, per row (columns = the batch's time axis)::

    [0, start)              trimmed: padding in every row, never attended
    [start, length)         live columns; a row's real tokens end at length - 1
                            (rows are right-aligned); left of a row's tokens,
                            and in holes, the mask is False
    [length, capacity)      room to grow: the next decode step writes column `length`

Rows enter and leave without touching the others: a new row's K/V are shaped to
the time axis (left padding + mask) and written into a free row slot, so the
running rows never wait for it or recompute around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

GROWTH_COLUMNS = 64
KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per layer


def layers_of(cache: DynamicCache) -> KVLayers:
    """(keys, values) per layer; refuses caches that are not plain per-layer K/V."""
    layers = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (
            not isinstance(keys, torch.Tensor)
            or keys.dim() != 4
            or getattr(layer, "is_sliding", False)
        ):
            raise ValueError(
                f"the hf backend needs a plain key/value cache per layer; this model uses {type(layer).__name__}"
            )
        layers.append((keys, values))
    return layers


class _BufferLayer(DynamicLayer):
    """One layer's view of its owner's buffers: ``update`` writes in place instead of
    concatenating."""

    def __init__(self, owner: DenseBatchCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = 2 * index  # its keys' buffer in owner.buffers; its values' follows
        self.device = owner.buffers[self.index].device
        self.is_initialized = True
        self.view(owner.length)

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the live columns up to ``end``."""
        start, buffers = self.owner.start, self.owner.buffers
        self.keys = buffers[self.index][:, :, start:end]
        self.values = buffers[self.index + 1][:, :, start:end]
        return self.keys, self.values

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states: [rows, kv_heads, new, head_dim]; the owner made room beforehand
        length, new = self.owner.length, key_states.shape[-2]
        self.owner.buffers[self.index][:, :, length : length + new] = key_states
        self.owner.buffers[self.index + 1][:, :, length : length + new] = value_states
        return self.view(length + new)


class DenseBatchCache:
    """K/V of every running row, right-aligned on one time axis.

    mask: [rows, capacity] bool, True where a row has a real token.
    positions: [rows] the position id of each row's next token.
    buffers: keys then values of each layer, [rows, kv_heads, capacity, head_dim] each.
    """

    def __init__(self, layers: KVLayers, mask: torch.Tensor, positions: torch.Tensor):
        # layers[i]: (keys, values), each [rows, kv_heads, time, head_dim]; mask: [rows, time]
        self.start = 0
        self.length = self.capacity = mask.shape[1]
        self.mask = mask.clone()
        self.positions = positions.clone()
        self.buffers = [t.clone() for pair in layers for t in pair]
        self.layers = [_BufferLayer(self, i) for i in range(len(layers))]
        self._new, self._advance = 1, 1  # the step in flight (prepare_decode)
        self._zero_padding(slice(None))

    # -- shape -----------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def time(self) -> int:
        return self.length - self.start

    def row_lengths(self) -> torch.Tensor:
        """Columns from each row's first real token to the end of the time axis."""
        live = self.mask[:, self.start : self.length]
        first = torch.where(
            live.any(dim=1), live.float().argmax(dim=1), torch.full((self.rows,), self.time)
        )
        return self.time - first

    # -- the forward pass ------------------------------------------------
    def prepare_decode(
        self, counts: list[int] | None = None
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Room for the step's new columns: one per row, or ``counts[row]`` tokens per row
        (a row's sampled token and its jump-forward tokens), right-aligned in
        ``max(counts)`` columns with holes (mask False) left of a shorter row's tokens.
        Returns (cache, attention mask [rows, time + new], position ids [rows, new])."""
        new = max(counts) if counts else 1
        if self.length + new > self.capacity:
            self._reallocate(left=0, right=max(new, GROWTH_COLUMNS))
        self._new, self._advance = new, 1
        if new == 1:
            self.mask[:, self.length] = True
            positions = self.positions.unsqueeze(1)
        else:
            count = torch.as_tensor(counts, dtype=torch.long, device=self.mask.device)
            offsets = torch.arange(new, device=self.mask.device) - (new - count).unsqueeze(1)
            self.mask[:, self.length : self.length + new] = offsets >= 0
            positions = self.positions.unsqueeze(1) + offsets.clamp(min=0).to(self.positions)
            self._advance = torch.as_tensor(counts, dtype=self.positions.dtype)
        cache = DynamicCache()
        cache.layers = list(self.layers)
        return cache, self.mask[:, self.start : self.length + new], positions

    def finish_decode(self) -> None:
        """The forward pass wrote the step's columns; advance."""
        self.length += self._new
        self.positions += self._advance
        self._new, self._advance = 1, 1
        self._refresh()

    # -- rows ------------------------------------------------------------
    def write_rows(
        self, slots: list[int], layers: KVLayers, mask: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write new rows (right-aligned) into ``slots``; slots == rows appends."""
        # layers[i]: [new_rows, kv_heads, row_time, head_dim]; mask: [new_rows, row_time]
        row_time = mask.shape[1]
        appended = [s for s in slots if s >= self.rows]
        assert appended == list(range(self.rows, self.rows + len(appended))), (
            "slots append in order"
        )
        if row_time > self.time:
            self._extend_left(row_time - self.time)
        if appended:  # zero rows at the end of every tensor
            self.mask = F.pad(self.mask, (0, 0, 0, len(appended)))
            self.positions = F.pad(self.positions, (0, len(appended)))
            self.buffers = [F.pad(b, (0, 0, 0, 0, 0, 0, 0, len(appended))) for b in self.buffers]
        index = torch.tensor(slots, dtype=torch.long)
        left = self.length - row_time
        self.mask[index] = False
        self.mask[index, left : self.length] = mask.to(self.mask.device)
        self.positions[index] = positions.to(self.positions.device)
        for buffer, tensor in zip(self.buffers, (t for pair in layers for t in pair)):
            buffer[index] = 0
            buffer[index, :, left : self.length] = tensor
        self._zero_padding(index)
        self.trim()

    def park_rows(self, slots: list[int]) -> None:
        """Free rows: they attend only to their own newest column until reused or dropped."""
        index = torch.tensor(slots, dtype=torch.long)
        self.mask[index] = False
        self.positions[index] = 0
        self.trim()

    def keep_rows(self, slots: list[int]) -> None:
        """Drop every row not in ``slots`` (in that order)."""
        index = torch.tensor(slots, dtype=torch.long)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.buffers = [b[index] for b in self.buffers]
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        live = self.mask[:, self.start : self.length].any(dim=0)
        self.start = self.start + int(live.float().argmax()) if live.any() else self.length
        self._refresh()

    # -- buffers ---------------------------------------------------------
    def _extend_left(self, columns: int) -> None:
        if self.start >= columns:
            self.start -= columns
            self.mask[:, self.start : self.start + columns] = False
            for buffer in self.buffers:
                buffer[:, :, self.start : self.start + columns] = 0
        else:
            self._reallocate(left=columns - self.start, right=0)
            self.start = 0
        self._refresh()

    def _reallocate(self, *, left: int, right: int) -> None:
        """New buffers with ``left`` more columns before column 0 and ``right`` after capacity."""
        self.mask = F.pad(self.mask, (left, right))
        self.buffers = [F.pad(b, (0, 0, left, right)) for b in self.buffers]
        self.start += left
        self.length += left
        self.capacity += left + right
        self._refresh()

    def _zero_padding(self, index) -> None:
        """Zero K/V where the mask is False, so padding holds no NaN from padded queries."""
        pad = ~self.mask[index, : self.length]  # [rows, length]
        if not bool(pad.any()):
            return
        for keys, values in zip(self.buffers[::2], self.buffers[1::2]):
            here = pad[:, None, :, None].to(keys.device)  # a layer's keys and values share one
            for buffer in (keys, values):
                buffer[index, :, : self.length] = buffer[index, :, : self.length].masked_fill(
                    here, 0
                )

    def _refresh(self) -> None:
        for layer in self.layers:
            layer.view(self.length)
