"""KVSequence and ScheduledChunk: the units of KV work the scheduler hands the model runner.

Positions of a sequence (region map):

    [ chain segments' own tokens, outermost first | own tokens 0 .. len(tokens)-1 ]
      0 .. prefix_length-1: K/V in each READY       prefix_length + i: K/V of own token i in
      segment's own blocks (read-only, pinned)     blocks[i // block_size], slot i % block_size

With tail copies (the batch-invariant mode), every sequence starts on a block boundary: a
sequence whose chain ends inside a block takes that block's tokens as its first ``head`` own
tokens, their K/V copied from the segment's last block, and a segment's readers see only its
whole blocks (the partial one lives on in each reader's copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Status(str, Enum):
    WAITING = "waiting"  # not admitted, or preempted: holds no blocks
    RUNNING = "running"  # admitted: computing its own tokens (requests: and decoding)
    READY = "ready"  # segment whose K/V are all computed: pinned, readable by its members
    FINISHED = "finished"  # request finished or rejected; segment released or evicted


class Kind(str, Enum):
    SEGMENT = "segment"  # a shared plan segment: prefilled once, then pinned
    REQUEST = "request"  # a request: its own suffix, then decode


WAITING, RUNNING, READY, FINISHED = Status.WAITING, Status.RUNNING, Status.READY, Status.FINISHED
SEGMENT, REQUEST = Kind.SEGMENT, Kind.REQUEST


@dataclass(eq=False, slots=True)
class KVSequence:
    """One plan segment (prefilled once, then pinned) or one request (prefill, then decode)."""

    seq_id: int
    kind: Kind
    ref: int  # SEGMENT: the plan's segment_id; REQUEST: the plan's request_id
    chain: tuple[int, ...]  # READY segments read (outermost first); a segment: its ancestors
    prefix_length: int  # tokens covered by chain: the position of own token 0
    tokens: list[int]  # own tokens: segment tokens, or request suffix + generated so far
    num_computed: int  # own tokens whose K/V are in the cache
    blocks: list[int]  # own blocks (a segment's are what its members read)
    max_tokens: int  # requests: decode budget from the plan; segments: 0
    arrival: int  # admission order, renewed on re-admission; -1 before the first
    prompt_length: int  # own prompt tokens; tokens[prompt_length:] were generated
    status: Status = WAITING
    # own tokens 0 .. head-1 repeat the chain's last partial block (``Scheduler(copy_tails=
    # True)``): their K/V are copied from that block, never computed
    head: int = 0
    peak: int = 0  # the most own tokens ever computed (a preempted request recomputes below)
    jump_end: int = 0  # own tokens up to the last jump-forward token appended (0: none)
    # the step builder's copy of ``blocks`` (``StepBuilder``): its row of the host block
    # table, and the list object and length last copied there (a preemption replaces the
    # list, so a re-admitted sequence is copied again from its first block)
    table_row: int = -1
    synced_blocks: list[int] | None = None
    synced_count: int = 0
    # sliding-window models (``Scheduler(window=...)``): blocks[:released] left every window
    # and went back to the pool (their ids stay in the list, never read again)
    released: int = 0

    @classmethod
    def waiting(cls, seq_id: int, kind: Kind, ref: int, chain: tuple[int, ...], prefix_length: int,
                tokens: list[int], max_tokens: int) -> KVSequence:  # fmt: skip
        """A new sequence: nothing computed, no blocks, never admitted."""
        return cls(
            seq_id, kind, ref, chain, prefix_length, tokens, 0, [], max_tokens, -1, len(tokens)
        )

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (0 for segments)."""
        return len(self.tokens) - self.prompt_length


class ScheduledChunk(NamedTuple):
    """Own tokens ``seq.tokens[start:start+length]`` to compute this iteration (a tuple:
    a step builds up to a thousand of them, and a tuple is the cheapest record)."""

    seq: KVSequence
    start: int  # == seq.num_computed when scheduled
    length: int  # >= 1
    sample: bool  # a request chunk ending at its last own token: sample the next token

    @property
    def is_decode(self) -> bool:
        """One generated token fed back: the decode part of an iteration."""
        return self.sample and self.length == 1 and self.start >= self.seq.prompt_length
