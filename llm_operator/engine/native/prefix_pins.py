"""PrefixPins: the K/V of shared plan segments, pinned for exactly as long as a member needs them.

BatchLLM keeps a group's prefix K/V resident until the group's last request ends, instead of
an LRU cache that may evict it while members still wait. Index map:

    pending[segment_id]   requests not yet finished or rejected whose chain holds the segment
    live[segment_id]      its segment KVSequence while pinned (RUNNING, then READY), else None
"""

from __future__ import annotations

from collections.abc import Sequence as Chain

from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.sequence import FINISHED, READY, RUNNING, KVSequence
from llm_operator.engine.segment_pins import SegmentPins
from llm_operator.planner.plan import Plan


class PrefixPins(SegmentPins):
    """Pinned segment sequences and the count of members each still has to serve.

    Contract:
      - ``pending`` (``SegmentPins``) starts at the number of request chains (as the scheduler
        runs them) that hold the segment; at 0 the segment is released at once: its blocks
        go back to the pool.
      - ``pin`` records the sequence of an unpinned segment whose blocks were just allocated;
        its ancestors are pinned already (they have at least as many pending members).
      - a READY segment keeps its blocks until released; the only other way out is ``evict``,
        the scheduler's last resort, for a READY leaf that no running sequence reads.
    """

    def __init__(
        self,
        plan: Plan,
        blocks: BlockManager,
        chains: Chain[tuple[int, ...]],
        copy_tails: bool = False,
    ) -> None:
        """``copy_tails``: a segment's sequence starts at the block boundary before it
        (``Scheduler(copy_tails=True)``), so it needs blocks for those tokens too."""
        super().__init__(len(plan.segments), chains)
        self.plan, self.blocks = plan, blocks
        size = blocks.block_size
        self.need = [
            blocks.blocks_for(len(segment.token_ids) + (segment.start % size if copy_tails else 0))
            for segment in plan.segments
        ]
        self.live: list[KVSequence | None] = [None] * len(plan.segments)

    def chain_blocks(self, chain: tuple[int, ...], *, missing_only: bool = False) -> int:
        """Blocks the chain's segments take (``missing_only``: those not pinned yet)."""
        return sum(
            self.need[segment_id]
            for segment_id in chain
            if not (missing_only and self.live[segment_id] is not None)
        )

    def is_ready(self, segment_id: int) -> bool:
        segment_seq = self.live[segment_id]
        return segment_seq is not None and segment_seq.status == READY

    def ready(self, segment_id: int) -> KVSequence:
        """The READY sequence of a segment (AssertionError otherwise)."""
        assert self.is_ready(segment_id), f"segment {segment_id} is not READY"
        return self.live[segment_id]

    def pin(self, segment_seq: KVSequence) -> None:
        segment_id = segment_seq.ref
        assert self.live[segment_id] is None and self.pending[segment_id] > 0, (
            f"segment {segment_id} is pinned already or has no member left"
        )
        assert len(segment_seq.blocks) == self.need[segment_id], "pin a fully allocated segment"
        self.live[segment_id] = segment_seq

    def member_done(self, chain: tuple[int, ...]) -> list[KVSequence]:
        """A member finished or was rejected; returns released segments that were RUNNING."""
        released = []
        for segment_id in super().member_done(chain):
            segment_seq = self.live[segment_id]
            if segment_seq is not None:
                if segment_seq.status == RUNNING:
                    released.append(segment_seq)
                self._release(segment_id)
        return released

    def evict(self, keep: tuple[int, ...]) -> bool:
        """Release the youngest READY leaf not in ``keep``; False when there is none."""
        pinned = [q for q in self.live if q is not None]
        parents = {self.plan.segments[q.ref].parent_id for q in pinned}
        leaves = [q for q in pinned if q.ref not in keep and q.ref not in parents]
        if not leaves:
            return False
        victim = max(leaves, key=lambda q: q.arrival)
        assert victim.status == READY, "only READY segments are evicted"
        self._release(victim.ref)
        return True

    def _release(self, segment_id: int) -> None:
        segment_seq = self.live[segment_id]
        assert segment_seq is not None
        self.blocks.free(segment_seq.blocks[segment_seq.released :])
        segment_seq.blocks, segment_seq.status, segment_seq.released = [], FINISHED, 0
        self.live[segment_id] = None
