"""Native block manager and scheduler, driven by a fake model loop (pure Python, no torch).

FakeRunner plays the model runner. It keeps a simulated paged KV cache (``kv[block][slot]`` is
the token whose K/V would sit there), reads every chunk's context back through the block
tables (chain segments first, then the sequence's own blocks) and compares it with the true
token sequence, "samples" deterministic tokens, and checks the scheduler's invariants after
every iteration. Budget: decodes always all run and go first; since a request decodes only
after a prefill chunk that fit in the budget, an iteration never exceeds ``max_batched_tokens``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.scheduler import Scheduler, blocks_needed
from llm_operator.engine.native.sequence import READY, RUNNING
from llm_operator.planner import build_plan


def fake_token(request_id: int, index: int) -> int:
    return 10_000 + 97 * request_id + index


def effective_chain(request, share_prefixes: bool) -> tuple[int, ...]:
    """The segments a request reads: an entirely shared prompt prefills its last segment itself."""
    if not share_prefixes:
        return ()
    chain = request.chain
    return chain[:-1] if chain and request.prefix_length == len(request.token_ids) else chain


class FakeRunner:
    def __init__(self, plan, blocks, scheduler, stop_after, *, allow_evictions=False):
        self.plan, self.blocks, self.scheduler = plan, blocks, scheduler
        self.stop_after = stop_after  # tokens each request generates, by request id
        self.allow_evictions = allow_evictions
        self.kv = [[None] * blocks.block_size for _ in range(blocks.num_blocks)]
        self.chains = [effective_chain(r, scheduler.share_prefixes) for r in plan.requests]
        self.pending = [0] * len(plan.segments)
        for chain in self.chains:
            for segment_id in chain:
                self.pending[segment_id] += 1
        self.outputs: dict[int, list[int]] = {}
        self.log: list[list[tuple]] = []  # per iteration: (kind, ref, start, length, is_decode)
        self.finished_at: dict[int, int] = {}  # request id -> iteration of its last chunk
        self.lifetime_chain: dict[int, dict[int, list[int]]] = {}
        self.pinned: dict[int, list[int]] = {}
        self.seen_rejected = 0
        self.prefill_tokens = self.decode_tokens = self.copies = 0
        self.decode_only = 0  # iterations whose decodes took the whole budget while prefill waited

    def run(self, max_iterations: int = 20_000) -> FakeRunner:
        scheduler = self.scheduler
        while not scheduler.done:
            assert len(self.log) < max_iterations, "no progress: livelock"
            chunks = scheduler.schedule()
            for source, destination in scheduler.copies:  # tail copies, before the step
                self.kv[destination] = list(self.kv[source])
            heads = [c.seq.blocks[0] for c in chunks if c.seq.head and c.start == c.seq.head]
            assert sorted(d for _, d in scheduler.copies) == sorted(heads), "a head not copied"
            self.copies += len(scheduler.copies)
            self.note_rejections()
            if not chunks:
                assert scheduler.done, "schedule() returned nothing while work remains"
                break
            self.log.append(
                [(c.seq.kind, c.seq.ref, c.start, c.length, c.is_decode) for c in chunks]
            )
            self.check_iteration(chunks)
            for chunk in chunks:
                self.check_context(chunk)
            for chunk in chunks:
                self.write(chunk)
            scheduler.complete(chunks)
            for chunk in chunks:
                if chunk.sample:
                    self.sample(chunk.seq)
            self.check_state()
        self.check_end()
        return self

    # ---------------------------------------------------------------- model stand-in

    def position(self, blocks, position):
        size = self.blocks.block_size
        return self.kv[blocks[position // size]][position % size]

    def check_context(self, chunk) -> None:
        """What attention would read: chain segments' K/V, then own K/V before ``start``."""
        seq, scheduler = chunk.seq, self.scheduler
        context = []
        for segment_id in seq.chain:
            blocks = scheduler.segment_blocks(segment_id)
            context += [
                self.position(blocks, p) for p in range(scheduler.segment_length(segment_id))
            ]
        context += [self.position(seq.blocks, p) for p in range(chunk.start)]
        chain_tokens = [t for s in seq.chain for t in self.plan.segments[s].token_ids]
        whole = chain_tokens + seq.tokens[seq.head :]  # a head repeats the chain's last tokens
        assert context == whole[: seq.prefix_length + chunk.start]

    def write(self, chunk) -> None:
        seq, size = chunk.seq, self.blocks.block_size
        for p in range(chunk.start, chunk.start + chunk.length):
            self.kv[seq.blocks[p // size]][p % size] = seq.tokens[p]
        if chunk.is_decode:
            self.decode_tokens += 1
        else:
            self.prefill_tokens += chunk.length

    def sample(self, seq) -> None:
        index = seq.num_generated
        token = fake_token(seq.ref, index)
        if index + 1 < self.stop_after[seq.ref]:
            self.scheduler.append_token(seq, token)
            return
        assert seq.ref not in self.outputs, f"request {seq.ref} finished twice"
        self.outputs[seq.ref] = seq.tokens[seq.prompt_length :] + [token]
        self.finished_at[seq.ref] = len(self.log) - 1
        self.scheduler.finish(seq)
        self.member_done(seq.ref)

    def member_done(self, request_id: int) -> None:
        for segment_id in self.chains[request_id]:
            self.pending[segment_id] -= 1

    def note_rejections(self) -> None:
        for request_id, _ in self.scheduler.rejected[self.seen_rejected :]:
            self.member_done(request_id)
        self.seen_rejected = len(self.scheduler.rejected)

    # ---------------------------------------------------------------- invariants

    def has_waiting_prefill(self) -> bool:
        return any(q.num_computed < q.prompt_length for q in self.scheduler.running)

    def check_iteration(self, chunks) -> None:
        scheduler, plan = self.scheduler, self.plan
        decodes = [c.is_decode for c in chunks]
        assert decodes == sorted(decodes, reverse=True), "a prefill chunk precedes a decode"
        num_decodes = sum(decodes)
        prefill = sum(c.length for c in chunks if not c.is_decode)
        assert num_decodes + prefill <= scheduler.max_batched_tokens, "budget exceeded"
        self.decode_only += (
            num_decodes == scheduler.max_batched_tokens and self.has_waiting_prefill()
        )
        assert len({id(c.seq) for c in chunks}) == len(chunks), "a sequence chunked twice"
        scheduled = {id(c.seq) for c in chunks}
        running = [q for q in scheduler.running if q.kind == "request"]
        assert len(running) <= scheduler.max_running
        for seq in running:
            if seq.num_computed >= seq.prompt_length and len(seq.tokens) - seq.num_computed == 1:
                assert id(seq) in scheduled, f"running decode of request {seq.ref} left out"
        for chunk in chunks:
            seq = chunk.seq
            end = chunk.start + chunk.length
            assert seq.status == RUNNING and chunk.length >= 1
            assert chunk.start == seq.num_computed and end <= len(seq.tokens)
            assert chunk.sample == (seq.kind == "request" and end == len(seq.tokens))
            for segment_id in seq.chain:
                segment_seq = scheduler.segment_sequence(segment_id)
                assert segment_seq is not None and segment_seq.status == READY, "chunk before READY"
            chain_tokens = [t for s in seq.chain for t in plan.segments[s].token_ids]
            assert seq.prefix_length + seq.head == len(chain_tokens)
            if scheduler.copy_tails:  # every sequence starts on a block boundary
                assert seq.prefix_length % self.blocks.block_size == 0
                assert seq.head < self.blocks.block_size
            else:
                assert seq.head == 0
            if seq.kind == "request":
                assert seq.chain == self.chains[seq.ref]
                assert len(seq.blocks) == self.blocks.blocks_for(end), "blocks are allocated lazily"
                prompt = chain_tokens + seq.tokens[seq.head : seq.prompt_length]
                assert prompt == list(plan.requests[seq.ref].token_ids)
                generated = [fake_token(seq.ref, i) for i in range(seq.num_generated)]
                assert seq.tokens[seq.prompt_length :] == generated
            else:
                segment = plan.segments[seq.ref]
                assert seq.tokens[seq.head :] == list(segment.token_ids)
                assert seq.prefix_length + seq.head == segment.start
                assert len(seq.blocks) == self.blocks.blocks_for(len(seq.tokens))
            chain_blocks = {s: scheduler.segment_blocks(s) for s in seq.chain}
            if chunk.start == seq.head:  # a new admission (first or after preemption)
                self.lifetime_chain[seq.seq_id] = chain_blocks
            assert self.lifetime_chain[seq.seq_id] == chain_blocks, "a prefix moved under a reader"

    def check_state(self) -> None:
        scheduler, plan = self.scheduler, self.plan
        self.note_rejections()
        live = list(scheduler.running)
        for segment_id, segment in enumerate(plan.segments):
            segment_seq = scheduler.segment_sequence(segment_id)
            if self.pending[segment_id] == 0:
                assert segment_seq is None, f"segment {segment_id} outlives its last member"
                self.pinned.pop(segment_id, None)
            if segment_seq is not None and segment_seq.status == READY:
                live.append(segment_seq)
                tokens = segment_seq.tokens
                stored = [self.position(segment_seq.blocks, p) for p in range(len(tokens))]
                assert stored == tokens, "a pinned block was overwritten"
                assert tokens[segment_seq.head :] == list(segment.token_ids)
                if segment_id in self.pinned and self.pinned[segment_id] != segment_seq.blocks:
                    assert self.allow_evictions, f"segment {segment_id} re-pinned elsewhere"
                self.pinned[segment_id] = list(segment_seq.blocks)
            elif segment_id in self.pinned:
                assert self.allow_evictions, f"pinned segment {segment_id} freed while pending"
                del self.pinned[segment_id]
        owned = [block for seq in live for block in seq.blocks]
        assert len(owned) == len(set(owned)), "a block belongs to two live owners"
        assert len(owned) == self.blocks.num_blocks - self.blocks.num_free, "blocks leaked"

    def check_end(self) -> None:
        scheduler = self.scheduler
        assert scheduler.done and not scheduler.running
        assert self.blocks.num_free == self.blocks.num_blocks, "blocks left in use"
        rejected = [request_id for request_id, _ in scheduler.rejected]
        assert len(set(rejected)) == len(rejected) and set(rejected).isdisjoint(self.outputs)
        assert set(rejected) | set(self.outputs) == set(range(len(self.plan.requests)))
        for request_id, output in self.outputs.items():
            expected = [fake_token(request_id, i) for i in range(self.stop_after[request_id])]
            assert output == expected, f"request {request_id} generated {output}"
        assert self.pending == [0] * len(self.plan.segments)
        assert scheduler.stats.prefill_tokens == self.prefill_tokens
        assert scheduler.stats.decode_tokens == self.decode_tokens
        assert scheduler.stats.tail_copies == self.copies
        assert scheduler.stats.iterations == len(self.log)
        assert scheduler.stats.max_running <= scheduler.max_running
        if not self.allow_evictions:
            assert scheduler.stats.segment_evictions == 0


def run_workload(prompts, max_tokens, *, num_blocks, block_size, stop_after=None, **options):
    """Plan, schedule and fake-run a batch; ``stop_after`` is per input row (default max_tokens)."""
    allow_evictions = options.pop("allow_evictions", False)
    plan = build_plan(prompts, max_tokens)
    per_row = stop_after or (
        [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    )
    stop = [per_row[request.rows[0]] for request in plan.requests]
    blocks = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(plan, blocks, **options)
    runner = FakeRunner(plan, blocks, scheduler, stop, allow_evictions=allow_evictions)
    return runner.run()


def outputs_by_row(runner) -> dict[int, list[int]]:
    return {
        row: runner.outputs[request.request_id]
        for request in runner.plan.requests
        if request.request_id in runner.outputs
        for row in request.rows
    }


def expected_prefill(plan, share_prefixes=True) -> int:
    """Own tokens computed once each: used segments plus every request's own prompt."""
    chains = [effective_chain(r, share_prefixes) for r in plan.requests]
    used = {segment_id for chain in chains for segment_id in chain}
    own = sum(
        len(r.token_ids) - (plan.segments[c[-1]].end if c else 0)
        for r, c in zip(plan.requests, chains)
    )
    return own + sum(len(plan.segments[s].token_ids) for s in used)


# -------------------------------------------------------------------- block manager


def test_block_manager_hands_out_distinct_blocks_and_takes_them_back():
    blocks = BlockManager(num_blocks=5, block_size=4)
    assert (blocks.num_free, blocks.blocks_for(0), blocks.blocks_for(4), blocks.blocks_for(5)) == (
        5,
        0,
        1,
        2,
    )
    first = blocks.allocate(3)
    assert first == [0, 1, 2] and blocks.num_free == 2
    with pytest.raises(RuntimeError, match="only 2 of 5"):
        blocks.allocate(3)
    blocks.free(first[:1])
    assert sorted(blocks.allocate(3)) == [0, 3, 4] and blocks.num_free == 0
    with pytest.raises(AssertionError, match="freed twice"):
        blocks.free([1, 1])
    with pytest.raises(AssertionError, match="unknown"):
        blocks.free([7])


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 1)])
def test_block_manager_rejects_empty_pools(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"max_batched_tokens": 0}, ValueError),
        ({"max_running": 0}, ValueError),
        ({"decode_reserve": -0.5}, ValueError),
        ({"decode_reserve": float("nan")}, ValueError),
        ({"share_prefixes": "yes"}, TypeError),
        ({"token_batching": 1}, TypeError),
        ({"max_running": 2.0}, TypeError),
    ],
)
def test_scheduler_validates_options(options, error):
    plan = build_plan([[1, 2, 3]], 2)
    with pytest.raises(error, match=next(iter(options))):
        Scheduler(plan, BlockManager(4, 4), **options)


# -------------------------------------------------------------------- scheduling rules

SYSTEM = list(range(100, 120))
DOCUMENTS = [list(range(200 + 20 * d, 210 + 20 * d)) for d in range(3)]
TWO_LEVEL = [
    SYSTEM + doc + [1000 + 10 * d + q, 7, 8] for d, doc in enumerate(DOCUMENTS) for q in range(4)
]


def test_two_level_prefixes_are_prefilled_once_and_pinned():
    runner = run_workload(TWO_LEVEL, 6, num_blocks=200, block_size=4, max_batched_tokens=16)
    plan, stats = runner.plan, runner.scheduler.stats
    assert any(segment.parent_id is not None for segment in plan.segments)
    for segment in plan.segments:
        lengths = [
            c[3] for it in runner.log for c in it if c[:2] == ("segment", segment.segment_id)
        ]
        assert sum(lengths) == len(segment.token_ids)
    assert stats.preemptions == 0 and stats.prefill_tokens == plan.stats.prefill_tokens
    assert len(runner.outputs) == len(TWO_LEVEL)


def test_group_larger_than_pool_runs_in_waves_with_preemption():
    prompts = [SYSTEM[:8] + [500 + 4 * i, 501, 502, 503] for i in range(16)]
    stop = [1 + (5 * i) % 12 for i in range(16)]
    ample = run_workload(
        prompts, 12, stop_after=stop, num_blocks=200, block_size=4, decode_reserve=0.0
    )
    tight = run_workload(
        prompts, 12, stop_after=stop, num_blocks=8, block_size=4, decode_reserve=0.0
    )
    assert ample.scheduler.stats.preemptions == 0
    assert tight.scheduler.stats.preemptions > 0
    assert tight.scheduler.stats.max_running < 16
    assert not tight.scheduler.rejected
    assert outputs_by_row(tight) == outputs_by_row(ample)
    assert tight.scheduler.stats.prefill_tokens > ample.scheduler.stats.prefill_tokens  # recompute


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 8, 13])
def test_chunks_split_prompts_mid_block_and_on_block_boundaries(budget):
    runner = run_workload(
        [list(range(300, 313))], 3, num_blocks=8, block_size=4, max_batched_tokens=budget
    )
    starts = [c[2] for it in runner.log for c in it if not c[4]]
    assert starts == list(range(0, 13, budget))
    assert any(start % 4 for start in starts) == (budget % 4 != 0 and budget < 13)
    mixed = [list(range(300, 313)), list(range(400, 409)), [9, 9, 9, 9], [5]]
    run_workload(mixed, 3, num_blocks=12, block_size=4, max_batched_tokens=budget)


def test_request_that_never_fits_is_rejected_while_the_others_complete():
    prompts = [[1, 2, 3, 4, 5, 6], list(range(600, 700)), [7, 8, 9, 10, 11, 12]]
    runner = run_workload(prompts, 4, num_blocks=8, block_size=4)
    ((request_id, message),) = runner.scheduler.rejected
    assert runner.plan.requests[request_id].rows == (1,)
    for part in ("can never fit", "100 own tokens", "26 blocks of 4 tokens", "num_blocks=8"):
        assert part in message
    assert sorted(outputs_by_row(runner)) == [0, 2]


def test_new_request_joins_the_iteration_its_blocks_free():
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    plan = build_plan(prompts, 8)
    first, second, third = (request.rows[0] for request in plan.requests)
    stop = [8, 8, 8]
    stop[first] = 2
    runner = run_workload(
        prompts, 8, stop_after=stop, num_blocks=6, block_size=4, decode_reserve=1.0
    )
    assert runner.scheduler.stats.max_running == 2
    freed = runner.finished_at[0]
    assert all(c[1] != 2 for it in runner.log[: freed + 1] for c in it)
    assert ("request", 1) in [c[:2] for c in runner.log[freed + 1] if c[4]]
    assert ("request", 2, 0) in [c[:3] for c in runner.log[freed + 1] if not c[4]]


def test_entirely_shared_prompt_prefills_its_last_segment_itself():
    prefix = list(range(50, 58))
    prompts = [prefix, prefix + [1, 2, 3], prefix + [4, 5], prefix]
    runner = run_workload(prompts, 3, num_blocks=20, block_size=4)
    plan = runner.plan
    assert any(r.prefix_length == len(r.token_ids) for r in plan.requests)
    assert runner.scheduler.stats.prefill_tokens == expected_prefill(plan)
    assert len(runner.outputs) == 4


@pytest.mark.parametrize("max_running, evictions", [(1, 1), (4, 0)])
def test_pins_held_for_waiting_members_are_evicted_only_as_a_last_resort(max_running, evictions):
    # After [P + 1] finishes, P is pinned for [P + 2] while the entirely shared prompts P need
    # the whole pool. Looking ahead finds [P + 2] (which can use the pin); with a look-ahead
    # of one request the pin is evicted and recomputed instead of rejecting a fitting request.
    prefix = [5, 6, 7, 8]
    prompts = [prefix + [1], prefix, prefix, prefix + [2]]
    runner = run_workload(
        prompts, [2, 1, 1, 1], stop_after=[1, 1, 1, 1], num_blocks=6, block_size=1,
        max_batched_tokens=1, max_running=max_running, decode_reserve=0.0, allow_evictions=True,
    )  # fmt: skip
    assert [r.rows[0] for r in runner.plan.requests] == [0, 1, 2, 3]
    assert runner.scheduler.stats.segment_evictions == evictions
    assert not runner.scheduler.rejected and len(runner.outputs) == 4


def test_decodes_take_the_budget_before_any_prefill():
    # Members admitted while their segment prefills cost no budget; once it is READY their
    # 1-token suffixes prefill four at a time, then four decodes fill the budget and the
    # remaining members wait (never the running rows).
    prompts = [[60, 61, 62, 63, 64, 65, 70 + i] for i in range(6)]
    runner = run_workload(prompts, 6, num_blocks=40, block_size=2, max_batched_tokens=4)
    assert runner.scheduler.stats.max_running == 6
    assert runner.decode_only > 0


def test_without_token_batching_requests_run_in_waves():
    prompts = [[10 * i + j for j in range(1, 5)] for i in range(1, 7)]  # 6 unshared prompts
    stop = [2, 7, 3, 3, 6, 1]
    options = dict(stop_after=stop, num_blocks=40, block_size=4, max_running=2)
    waves = run_workload(prompts, 8, token_batching=False, **options)
    batched = run_workload(prompts, 8, **options)
    assert outputs_by_row(waves) == outputs_by_row(batched)
    # A request first runs only after every request that ran before it has finished,
    # unless it was admitted in the same iteration (one wave of up to max_running).
    first_seen: dict[int, int] = {}
    for index, iteration in enumerate(waves.log):
        for _, ref, *_ in iteration:
            first_seen.setdefault(ref, index)
    for ref, start in first_seen.items():
        for other, other_start in first_seen.items():
            if other_start < start:
                assert waves.finished_at[other] < start, (ref, other)
    assert waves.scheduler.stats.max_running == 2
    assert len(waves.log) > len(batched.log)  # the short rows' slots idle until the wave ends


def test_share_prefixes_false_ignores_segments():
    runner = run_workload(TWO_LEVEL, 2, num_blocks=100, block_size=4, share_prefixes=False)
    assert all(c[0] == "request" for it in runner.log for c in it)
    assert runner.scheduler.stats.prefill_tokens == sum(len(p) for p in TWO_LEVEL)


def test_runner_must_resolve_every_sampled_chunk():
    plan = build_plan([[1, 2, 3]], 2)
    scheduler = Scheduler(plan, BlockManager(4, 4))
    scheduler.complete(scheduler.schedule())
    with pytest.raises(AssertionError, match="append_token"):
        scheduler.schedule()


# -------------------------------------------------------------------- random workloads


@st.composite
def workloads(draw, tight=False):
    """Prompts with shared system/document prefixes; tight: more rows, no reserve, no spare."""
    vocabulary = draw(st.integers(2, 5))
    token = st.integers(0, vocabulary - 1)
    rows = st.lists(st.lists(token, max_size=5), min_size=1 + tight, max_size=3)
    prompts = []
    for system in draw(
        st.lists(st.lists(token, min_size=1, max_size=10), min_size=1 + tight, max_size=3)
    ):
        for document in draw(st.lists(st.lists(token, max_size=8), min_size=1, max_size=2)):
            prompts += [system + document + suffix for suffix in draw(rows)]
    max_tokens = [draw(st.integers(1 + 3 * tight, 12)) for _ in prompts]
    stop = [draw(st.integers(1, budget)) for budget in max_tokens]
    oversized = draw(st.booleans())
    if oversized:  # shares nothing and can never fit
        prompts.append([vocabulary + 7] * 400)
        max_tokens.append(2)
        stop.append(2)
    return SimpleNamespace(
        prompts=prompts,
        max_tokens=max_tokens,
        stop=stop,
        oversized=oversized,
        block_size=draw(st.integers(1, 5)),
        spare_blocks=0 if tight else draw(st.sampled_from([0, 0, 1, 2, 8])),
        options={
            "max_batched_tokens": draw(st.integers(1 + 3 * tight, 24)),
            "max_running": draw(st.integers(1 + 3 * tight, 8)),
            "decode_reserve": 0.0 if tight else draw(st.sampled_from([0.0, 0.5, 1.0])),
            "share_prefixes": draw(st.booleans()),
            "copy_tails": draw(st.booleans()),
        },
    )


def check_random_workload(workload) -> FakeRunner:
    """Size the pool to the largest request that fits, run, and check rejections and prefill."""
    plan = build_plan(workload.prompts, workload.max_tokens)
    blocks_for = BlockManager(1, workload.block_size).blocks_for
    share = workload.options["share_prefixes"]
    # with tail copies, a sequence also holds the tokens of its chain's last partial block
    size = workload.block_size if workload.options["copy_tails"] else None

    def head(start: int) -> int:
        return start % size if size and start else 0

    needs = {}
    for request in plan.requests:
        chain = effective_chain(request, share)
        chain_blocks = sum(
            blocks_for(head(plan.segments[s].start) + len(plan.segments[s].token_ids))
            for s in chain
        )
        prefix = plan.segments[chain[-1]].end if chain else 0
        own = len(request.token_ids) - prefix + head(prefix)
        stop = workload.stop[request.rows[0]]
        needs[request.request_id] = (
            chain_blocks + blocks_for(own + 1),
            chain_blocks + blocks_for(own + stop),
        )
    oversized_row = len(workload.prompts) - 1 if workload.oversized else None
    num_blocks = workload.spare_blocks + max(
        full for rid, (_, full) in needs.items() if plan.requests[rid].rows[0] != oversized_row
    )
    runner = run_workload(
        workload.prompts,
        workload.max_tokens,
        stop_after=workload.stop,
        num_blocks=num_blocks,
        block_size=workload.block_size,
        allow_evictions=True,
        **workload.options,
    )
    rejected = {request_id for request_id, _ in runner.scheduler.rejected}
    assert rejected == {rid for rid, (least, _) in needs.items() if least > num_blocks}
    assert len(rejected) == int(workload.oversized)
    stats = runner.scheduler.stats
    if stats.preemptions == 0 and stats.segment_evictions == 0:
        assert stats.prefill_tokens == expected_prefill(plan, share) - sum(
            len(plan.requests[rid].token_ids) for rid in rejected
        )  # tail copies compute no token twice
    if not (size and share):
        assert stats.tail_copies == 0
    return runner


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    check_random_workload(workload)


@settings(max_examples=300, deadline=None)
@given(workloads(tight=True))
def test_random_tight_pools_preempt_and_still_complete(workload):
    check_random_workload(workload)


def test_tail_copies_start_every_sequence_on_a_block_boundary():
    """A 6-token system prompt in blocks of 4: with copy_tails each reader takes the
    segment's partial block (2 tokens) as its head, copied rather than computed, so
    prefill is the same as without (the fake runner checks every context it reads)."""
    prompts = [[1, 2, 3, 4, 5, 6, 10 + i, 20 + i] for i in range(3)]
    plain = run_workload(prompts, 2, num_blocks=32, block_size=4)
    copied = run_workload(prompts, 2, num_blocks=32, block_size=4, copy_tails=True)
    stats = copied.scheduler.stats
    assert (stats.tail_copies, stats.copied_tokens) == (3, 6)
    assert stats.prefill_tokens == plain.scheduler.stats.prefill_tokens == 6 + 3 * 2
    assert copied.outputs == plain.outputs


@settings(max_examples=300, deadline=None)
@given(workloads(tight=True))
def test_a_pool_of_blocks_needed_never_makes_a_row_wait_for_memory(workload):
    """The native backend sizes its pool to ``blocks_needed`` when the budget allows. That
    must bound what the run ever holds, so a pool that size schedules exactly as a roomier
    one: nothing rejected, preempted or evicted, the same iterations."""
    plan = build_plan(workload.prompts, workload.max_tokens)
    need = blocks_needed(plan, workload.block_size, workload.options["share_prefixes"])
    # every request admitted at once and prefilled in one iteration: the most memory held
    options = {**workload.options, "max_running": 10_000, "max_batched_tokens": 10_000}

    def run(num_blocks):
        return run_workload(
            workload.prompts,
            workload.max_tokens,  # every row generates its whole budget
            num_blocks=num_blocks,
            block_size=workload.block_size,
            **options,
        )

    roomy, fitted = run(4 * need + 64), run(need)
    assert roomy.scheduler.stats.peak_blocks <= need
    stats = fitted.scheduler.stats
    assert fitted.scheduler.rejected == []
    assert (stats.preemptions, stats.segment_evictions) == (0, 0)
    assert stats.iterations == roomy.scheduler.stats.iterations
    assert fitted.outputs == roomy.outputs


def test_blocks_needed_counts_a_shared_document_once():
    """Five rows after one 100-token document, blocks of 16, 3 outputs each: the document's
    7 blocks once, then each row's 7 own tokens (from the block boundary before them: 4 of
    the document's tokens, 14 tokens in all) in 1 block plus 1 of slack. Without sharing
    every row holds its whole 107 + 3 tokens."""
    document = list(range(100))
    prompts = [document + [1000 + 10 * row + i for i in range(7)] for row in range(5)]
    plan = build_plan(prompts, 3)
    assert blocks_needed(plan, 16, share_prefixes=True) == 7 + 5 * (1 + 1)
    assert blocks_needed(plan, 16, share_prefixes=False) == 5 * (7 + 1)
