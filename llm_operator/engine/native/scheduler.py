"""Scheduler of the native engine: memory-centric token batching over a Plan (pure Python).

BatchLLM (arXiv 2412.03594) with BATON-style (arXiv 2410.18701) insertion. One ``schedule()``
is one model iteration; its chunks are token-packed in this order:

    [ decodes               | prefill chunks             | work admitted this iteration   ]
      every running request   running sequences, oldest    waiting work in plan order,
      1 token, oldest first   first, chunked to the budget segments ahead of their members

Contract with the model runner (see ``KVSequence``, ``ScheduledChunk``):

    while not scheduler.done:
        chunks = scheduler.schedule()     # never empty while not done
        ...run the model on the chunks, store K/V of own token i in seq.blocks[i // block_size]
        scheduler.complete(chunks)
        for chunk in chunks with chunk.sample: scheduler.finish(seq) or append_token(seq, t)

Rules:
  - Budget: decodes always all run (a running row never stalls); the prefill part is at most
    ``max_batched_tokens - decodes``. A request starts decoding only after a prefill chunk
    that fit in the budget, so decodes never outnumber the budget: every iteration holds at
    most ``max_batched_tokens`` tokens (asserted).
  - Segments: a segment sequence prefills one plan segment once. It is created ahead of the
    first request (in plan order) that is admitted with it in its chain, gets all its blocks
    then, is READY after its last chunk and stays pinned until every request whose chain holds
    it has finished or been rejected. Request chunks run only once their whole chain is READY.
    A request whose prompt is entirely shared drops the last chain segment and prefills that
    segment's tokens itself, so it has an own token to sample from.
  - Admission is by free blocks: a request is admitted when ``num_free`` minus the blocks that
    running requests still need for their prompt and reserve covers its new segments plus
    ``blocks_for(len(tokens) + ceil(decode_reserve * remaining max_tokens))``; with no request
    running, ``blocks_for(len(tokens) + 1)`` suffices. Own blocks are allocated lazily.
  - Preemption by recompute: a decode that needs a block when none is free preempts the
    youngest running request holding blocks (possibly itself); it loses its blocks and
    ``num_computed``, keeps its tokens and goes to the front of the waiting queue. Segments
    are never preempted.
  - Waves (``token_batching=False``, an ablation): fresh requests are admitted only while no
    request runs, up to ``max_running`` or until one does not fit; the wave then runs to its
    end before the next one starts, so rows that finish early leave their slots idle.
  - Rejection: a request whose chain blocks + ``blocks_for(len(tokens) + 1)`` exceed the pool
    can never run; it is rejected (``rejected``), which counts as finished.
  - Progress: when nothing can be scheduled, preempt the youngest running request holding
    blocks; with nothing running, admit the first waiting request that fits (looking ahead
    at most ``max_running`` fresh requests into the current group); failing that,
    evict the youngest READY leaf segment off the head request's chain (no running request
    reads it; its waiting members recompute it). Only then would a request that fits the
    pool be stuck behind pins held for others; see ``SchedulerStats.segment_evictions``.
  - Tail copies (``copy_tails``, the batch-invariant mode, whose kernels read a row's keys
    in whole blocks): a sequence whose chain ends ``head`` tokens into a block starts at
    that block's boundary; its first chunk copies the chain's last block into its first
    one (``copies``: (source, destination) blocks the runner copies before the step) and
    computes from ``head`` on. A segment's readers read its whole blocks only. No token is
    computed twice, and a row's keys lie in whole blocks from position 0 whatever its chain.
  - Sliding windows (``window``: a model whose every layer sees only the last ``window``
    positions): after each iteration, a sequence's blocks whose keys lie more than
    ``WINDOW_MARGIN`` positions before the window of its next query go back to the pool
    (no later query of it, its members or its child segments can see them; the margin
    keeps them out of the kernels' aligned key runs). A request's prefill chunks are then
    at most ``window`` tokens, and admission counts a request's live blocks at most
    ``window_blocks``: a row holds about a window of blocks, whatever its length.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from llm_operator.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_BATCH_TOKENS, EngineConfig
from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.prefix_pins import PrefixPins
from llm_operator.engine.native.sequence import (
    FINISHED,
    READY,
    REQUEST,
    RUNNING,
    SEGMENT,
    WAITING,
    KVSequence,
    ScheduledChunk,
)
from llm_operator.option_fields import boolean, integer
from llm_operator.planner.plan import Plan

__all__ = ["Scheduler", "SchedulerStats", "ScheduledChunk", "KVSequence"]

# Keys kept before a sliding window's start before a block is freed: the kernels start a
# row's key loop at the run (16 keys; 64 in the batch-invariant mode) or Triton tile
# holding its first visible key, so a freed block is never read, even masked.
WINDOW_MARGIN = 128


def request_chains(plan: Plan, share_prefixes: bool) -> list[tuple[int, ...]]:
    """The segments each request reads as the scheduler runs it: its plan chain (none
    without ``share_prefixes``), less the last segment where the prompt is entirely shared
    (that request prefills the segment's tokens itself)."""
    chains = []
    for request in plan.requests:
        chain = request.chain if share_prefixes else ()
        if chain and request.prefix_length == len(request.token_ids):
            chain = chain[:-1]
        chains.append(chain)
    return chains


def blocks_needed(plan: Plan, block_size: int, share_prefixes: bool) -> int:
    """The most KV blocks ``plan``'s sequences could ever hold at once: every segment a
    chain reads, and each request's own tokens (its prompt past its chain, and its outputs)
    with a block of slack; each counted from the block boundary before it (where the
    batch-invariant mode starts a sequence). A pool of this many blocks never makes a
    row wait for memory; the shared prefixes are counted once, not once per request."""
    chains = request_chains(plan, share_prefixes)
    read = {segment_id for chain in chains for segment_id in chain}
    need = 0
    for segment in plan.segments:
        if segment.segment_id in read:
            need += -(-(len(segment.token_ids) + segment.start % block_size) // block_size)
    for request, chain in zip(plan.requests, chains, strict=True):
        prefix = plan.segments[chain[-1]].end if chain else 0
        own = len(request.token_ids) - prefix + prefix % block_size + request.max_tokens
        need += -(-own // block_size) + 1
    return need


@dataclass
class SchedulerStats:
    """Counters of one run (mutable; read them after ``done``)."""

    iterations: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # own tokens computed by non-decode chunks, recomputes included
    # (not the jump chunks' tokens below)
    decode_tokens: int = 0
    # generated tokens computed the first time by a non-decode chunk: a sampled token and
    # the jump-forward tokens after it (``append_token(seq, token, forced)``)
    jump_chunk_tokens: int = 0
    max_running: int = 0  # most requests running at once
    segment_evictions: int = 0  # last-resort unpinning of segments nobody running reads
    peak_blocks: int = 0  # most KV blocks in use at once (measured at each schedule())
    window_freed_blocks: int = 0  # blocks freed early for having left every window
    tail_copies: int = 0  # blocks copied for ``copy_tails``
    copied_tokens: int = 0  # tokens whose K/V those copies carried (not computed)


class Scheduler:
    """Decides, each iteration, which own tokens of which sequences the model computes."""

    def __init__(
        self,
        plan: Plan,
        blocks: BlockManager,
        *,
        max_batched_tokens: int = DEFAULT_PREFILL_BATCH_TOKENS,
        max_running: int = DEFAULT_MAX_BATCH_SIZE,
        decode_reserve: float = 0.5,
        share_prefixes: bool = EngineConfig.share_prefixes,
        token_batching: bool = EngineConfig.token_batching,
        window: int | None = None,
        copy_tails: bool = False,
    ) -> None:
        """The defaults are ``EngineConfig``'s (``from_config`` takes them from one); the
        options are checked as the engine options they come from. ``window``: the model's
        sliding window where every layer has it; ``copy_tails``: sequences start on block
        boundaries (see the module docstring)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
        if not isinstance(blocks, BlockManager):
            raise TypeError(f"blocks must be a BlockManager, got {type(blocks).__name__}")
        max_batched_tokens = integer(1)("max_batched_tokens", max_batched_tokens)
        max_running = integer(1)("max_running", max_running)
        if isinstance(decode_reserve, bool) or not isinstance(decode_reserve, (int, float)):
            raise TypeError(f"decode_reserve must be a float, got {decode_reserve!r}")
        if not (math.isfinite(decode_reserve) and decode_reserve >= 0):
            raise ValueError(f"decode_reserve must be finite and >= 0, got {decode_reserve!r}")
        share_prefixes = boolean("share_prefixes", share_prefixes)
        token_batching = boolean("token_batching", token_batching)
        self.plan, self.blocks = plan, blocks
        self.max_batched_tokens, self.max_running = max_batched_tokens, max_running
        self.decode_reserve, self.share_prefixes = decode_reserve, share_prefixes
        # token_batching=False is the ablation without BATON insertion: requests run in
        # waves of up to max_running, and a wave is admitted only once the last has ended.
        self.token_batching = token_batching
        self.window = None if window is None else integer(1)("window", window)
        self.window_blocks = None  # a windowed request's most live blocks
        if self.window is not None:
            chunk = min(self.window, max_batched_tokens)
            self.window_blocks = blocks.blocks_for(self.window + WINDOW_MARGIN + chunk) + 1
        self.copy_tails = boolean("copy_tails", copy_tails)
        self.copies: list[tuple[int, int]] = []  # this iteration's (source, destination) blocks
        self._wave_open = True
        self.rejected: list[tuple[int, str]] = []
        self.stats = SchedulerStats()
        self._chains = request_chains(plan, self.share_prefixes)
        self._pins = PrefixPins(plan, blocks, self._chains, self.copy_tails)
        self._waiting: deque[KVSequence] = deque()  # preempted first, then fresh in plan order
        self._next_request = 0  # plan cursor: requests before it have a KVSequence
        self._running: list[KVSequence] = []  # arrival order
        self._finished_running = 0  # requests finished since the last schedule(), still listed
        self._num_running_requests = 0
        self._num_finished = 0
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    @classmethod
    def from_config(
        cls, plan: Plan, blocks: BlockManager, config: EngineConfig, **options: float
    ) -> Scheduler:
        """A scheduler with ``config``'s settings: ``prefill_batch_tokens`` per iteration,
        ``max_batch_size`` running requests, ``share_prefixes``, ``token_batching``;
        ``options``: the scheduler's own (``decode_reserve``)."""
        return cls(
            plan,
            blocks,
            max_batched_tokens=config.prefill_batch_tokens,
            max_running=config.max_batch_size,
            share_prefixes=config.share_prefixes,
            token_batching=config.token_batching,
            **options,
        )

    # ------------------------------------------------------------------ runner interface

    @property
    def done(self) -> bool:
        """Every plan request finished or rejected."""
        return self._num_finished + len(self.rejected) == len(self.plan.requests)

    @property
    def running(self) -> tuple[KVSequence, ...]:
        """Admitted sequences still computing, oldest first (READY segments excluded)."""
        return tuple(seq for seq in self._running if seq.status is RUNNING)

    def segment_sequence(self, segment_id: int) -> KVSequence | None:
        """The live KVSequence of a segment (RUNNING or READY), None when not pinned."""
        return self._pins.live[segment_id]

    def segment_blocks(self, segment_id: int) -> list[int]:
        """Own blocks of a READY segment, in token order."""
        return list(self._pins.ready(segment_id).blocks)

    def segment_length(self, segment_id: int) -> int:
        """Own tokens of a READY segment its readers read (with ``copy_tails``: those in
        whole blocks)."""
        length = len(self._pins.ready(segment_id).tokens)
        return length - length % self.blocks.block_size if self.copy_tails else length

    def schedule(self) -> list[ScheduledChunk]:
        """The next iteration's chunks; at least one while not ``done``."""
        if self._finished_running:  # finished requests leave the running list here, at once
            self._running = [seq for seq in self._running if seq.status is RUNNING]
            self._finished_running = 0
        for seq in self._running:
            assert seq.kind is SEGMENT or seq.num_computed < len(seq.tokens), (
                f"request {seq.ref} was sampled but neither append_token nor finish was called"
            )
        chunks: list[ScheduledChunk] = []
        self.copies = []
        while not self.done:
            if chunks := self._build_iteration():
                break
            if not self.done:  # building may have rejected the last waiting requests
                self._unstick()
        assert chunks or self.done, "schedule() found nothing to run while work remains"
        if chunks:
            self.stats.iterations += 1
            used = self.blocks.num_blocks - self.blocks.num_free
            self.stats.peak_blocks = max(self.stats.peak_blocks, used)
        return chunks

    def complete(self, chunks: Iterable[ScheduledChunk]) -> None:
        """The model stored these chunks' K/V: advance ``num_computed``; segments may turn READY."""
        stats = self.stats
        for chunk in chunks:
            seq, start, length, _sample = chunk
            assert seq.status is RUNNING and start == seq.num_computed, (
                f"chunk of {seq.kind} {seq.ref} at {start} does not continue at "
                f"{seq.num_computed} (status {seq.status})"
            )
            computed = seq.num_computed = start + length
            if chunk.is_decode:
                stats.decode_tokens += 1
            else:
                # a sampled token and its jump-forward tokens, computed the first time
                first = max(start, seq.prompt_length, seq.peak)
                jump = max(0, min(computed, seq.jump_end) - first)
                stats.jump_chunk_tokens += jump
                stats.prefill_tokens += length - jump
            if computed > seq.peak:
                seq.peak = computed
            if seq.kind is SEGMENT and computed == len(seq.tokens):
                seq.status = READY
                self._running.remove(seq)
            if self.window is not None:
                self._free_behind_window(seq)

    def _free_behind_window(self, seq: KVSequence) -> None:
        """Free ``seq``'s blocks that every later query has left behind (``window``)."""
        # the next query sits at own index num_computed; it and every later one see own
        # indices > num_computed - window only
        behind = seq.num_computed - self.window + 1 - WINDOW_MARGIN
        dead = min(max(0, behind // self.blocks.block_size), len(seq.blocks))
        if dead > seq.released:
            self.blocks.free(seq.blocks[seq.released : dead])
            self.stats.window_freed_blocks += dead - seq.released
            seq.released = dead

    def append_token(self, seq: KVSequence, token_id: int, forced: Iterable[int] = ()) -> None:
        """Add a sampled token to a request whose own tokens are all computed, and after it
        the ``forced`` tokens (jump-forward): the next iteration then computes them all as
        one chunk (in the prefill part, within the budget) and samples after the last."""
        assert seq.kind is REQUEST and seq.status == RUNNING, f"request {seq.ref} not running"
        assert seq.num_computed == len(seq.tokens), f"request {seq.ref} was not sampled"
        seq.tokens.append(int(token_id))
        before = len(seq.tokens)
        seq.tokens.extend(int(token) for token in forced)
        if len(seq.tokens) > before:
            seq.jump_end = len(seq.tokens)

    def append_tokens(self, seqs: Iterable[KVSequence], tokens: Iterable[int]) -> None:
        """``append_token`` for many decoding requests at once, without forced tokens."""
        for seq, token in zip(seqs, tokens):
            assert seq.status is RUNNING and seq.num_computed == len(seq.tokens), (
                f"request {seq.ref} was not sampled or is not running"
            )
            seq.tokens.append(token)

    def finish(self, seq: KVSequence) -> None:
        """A request is done: free its blocks and unpin segments it was last to need. Also
        a preempted one (waiting to be admitted again), whose output the runner already
        has (``OverlappedSteps``: a guessed row that had ended)."""
        assert seq.kind is REQUEST and seq.status in (RUNNING, WAITING), (
            f"request {seq.ref} is {seq.status}"
        )
        if seq.status is WAITING:
            assert seq.arrival != -1, f"request {seq.ref} was never admitted"
            self._waiting.remove(seq)
        self._release_request(seq)
        self._num_finished += 1

    # ------------------------------------------------------------------ one iteration

    def _build_iteration(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        scheduled: set[KVSequence] = set()
        block_size = self.blocks.block_size
        for seq in list(self._running):  # a preemption below may shorten the list
            computed = seq.num_computed
            if (
                seq.kind is not REQUEST
                or seq.status is not RUNNING
                or computed < seq.prompt_length
                or len(seq.tokens) - computed != 1
            ):
                continue  # not a decode (a segment, a prefill, preempted)
            if computed >= len(seq.blocks) * block_size and not self._decode_block(seq, scheduled):
                continue  # needed a block and was preempted for it
            chunks.append(ScheduledChunk(seq, computed, 1, True))
            scheduled.add(seq)
        budget = self.max_batched_tokens - len(chunks)
        assert budget >= 0, "more running decodes than max_batched_tokens"
        for seq in list(self._running):
            if budget <= 0:
                break
            if seq not in scheduled and (chunk := self._prefill_chunk(seq, budget)):
                chunks.append(chunk)
                budget -= chunk.length
        if not self.token_batching and self._num_running_requests == 0:
            self._wave_open = True
        committed: int | None = None  # blocks running requests still need (``_fits``)
        while budget > 0 and self._wave_open:
            seq = self._peek_waiting()
            if seq is None or self._num_running_requests >= self.max_running:
                self._wave_open = self.token_batching
                break
            if (message := self._never_fits(seq)) is not None:
                self._reject(seq, message)
                continue
            if committed is None and self._num_running_requests:
                committed = self._committed()
            if not self._fits(seq, committed):
                self._wave_open = self.token_batching
                break
            for admitted in self._admit(seq):
                if budget > 0 and (chunk := self._prefill_chunk(admitted, budget)):
                    chunks.append(chunk)
                    budget -= chunk.length
            # only the admitted request's own need changed (its segments are not requests)
            committed = (committed or 0) + max(0, self._target_blocks(seq) - len(seq.blocks))
        return chunks

    def _decode_block(self, seq: KVSequence, scheduled: set[KVSequence]) -> bool:
        """Cover the decode token with a block, preempting youngest first; False if seq lost."""
        while self.blocks.blocks_for(seq.num_computed + 1) > len(seq.blocks) + self.blocks.num_free:
            victim = max(
                (r for r in self._running if r.kind is REQUEST and r.blocks and r not in scheduled),
                key=lambda r: r.arrival,
            )
            self._preempt(victim)
            if victim is seq:
                return False
        self._cover(seq, seq.num_computed + 1)
        return True

    def _prefill_chunk(self, seq: KVSequence, budget: int) -> ScheduledChunk | None:
        """The next chunk of a running sequence, limited by budget and free blocks; no preemption."""
        if not all(self._pins.is_ready(segment_id) for segment_id in seq.chain):
            return None
        start = seq.num_computed or seq.head
        length = min(len(seq.tokens) - start, budget)
        if self.window is not None:  # a window's worth at a time: its blocks stay few
            length = min(length, self.window)
        if seq.kind is REQUEST:
            coverable = (len(seq.blocks) + self.blocks.num_free) * self.blocks.block_size - start
            length = min(length, coverable)
            if length > 0:
                self._cover(seq, start + length)
        if length <= 0:
            return None
        if seq.num_computed < start:  # the head's K/V: a copy of the chain's last block
            self._copy_head(seq)
        end = start + length
        return ScheduledChunk(seq, start, length, seq.kind is REQUEST and end == len(seq.tokens))

    def _copy_head(self, seq: KVSequence) -> None:
        size = self.blocks.block_size
        parent = self._pins.ready(seq.chain[-1])
        assert len(parent.tokens) % size == seq.head, "a head is its chain's partial block"
        self.copies.append((parent.blocks[len(parent.tokens) // size], seq.blocks[0]))
        seq.num_computed = seq.head
        self.stats.tail_copies += 1
        self.stats.copied_tokens += seq.head

    def _start(self, prefix: int) -> int:
        """Where a sequence whose chain ends at ``prefix`` (0: no chain) starts: there, or
        with ``copy_tails`` at the block boundary before it."""
        return prefix - prefix % self.blocks.block_size if self.copy_tails else prefix

    # ------------------------------------------------------------------ admission

    def _peek_waiting(self) -> KVSequence | None:
        if not self._waiting:
            self._materialize_next()
        return self._waiting[0] if self._waiting else None

    def _materialize_next(self) -> None:
        """Append the next plan request (never admitted yet) to the waiting queue."""
        if self._next_request == len(self.plan.requests):
            return
        request = self.plan.requests[self._next_request]
        chain = self._chains[self._next_request]
        self._next_request += 1
        prefix = self.plan.segments[chain[-1]].end if chain else 0
        start = self._start(prefix)
        tokens = [int(token) for token in request.token_ids[start:]]
        assert len(tokens) > prefix - start, f"request {request.request_id} has no own token"
        seq = KVSequence.waiting(
            next(self._seq_ids), REQUEST, request.request_id, chain, start, tokens,
            request.max_tokens,
        )  # fmt: skip
        seq.head = prefix - start
        self._waiting.append(seq)

    def _never_fits(self, seq: KVSequence) -> str | None:
        chain_blocks = self._pins.chain_blocks(seq.chain)
        own_blocks = self._live_cap(self.blocks.blocks_for(len(seq.tokens) + 1))
        if chain_blocks + own_blocks <= self.blocks.num_blocks:
            return None
        return (
            f"request {seq.ref} can never fit the KV cache: its shared prefix needs {chain_blocks} "
            f"blocks and its {len(seq.tokens)} own tokens ({seq.num_generated} generated) plus one "
            f"to generate need {own_blocks} blocks of {self.blocks.block_size} tokens; "
            f"{chain_blocks + own_blocks} > num_blocks={self.blocks.num_blocks}"
        )

    def _target_blocks(self, seq: KVSequence) -> int:
        """Blocks a running request may still come to hold (in its list: freed ones too)."""
        reserve = math.ceil(self.decode_reserve * max(0, seq.max_tokens - seq.num_generated))
        blocks = self.blocks.blocks_for(len(seq.tokens) + reserve)
        return self._live_cap(blocks - seq.released) + seq.released

    def _live_cap(self, blocks: int) -> int:
        """A request's live blocks: at most ``window_blocks`` in a windowed model."""
        return blocks if self.window_blocks is None else min(blocks, self.window_blocks)

    def _committed(self) -> int:
        """Blocks the running requests may still take (to their ``_target_blocks``)."""
        return sum(
            max(0, self._target_blocks(r) - len(r.blocks))
            for r in self._running
            if r.kind is REQUEST and r.status is RUNNING
        )

    def _fits(self, seq: KVSequence, committed: int | None = None) -> bool:
        """Whether waiting ``seq`` may be admitted now. ``committed``: ``_committed()``
        when the caller has it."""
        new_segments = self._pins.chain_blocks(seq.chain, missing_only=True)
        if self._num_running_requests == 0:
            least = min(
                self._target_blocks(seq),
                self._live_cap(self.blocks.blocks_for(len(seq.tokens) + 1)),
            )
            return new_segments + least <= self.blocks.num_free
        if committed is None:
            committed = self._committed()
        return new_segments + self._target_blocks(seq) + committed <= self.blocks.num_free

    def _admit(self, seq: KVSequence) -> list[KVSequence]:
        """Start seq (head of the queue) and, ahead of it, segment sequences for its chain."""
        assert self._waiting[0] is seq, "only the head of the waiting queue is admitted"
        self._waiting.popleft()
        started = []
        prompt = self.plan.requests[seq.ref].token_ids
        for index, segment_id in enumerate(seq.chain):
            if self._pins.live[segment_id] is None:
                segment = self.plan.segments[segment_id]
                start = self._start(segment.start)
                segment_seq = KVSequence.waiting(
                    next(self._seq_ids), SEGMENT, segment_id, seq.chain[:index], start,
                    [int(t) for t in prompt[start : segment.end]], 0,
                )  # fmt: skip
                segment_seq.head = segment.start - start
                segment_seq.blocks = self.blocks.allocate(self._pins.need[segment_id])
                self._pins.pin(segment_seq)
                started.append(segment_seq)
        started.append(seq)
        for new in started:
            new.status, new.arrival = RUNNING, next(self._arrivals)
            self._running.append(new)
        self._num_running_requests += 1
        self.stats.max_running = max(self.stats.max_running, self._num_running_requests)
        return started

    # ------------------------------------------------------------------ memory and progress

    def _cover(self, seq: KVSequence, tokens: int) -> None:
        missing = self.blocks.blocks_for(tokens) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.blocks.allocate(missing))

    def _preempt(self, seq: KVSequence) -> None:
        assert seq.kind is REQUEST and seq.status == RUNNING, "only running requests preempt"
        self._running.remove(seq)
        self._num_running_requests -= 1
        self.blocks.free(seq.blocks[seq.released :])
        seq.blocks, seq.num_computed, seq.status, seq.released = [], 0, WAITING, 0
        self._waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _unstick(self) -> None:
        """Nothing was schedulable: change state so that the next try schedules something."""
        requests = [r for r in self._running if r.kind is REQUEST]
        holders = [r for r in requests if r.blocks]
        if holders:
            self._preempt(max(holders, key=lambda r: r.arrival))
            return
        for request in reversed(requests):  # they hold nothing; the oldest ends up in front
            self._preempt(request)
        assert not self._running, "a running segment sequence can always be scheduled"
        head = self._peek_waiting()
        assert head is not None, "not done, yet nothing runs or waits"
        self._look_ahead()
        for candidate in list(self._waiting):
            if self._never_fits(candidate) is None and self._fits(candidate):
                self._waiting.remove(candidate)
                self._waiting.appendleft(candidate)
                return
        if (message := self._never_fits(head)) is not None:
            self._reject(head, message)
            return
        evicted = self._pins.evict(keep=head.chain)
        assert evicted, f"request {head.ref} fits the pool alone, yet no pin can be evicted"
        self.stats.segment_evictions += 1

    def _look_ahead(self) -> None:
        """Queue up to ``max_running`` fresh requests of the next group (members of its pins)."""
        requests = self.plan.requests
        fresh = sum(1 for seq in self._waiting if seq.arrival == -1)
        group = requests[self._waiting[-1].ref].group_id
        while fresh < self.max_running and self._next_request < len(requests):
            if fresh and requests[self._next_request].group_id != group:
                break
            self._materialize_next()
            group = requests[self._waiting[-1].ref].group_id
            fresh += 1

    def _reject(self, seq: KVSequence, message: str) -> None:
        self._waiting.remove(seq)
        self._release_request(seq)
        self.rejected.append((seq.ref, message))

    def _release_request(self, seq: KVSequence) -> None:
        if seq.status is RUNNING:  # leaves self._running at the next schedule()
            self._finished_running += 1
            self._num_running_requests -= 1
        self.blocks.free(seq.blocks[seq.released :])
        seq.blocks, seq.status, seq.released = [], FINISHED, 0
        for segment_seq in self._pins.member_done(seq.chain):
            self._running.remove(segment_seq)
