"""The native engine's step builder (``engine/native/step_builder.py``) and its batch
constructors (``kernels.own_batch_arrays``, ``prefix_batch_arrays``), against the plain
per-chunk construction, over scheduler runs with shared prefixes, preemptions and rows
that end at different steps; and the batch-size defaults."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llm_operator import kernels
from llm_operator.config import EngineConfig, batch_defaults
from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.scheduler import Scheduler
from llm_operator.engine.native.step_builder import StepBuilder
from llm_operator.planner import build_plan


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Rows in a few groups sharing a prefix (some with a second shared level)."""
    heads = [[rng.randrange(100, 200) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    middles = [[rng.randrange(200, 300) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    prompts = []
    for _ in range(count):
        prompt = list(rng.choice(heads)) if rng.random() < 0.8 else []
        if prompt and rng.random() < 0.5:
            prompt += rng.choice(middles)
        prompt += [rng.randrange(300, 400) for _ in range(rng.randint(1, 12))]
        prompts.append(prompt)
    return prompts


def reference(chunks, scheduler, block_size: int) -> dict:
    """The step's arrays computed chunk by chunk from each sequence's block list."""
    ids, positions, slots, last_rows, query_start = [], [], [], [], [0]
    for seq, start, length, sample in chunks:
        for i in range(start, start + length):
            ids.append(seq.tokens[i])
            positions.append(seq.prefix_length + i)
            slots.append(seq.blocks[i // block_size] * block_size + i % block_size)
        query_start.append(len(ids))
        if sample:
            last_rows.append(len(ids) - 1)
    levels: dict[int, dict[int, list[int]]] = {}
    for c, (seq, *_rest) in enumerate(chunks):
        for level, segment_id in enumerate(seq.chain):
            levels.setdefault(level, {}).setdefault(segment_id, []).extend(
                range(query_start[c], query_start[c + 1])
            )
    return {
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "last_rows": last_rows,
        "query_start": query_start,
        "context": [start + length for _seq, start, length, _s in chunks],
        "levels": [levels[level] for level in sorted(levels)],
    }


@pytest.mark.parametrize("seed", range(6))
def test_every_step_matches_the_per_chunk_construction(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    plan = build_plan(random_prompts(rng, rng.randint(5, 40)), rng.randint(2, 24))
    # half the seeds get a pool that fits the largest row and little more: preemptions
    # re-admit rows with new block lists
    largest = max(-(-(len(r.token_ids) + r.max_tokens) // block_size) for r in plan.requests) + sum(
        -(-len(s.token_ids) // block_size) for s in plan.segments
    )
    num_blocks = largest + 2 if seed % 2 else 4 * largest
    scheduler = Scheduler(
        plan,
        BlockManager(num_blocks, block_size),
        max_batched_tokens=rng.choice([7, 64, 512]),
        max_running=rng.choice([2, 8, 64]),
        decode_reserve=0.0 if seed % 2 else 0.5,  # 0: rows outgrow the pool and preempt
    )
    builder = StepBuilder(
        block_size=block_size,
        pool_blocks=num_blocks,
        device=torch.device("cpu"),
        implementation="triton",  # block tables per chain level
        segment_blocks=scheduler.segment_blocks,
        segment_length=scheduler.segment_length,
    )
    stop = {r.request_id: rng.randint(1, r.max_tokens) for r in plan.requests}
    steps = 0
    while not scheduler.done:
        chunks = scheduler.schedule()
        if not chunks:
            break
        want = reference(chunks, scheduler, block_size)
        batch = builder.build(chunks)
        assert batch.input_ids.tolist() == want["ids"]
        assert batch.positions.tolist() == want["positions"]
        assert batch.step.slot_mapping.tolist() == want["slots"]
        assert batch.last_rows.tolist() == want["last_rows"]
        own = batch.step.own
        assert own.query_start.tolist() == want["query_start"]
        assert own.context_lens.tolist() == want["context"]
        for c, (seq, start, length, _sample) in enumerate(chunks):
            used = -(-(start + length) // block_size)
            assert own.block_tables[c, :used].tolist() == seq.blocks[:used]
        assert len(batch.step.prefixes) == len(want["levels"])
        for prefix, segments in zip(batch.step.prefixes, want["levels"]):
            got = {}
            starts = prefix.row_start.tolist()
            rows = prefix.rows.tolist()
            for s, (length, table) in enumerate(zip(prefix.lengths.tolist(), prefix.block_tables)):
                key = next(k for k in segments if scheduler.segment_length(k) == length and
                           scheduler.segment_blocks(k)[: -(-length // block_size)]
                           == table.tolist()[: -(-length // block_size)])  # fmt: skip
                got[key] = rows[starts[s] : starts[s + 1]]
            assert got == segments
        scheduler.complete(chunks)
        for seq, _start, _length, sample in chunks:
            if sample:
                if seq.num_generated + 1 >= stop[seq.ref]:
                    scheduler.finish(seq)
                    builder.release(seq)
                else:
                    scheduler.append_token(seq, 500 + steps % 7)
        steps += 1
    assert scheduler.done and steps > 0
    if seed == 3:  # this seed's pool is small enough to preempt (a check on the test itself)
        assert scheduler.stats.preemptions > 0


def test_a_readmitted_row_gets_its_new_blocks():
    """A preempted row comes back with as many blocks as before, but other ones: the table
    row must be copied again, not trusted by its length."""
    plan = build_plan([[1, 2, 3, 4, 5, 6, 7, 8]], 4)
    scheduler = Scheduler(plan, BlockManager(8, 2), max_batched_tokens=64)
    builder = StepBuilder(
        block_size=2,
        pool_blocks=8,
        device=torch.device("cpu"),
        implementation="triton",
        segment_blocks=scheduler.segment_blocks,
        segment_length=scheduler.segment_length,
    )
    chunks = scheduler.schedule()
    seq = chunks[0].seq
    first = builder.build(chunks).step.slot_mapping.tolist()
    seq.blocks = [7, 6, 5, 4]  # what a preemption and re-admission may hand it (same count)
    again = builder.build(chunks).step.slot_mapping.tolist()
    assert first == [0, 1, 2, 3, 4, 5, 6, 7]
    assert again == [14, 15, 12, 13, 10, 11, 8, 9]


def test_array_batches_equal_the_list_batches():
    rng = np.random.default_rng(0)
    for _ in range(50):
        count = int(rng.integers(0, 9))
        rows = rng.integers(0, 4, count)
        starts = np.concatenate([[0], np.cumsum(rows)])
        context = rows + rng.integers(0, 30, count)
        tables = rng.integers(0, 64, (count, 10))
        shape = {"block_size": 4, "num_blocks": 64}
        listed = kernels.own_batch(
            starts.tolist(),
            [t[: -(-c // 4)].tolist() for t, c in zip(tables, context)],
            context.tolist(),
            **shape,
        )
        arrays = kernels.own_batch_arrays(starts, tables, context, **shape)
        for name in ("query_start", "block_tables", "context_lens"):
            assert torch.equal(getattr(listed, name), getattr(arrays, name)), name
        for name in ("num_rows", "max_query_rows", "max_context_len", "host_query_start"):
            assert getattr(listed, name) == getattr(arrays, name), name


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s, t, c: (s, t, c + [5]), "context_lens"),
        (lambda s, t, c: (s, t, [0] + c[1:]), "must be >= its"),
        (lambda s, t, c: (s, [[99] * 3] + t[1:], c), r"\[0, 64\)"),
        (lambda s, t, c: ([1] + s[1:], t, c), "from 0"),
    ],
)
def test_array_batch_errors_name_the_problem(change, message):
    starts, tables, context = [0, 2, 3], [[1, 2, 3], [4, 5, 6]], [9, 5]
    starts, tables, context = change(starts, tables, context)
    with pytest.raises(ValueError, match=message):
        kernels.own_batch_arrays(
            np.array(starts), np.array(tables), np.array(context), block_size=4, num_blocks=64
        )


def test_batch_defaults_follow_the_device_memory():
    assert batch_defaults(None) == (256, 4096)  # the CPU
    assert batch_defaults(16 * 2**30) == (256, 4096)
    assert batch_defaults(40 * 2**30) == (512, 8192)
    assert batch_defaults(141 * 2**30) == (1024, 16384)  # an H200
    config = EngineConfig(max_batch_size=64).with_batch_defaults(141 * 2**30)
    assert (config.max_batch_size, config.prefill_batch_tokens) == (64, 16384)  # given wins
    assert EngineConfig().with_batch_defaults(None).max_batch_size == 256
