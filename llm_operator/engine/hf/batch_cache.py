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
from transformers.cache_utils import DynamicCache, DynamicLayer

GROWTH_COLUMNS = 64


def layers_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
    """A cache layer that appends into a preallocated buffer instead of concatenating."""

    def __init__(
        self, buffer_keys: torch.Tensor, buffer_values: torch.Tensor, owner: DenseBatchCache
    ):
        super().__init__()
        self.buffer_keys = buffer_keys  # [rows, kv_heads, capacity, head_dim]
        self.buffer_values = buffer_values
        self.owner = owner
        self.device = buffer_keys.device
        self.is_initialized = True
        self.refresh_views()

    def refresh_views(self) -> None:
        start, length = self.owner.start, self.owner.length
        self.keys = self.buffer_keys[:, :, start:length]
        self.values = self.buffer_values[:, :, start:length]

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states: [rows, kv_heads, new, head_dim]; the owner made room beforehand
        length, new = self.owner.length, key_states.shape[-2]
        self.buffer_keys[:, :, length : length + new] = key_states
        self.buffer_values[:, :, length : length + new] = value_states
        start = self.owner.start
        self.keys = self.buffer_keys[:, :, start : length + new]
        self.values = self.buffer_values[:, :, start : length + new]
        return self.keys, self.values


class DenseBatchCache:
    """K/V of every running row, right-aligned on one time axis.

    mask: [rows, capacity] bool, True where a row has a real token.
    positions: [rows] the position id of each row's next token.
    """

    def __init__(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        positions: torch.Tensor,
    ):
        # layers[i]: (keys, values), each [rows, kv_heads, time, head_dim]; mask: [rows, time]
        self.start = 0
        self.length = mask.shape[1]
        self.capacity = self.length
        self.mask = mask.clone()
        self.positions = positions.clone()
        self.layers = [_BufferLayer(k.clone(), v.clone(), self) for k, v in layers]
        self._new, self._counts = 1, None  # the step in flight (prepare_decode)
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
        self._ensure_room(new)
        columns = slice(self.length, self.length + new)
        if new == 1:
            self.mask[:, self.length] = True
            positions = self.positions.unsqueeze(1)
        else:
            count = torch.as_tensor(counts, dtype=torch.long, device=self.mask.device)
            offsets = torch.arange(new, device=self.mask.device) - (new - count).unsqueeze(1)
            self.mask[:, columns] = offsets >= 0
            positions = self.positions.unsqueeze(1) + offsets.clamp(min=0).to(self.positions)
        self._new = new
        self._counts = counts
        cache = DynamicCache()
        cache.layers = list(self.layers)
        return cache, self.mask[:, self.start : self.length + new], positions

    def finish_decode(self) -> None:
        """The forward pass wrote the step's columns; advance."""
        new, counts = self._new, self._counts
        self.length += new
        if counts is None or new == 1:
            self.positions += 1
        else:
            self.positions += torch.as_tensor(counts, dtype=self.positions.dtype)
        self._new, self._counts = 1, None
        self._refresh()

    # -- rows ------------------------------------------------------------
    def write_rows(
        self,
        slots: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        positions: torch.Tensor,
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
        if appended:
            self._add_rows(len(appended))
        index = torch.tensor(slots, dtype=torch.long)
        left = self.length - row_time
        self.mask[index] = False
        self.mask[index, left : self.length] = mask.to(self.mask.device)
        self.positions[index] = positions.to(self.positions.device)
        for layer, (keys, values) in zip(self.layers, layers):
            layer.buffer_keys[index] = 0
            layer.buffer_values[index] = 0
            layer.buffer_keys[index, :, left : self.length] = keys
            layer.buffer_values[index, :, left : self.length] = values
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
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        for layer in self.layers:
            layer.buffer_keys = layer.buffer_keys[index]
            layer.buffer_values = layer.buffer_values[index]
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        live = self.mask[:, self.start : self.length].any(dim=0)
        if live.any():
            self.start += int(live.float().argmax())
        else:
            self.start = self.length
        self._refresh()

    # -- buffers ---------------------------------------------------------
    def _ensure_room(self, columns: int) -> None:
        if self.length + columns <= self.capacity:
            return
        extra = max(columns, GROWTH_COLUMNS)
        self._reallocate(left=0, right=extra)

    def _extend_left(self, columns: int) -> None:
        if self.start >= columns:
            old_start = self.start
            self.start -= columns
            self.mask[:, self.start : old_start] = False
            for layer in self.layers:
                layer.buffer_keys[:, :, self.start : old_start] = 0
                layer.buffer_values[:, :, self.start : old_start] = 0
        else:
            self._reallocate(left=columns - self.start, right=0)
            self.start = 0
        self._refresh()

    def _reallocate(self, *, left: int, right: int) -> None:
        """New buffers with ``left`` more columns before column 0 and ``right`` after capacity."""
        rows = self.rows
        mask = torch.zeros(
            rows, left + self.capacity + right, dtype=torch.bool, device=self.mask.device
        )
        mask[:, left : left + self.capacity] = self.mask
        self.mask = mask
        for layer in self.layers:
            for name in ("buffer_keys", "buffer_values"):
                old = getattr(layer, name)
                new = old.new_zeros(rows, old.shape[1], left + self.capacity + right, old.shape[3])
                new[:, :, left : left + self.capacity] = old
                setattr(layer, name, new)
        self.start += left
        self.length += left
        self.capacity += left + right
        self._refresh()

    def _add_rows(self, count: int) -> None:
        self.mask = torch.cat([self.mask, self.mask.new_zeros(count, self.capacity)])
        self.positions = torch.cat([self.positions, self.positions.new_zeros(count)])
        for layer in self.layers:
            for name in ("buffer_keys", "buffer_values"):
                old = getattr(layer, name)
                setattr(layer, name, torch.cat([old, old.new_zeros(count, *old.shape[1:])]))

    def _zero_padding(self, index) -> None:
        """Zero K/V where the mask is False, so padding holds no NaN from padded queries."""
        pad = ~self.mask[index, : self.length]  # [rows, length]
        if not bool(pad.any()):
            return
        keep_cpu = (~pad)[:, None, :, None]
        for layer in self.layers:
            keep = keep_cpu.to(layer.buffer_keys.device)
            k = layer.buffer_keys[index, :, : self.length]
            v = layer.buffer_values[index, :, : self.length]
            layer.buffer_keys[index, :, : self.length] = torch.where(
                keep, k, torch.zeros((), dtype=k.dtype)
            )
            layer.buffer_values[index, :, : self.length] = torch.where(
                keep, v, torch.zeros((), dtype=v.dtype)
            )

    def _refresh(self) -> None:
        for layer in self.layers:
            layer.refresh_views()
