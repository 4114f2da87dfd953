"""The plan's schedule replayed without a model: which tokens each iteration computes.

The native scheduler is pure Python and deterministic given how many tokens each request
samples, so ``replay`` drives the real ``Scheduler`` over the plan with a stand-in for the
model: a request is sampled ``samples[request_id]`` times (an EOS that ends it counts), then
finishes. Each iteration's chunks become ``cost.FEATURES``; the cost model turns them into
seconds. Other backends are replayed under their own ``ScheduleSettings``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_operator.engine.native.block_manager import BlockManager
from llm_operator.engine.native.scheduler import Scheduler, blocks_needed
from llm_operator.estimate.cost import FEATURES, chunk_features, iteration_total
from llm_operator.planner import Plan


@dataclass(frozen=True)
class ScheduleSettings:
    """How a backend batches: the scheduler's options and its KV pool."""

    max_batched_tokens: int
    max_running: int
    block_size: int
    num_blocks: int  # the KV pool's blocks (``fit_to_plan``: the budget, cut to the plan's need)
    fit_to_plan: bool = False  # the backend sizes its pool per run (``NativeBackend._num_blocks``)
    share_prefixes: bool = True
    token_batching: bool = True
    # >0: shared prefixes are reused in whole blocks of this many tokens (vLLM's prefix cache);
    # the rest of a request's shared prefix is computed again with its own tokens
    reuse_block_size: int = 0
    copy_tails: bool = False  # native's batch-invariant mode: sequences start on block bounds


@dataclass
class Replay:
    """What a replayed run computes."""

    totals: list[float]  # cost.FEATURES summed over iterations
    iterations: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    num_blocks: int = 0  # the KV pool this run uses
    steps: list[tuple[float, ...]] = field(default_factory=list)  # per iteration (keep_steps)


def num_blocks_for(
    plan: Plan, budget_blocks: int, block_size: int, share_prefixes: bool = True
) -> int:
    """The native backend's pool for a plan: its budget, but no more than the plan could
    ever hold at once (``NativeBackend._num_blocks``, ``scheduler.blocks_needed``)."""
    return max(1, min(budget_blocks, blocks_needed(plan, block_size, share_prefixes)))


def replay(
    plan: Plan, samples: Sequence[int], settings: ScheduleSettings, *, keep_steps: bool = False
) -> Replay:
    """Run the scheduler over ``plan``; request ``i`` samples ``samples[i]`` (>= 1) tokens."""
    assert len(samples) == len(plan.requests), "one sample count per planned request"
    num_blocks = settings.num_blocks
    if settings.fit_to_plan:
        num_blocks = num_blocks_for(plan, num_blocks, settings.block_size, settings.share_prefixes)
    scheduler = Scheduler(
        plan,
        BlockManager(num_blocks, settings.block_size),
        max_batched_tokens=settings.max_batched_tokens,
        max_running=settings.max_running,
        share_prefixes=settings.share_prefixes,
        token_batching=settings.token_batching,
        copy_tails=settings.copy_tails,
    )
    left = [max(1, int(n)) for n in samples]  # tokens each request has yet to sample
    result = Replay([0.0] * len(FEATURES), num_blocks=num_blocks)
    reuse = settings.reuse_block_size
    while not scheduler.done:
        chunks = scheduler.schedule()
        if not chunks:
            break
        parts = []
        for chunk in chunks:
            seq = chunk.seq
            prefix, start, length = seq.prefix_length, chunk.start, chunk.length
            if reuse and prefix and start == 0 and seq.kind.value == "request":
                redo = prefix % reuse  # the tail of the shared prefix past its last whole block
                prefix, start, length = prefix - redo, 0, length + redo
            parts.append(
                chunk_features(start, length, prefix, sample=chunk.sample, decode=chunk.is_decode)
            )
            if not chunk.is_decode:
                result.prefill_tokens += length
        step = iteration_total(parts)
        scheduler.complete(chunks)
        for chunk in chunks:
            if chunk.sample:
                left[chunk.seq.ref] -= 1
                if left[chunk.seq.ref] <= 0:
                    scheduler.finish(chunk.seq)
                else:
                    scheduler.append_token(chunk.seq, 0)
        result.totals = [t + f for t, f in zip(result.totals, step)]
        result.iterations += 1
        if keep_steps:
            result.steps.append(tuple(step))
    result.preemptions = scheduler.stats.preemptions
    return result
