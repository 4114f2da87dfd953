"""The decode-graph path (``engine/native/decode_graphs.py``) on the CPU.

On CUDA each bucket of decode rows is a recorded graph over static buffers. Here the same
static buffers run eagerly at every step (``capture=False``) through the Triton kernels
under the interpreter (``kernels="triton"``; conftest sets ``TRITON_INTERPRET=1``): padding rows, -1 slots and rows, count-0 work items, preset
launch plans. Recording and replaying a real graph needs a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import pytest
from test_hf_backend import _model_with_eos, assert_matches_hf, three_level_prompts

from llm_operator import LLMOperator, SamplingParams
from llm_operator.engine.native.decode_graphs import buckets

# A bucket's padding rows compute on garbage (their attention state is never written and
# their outputs are dropped; no op mixes rows), which numpy's interpreter warns about.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_buckets_cover_every_row_count():
    sizes = buckets(300)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] >= 300 and sizes[-2] < 300
    assert sizes == sorted(set(sizes))
    for rows in range(1, 301):  # the bucket a step takes wastes under half its rows
        bucket = next(size for size in sizes if size >= rows)
        assert bucket < 2 * rows or rows <= 2
    assert buckets(1) == [1]


def _decode_sizes(op: LLMOperator) -> list[int]:
    """The row count of each decode-only step of the last run (the steps the graphs run)."""
    return [tokens for tokens, sampled, _ in op.backend().last_profile.steps if tokens == sampled]


def _bucket(rows: int) -> int:
    return next(size for size in buckets(rows) if size >= rows)


# Every step runs the kernels in the Triton interpreter (about 1 s a step), so the runs are
# kept short: 4 tokens a row (3 decode steps each through the graph path), 12 rows at
# max_batch_size 3 (waves of rows replacing finished ones), all 18 at 17.
@pytest.mark.parametrize(("max_batch_size", "rows"), [(3, 12), (17, 18)])
def test_graph_path_matches_hf_generate(tiny_llama_dir, max_batch_size, rows):
    """Shared prefixes at two and three levels; 3 running rows use buckets 4 (padded) and
    2, 17 rows bucket 24 (padded), then 16 and 1: each row's tokens equal HF generate's."""
    prompts = three_level_prompts()[:rows]
    op = LLMOperator(
        tiny_llama_dir,
        backend="native",
        kernels="triton",
        cuda_graphs="on",
        max_batch_size=max_batch_size,
    )
    results = op.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 4, ignore_eos=True)
    profile = op.backend().last_profile
    sizes = _decode_sizes(op)
    assert profile.graph_steps == len(sizes) > 0
    # a full batch runs in a bigger bucket: rows of padding went through every kernel
    assert max_batch_size in sizes and _bucket(max_batch_size) > max_batch_size, sizes


def test_graph_path_with_rows_ending_at_eos(tiny_qwen2_dir, tmp_path):
    """Rows finishing at different steps (EOS) shrink the batch through the buckets; every
    row stops where HF generate stops it. (test_hf_backend's check_eos_hit_mid_batch on 6
    rows of 8 tokens: under the interpreter each step costs about a second.)"""
    prompts = three_level_prompts()[:6]
    probe = LLMOperator(tiny_qwen2_dir, backend="native")
    outs = probe.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    counts: dict[int, int] = {}
    for r in outs:
        for t in set(r.token_ids[1:6]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((c, t) for t, c in counts.items() if c < len(prompts))[1]
    eos_dir = _model_with_eos(tiny_qwen2_dir, tmp_path, eos)
    op = LLMOperator(eos_dir, backend="native", kernels="triton", cuda_graphs="on")
    results = op.generate(prompts, SamplingParams(max_tokens=8))
    assert {r.finish_reason for r in results} == {"stop", "length"}
    for r in results:
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == eos)
    assert_matches_hf(op, eos_dir, prompts, results, 8)
    sizes = _decode_sizes(op)
    assert op.backend().last_profile.graph_steps == len(sizes)
    assert len({_bucket(size) for size in sizes}) >= 2, sizes  # the batch changed buckets


def test_graphs_on_without_triton_is_a_clear_error(tiny_llama_dir):
    op = LLMOperator(tiny_llama_dir, backend="native", kernels="torch", cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs='on': it needs the Triton kernels"):
        op.generate(["Why"], SamplingParams(max_tokens=2))


def test_graphs_auto_stay_off_on_the_cpu(tiny_llama_dir):
    op = LLMOperator(tiny_llama_dir, backend="native", kernels="triton")
    op.generate(["Why", "Great value"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert op.backend().last_profile.graph_steps == 0
