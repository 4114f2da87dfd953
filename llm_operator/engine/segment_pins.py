"""SegmentPins: how many members still need each shared segment (BatchLLM's pinning).

A shared prefix segment stays resident until the last request whose chain holds it is
done, instead of sitting in an LRU cache that may evict it while members still wait.
The hf backend keeps a segment's K/V tensors this way (``PrefixStore``), the native
backend its KV blocks (``PrefixPins``); both count members here.

Contract: ``pending[segment_id]`` starts at the number of chains that hold the segment
and only falls, through ``member_done(chain)``, which returns the segments whose count
reached 0 with that call (their holder frees them at once).
"""

from __future__ import annotations

from collections.abc import Iterable


class SegmentPins:
    def __init__(self, num_segments: int, chains: Iterable[tuple[int, ...]]) -> None:
        self.pending = [0] * num_segments
        for chain in chains:
            for segment_id in chain:
                self.pending[segment_id] += 1

    def member_done(self, chain: tuple[int, ...]) -> list[int]:
        """A member finished (or was rejected); the segments no member needs any more."""
        released = []
        for segment_id in chain:
            self.pending[segment_id] -= 1
            assert self.pending[segment_id] >= 0, f"segment {segment_id} released too often"
            if self.pending[segment_id] == 0:
                released.append(segment_id)
        return released
