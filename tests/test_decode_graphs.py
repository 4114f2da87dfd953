"""The decode-graph path (``engine/native/decode_graphs.py``) on the CPU.

On CUDA each bucket of decode rows is a recorded graph over static buffers. Here the same
static buffers run eagerly at every step (``capture=False``) through the Triton kernels
under the interpreter (``kernels="triton"``; conftest sets ``TRITON_INTERPRET=1``): padding rows, -1 slots and rows, count-0 work items, preset
launch plans. Recording and replaying a real graph needs a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import pytest
from test_hf_backend import assert_matches_hf, check_eos_hit_mid_batch, three_level_prompts

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


@pytest.mark.parametrize("max_batch_size", [3, 17])
def test_graph_path_matches_hf_generate(tiny_llama_dir, max_batch_size):
    """Shared prefixes at two and three levels; 3 running rows use buckets 1, 2 and 4
    (padded), 17 rows bucket 24: each row's tokens equal HF generate's."""
    prompts = three_level_prompts()
    op = LLMOperator(
        tiny_llama_dir,
        backend="native",
        kernels="triton",
        cuda_graphs="on",
        max_batch_size=max_batch_size,
    )
    results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 6, ignore_eos=True)
    profile = op.backend().last_profile
    decode_steps = sum(1 for tokens, sampled, _ in profile.steps if tokens == sampled)
    assert profile.graph_steps == decode_steps > 0


def test_graph_path_with_rows_ending_at_eos(tiny_qwen2_dir, tmp_path):
    """Rows finishing at different steps (EOS) shrink the batch through the buckets; every
    row stops where HF generate stops it."""
    check_eos_hit_mid_batch(tiny_qwen2_dir, tmp_path, "native", kernels="triton", cuda_graphs="on")


def test_graphs_on_without_triton_is_a_clear_error(tiny_llama_dir):
    op = LLMOperator(tiny_llama_dir, backend="native", kernels="torch", cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs='on': it needs the Triton kernels"):
        op.generate(["Why"], SamplingParams(max_tokens=2))


def test_graphs_auto_stay_off_on_the_cpu(tiny_llama_dir):
    op = LLMOperator(tiny_llama_dir, backend="native", kernels="triton")
    op.generate(["Why", "Great value"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert op.backend().last_profile.graph_steps == 0
