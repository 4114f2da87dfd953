"""The next iteration scheduled while the device runs this one (``engine/native/overlap.py``),
forced on the CPU (``overlap="on"``), where it runs the same guesses: every
row's tokens must still be Hugging Face ``generate``'s, with rows ending at EOS, at
``max_tokens``, joining mid-run and being preempted."""

from __future__ import annotations

import pytest
from test_hf_backend import assert_matches_hf, check_eos_hit_mid_batch, three_level_prompts

from llm_operator import LLMOperator, SamplingParams
from llm_operator.engine.native import overlap


@pytest.fixture
def overlapped(monkeypatch):
    """A count of the runs that took the overlap (the tests ask for it: overlap="on")."""
    runs = []
    init = overlap.OverlappedSteps.__init__

    def counting(self, steps):
        runs.append(steps)
        init(self, steps)

    monkeypatch.setattr(overlap.OverlappedSteps, "__init__", counting)
    return runs


@pytest.mark.parametrize("options", [{"max_batch_size": 3}, {"prefill_batch_tokens": 40}, {}])
def test_overlapped_steps_match_hf_generate(tiny_llama_dir, overlapped, options):
    """Rows join as others end (3 running), prefill chunks mix with guessed decodes (40
    tokens a step), everything at once; per-row max_tokens of 1 to 7."""
    prompts = three_level_prompts()
    op = LLMOperator(tiny_llama_dir, backend="native", overlap="on", **options)
    results = op.generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 7, ignore_eos=True)
    assert len(overlapped) == 1
    one = op.generate(prompts[:5], SamplingParams(max_tokens=1, ignore_eos=True))
    assert all(len(r.token_ids) == 1 for r in one)


def test_rows_ending_at_eos_are_dropped_one_step_later(
    tiny_qwen2_dir, tmp_path, overlapped, monkeypatch
):
    dropped = []
    guess = overlap.OverlappedSteps._guess

    def counting(self, sampled, dropped_rows):
        dropped.append(len(dropped_rows))
        return guess(self, sampled, dropped_rows)

    monkeypatch.setattr(overlap.OverlappedSteps, "_guess", counting)
    check_eos_hit_mid_batch(tiny_qwen2_dir, tmp_path, "native", overlap="on", max_batch_size=4)
    assert overlapped  # the EOS run took the overlap
    assert sum(dropped) > 0, "no row ended at EOS while guessed on: a weak test"


def test_preempted_guessed_rows(tiny_llama_dir, overlapped):
    """A KV pool that cannot hold every running row: guessed rows are preempted and come
    back; the tokens are the ones computed without overlap."""
    prompts = three_level_prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    small = {"kv_block_size": 4, "kv_cache_memory": 60 * 4 * 512}
    op = LLMOperator(tiny_llama_dir, backend="native", overlap="on", **small)
    results = op.generate(prompts, params)
    assert op.backend().last_profile.preemptions > 0, "no preemption: a weak test"
    assert overlapped
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 12, ignore_eos=True)


def test_graphs_and_overlap_together(tiny_llama_dir, tmp_path, overlapped):
    check_eos_hit_mid_batch(
        tiny_llama_dir, tmp_path, "native", kernels="triton", cuda_graphs="on", overlap="on"
    )


def test_sampled_rows_do_not_overlap(tiny_llama_dir, overlapped):
    op = LLMOperator(tiny_llama_dir, backend="native", overlap="on")
    op.generate(["Why", "Great value"], SamplingParams(max_tokens=3, temperature=0.7, seed=1))
    op.generate(["Why"], SamplingParams(max_tokens=3, stop=("zz",)))
    assert overlapped == []


def test_a_preempted_request_can_finish_while_waiting():
    """What ``OverlappedSteps`` does with a guessed row that was preempted and then found
    ended: the scheduler drops it from the waiting queue and counts it finished."""
    from llm_operator.engine.native.block_manager import BlockManager
    from llm_operator.engine.native.scheduler import Scheduler
    from llm_operator.planner import build_plan

    plan = build_plan([[1, 2, 3], [4, 5, 6]], 4)
    scheduler = Scheduler(plan, BlockManager(16, 2))
    chunks = scheduler.schedule()
    scheduler.complete(chunks)
    first, second = (chunk.seq for chunk in chunks)
    scheduler._preempt(second)  # as a decode short of blocks would
    assert scheduler.blocks.num_free == 16 - len(first.blocks)
    scheduler.finish(second)
    scheduler.finish(first)
    assert scheduler.done and scheduler.blocks.num_free == 16
    assert scheduler.schedule() == []
