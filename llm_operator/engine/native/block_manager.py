"""BlockManager: a fixed pool of paged-KV block ids (no tensors live here).

Region map of one block: slot ``s`` of block ``b`` in a sequence's block list holds the K/V of
that sequence's own token ``index * block_size + s`` where ``index`` is ``b``'s position in the
list. Who owns which block is the scheduler's business; this class only hands ids out and back.
"""

from __future__ import annotations

from collections.abc import Sequence


class BlockManager:
    """A fixed pool of KV blocks, ids ``0..num_blocks-1``, each holding ``block_size`` tokens.

    Contract:
      - ``allocate(count)`` returns ``count`` distinct ids that are free, lowest ids first on a
        fresh pool, and marks them used; it raises RuntimeError when fewer are free (callers
        check ``num_free`` first, so that is a bug, not a memory policy).
      - ``free(blocks)`` returns used ids to the pool; freeing a free or unknown id is an
        internal bug and fails an assertion.
      - ``num_free + (ids handed out and not freed) == num_blocks`` at all times.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_stack = list(range(num_blocks - 1, -1, -1))  # pop() yields the lowest id
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not handed out."""
        return len(self._free_stack)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens: ``ceil(tokens / block_size)``."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens!r}")
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """``count`` free block ids, now used; RuntimeError when fewer than ``count`` are free."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count!r}")
        if count > len(self._free_stack):
            raise RuntimeError(
                f"cannot allocate {count} KV blocks: only {len(self._free_stack)} of "
                f"{self.num_blocks} are free"
            )
        blocks = [self._free_stack.pop() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return used ids to the pool (AssertionError on a double free or an unknown id)."""
        for block in blocks:
            assert isinstance(block, int) and 0 <= block < self.num_blocks, (
                f"unknown KV block id {block!r} (pool has {self.num_blocks})"
            )
            assert not self._is_free[block], f"KV block {block} freed twice"
            self._is_free[block] = True
            self._free_stack.append(block)
