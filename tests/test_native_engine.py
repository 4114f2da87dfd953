"""LLMOperator(backend="native") against Hugging Face generate, prompt by prompt (greedy, fp32).

Paged KV with pinned prefix segments, token batching with chunked prefill, shared-prefix
attention merged by log-sum-exp: none of it may change a single token.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_backend import SYSTEM, assert_matches_hf, check_eos_hit_mid_batch, three_level_prompts

from llm_operator import LLMOperator, SamplingParams


def test_multilevel_sharing_matches_hf_generate(native_model_dir):
    prompts = three_level_prompts()
    op = LLMOperator(native_model_dir, backend="native")
    results = op.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert_matches_hf(op, native_model_dir, prompts, results, 10, ignore_eos=True)
    stats = op.last_stats
    assert stats.backend == "native"
    # every shared segment prefilled once: exactly the planner's figure
    assert stats.prefill_tokens_computed == stats.planned_prefill_tokens < stats.prompt_tokens


@pytest.mark.parametrize("block_size", [16, 4])
def test_deterministic_mode_matches_hf_generate(native_model_dir, block_size):
    """deterministic=True (batch-invariant kernels; a segment's partial last block copied
    into its readers' first block) changes no token: every family against HF generate,
    shared segments at three levels, and no token computed beyond the plan's."""
    prompts = three_level_prompts()
    op = LLMOperator(
        native_model_dir, backend="native", deterministic=True, kv_block_size=block_size
    )
    results = op.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert_matches_hf(op, native_model_dir, prompts, results, 10, ignore_eos=True)
    plan = op.plan(prompts)
    assert any(s.end % block_size for s in plan.segments)  # segments end inside blocks
    assert op.backend().last_profile.tail_copies > 0
    stats = op.last_stats
    assert (
        stats.prefill_tokens_computed == stats.planned_prefill_tokens == plan.stats.prefill_tokens
    )


@pytest.mark.parametrize(
    ("block_size", "budget"),
    [(4, 8), (4, 7), (16, 5), (3, 64), (32, 4096)],
    ids=["chunk-on-block-boundary", "chunk-mid-block", "big-block-small-chunk", "odd", "one-shot"],
)
def test_block_sizes_and_chunked_prefill_match_hf(tiny_llama_dir, block_size, budget):
    prompts = three_level_prompts()
    op = LLMOperator(
        tiny_llama_dir, backend="native", kv_block_size=block_size, prefill_batch_tokens=budget
    )
    results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 6, ignore_eos=True)


def test_without_token_batching_matches_hf_and_hf_refuses_it(tiny_llama_dir):
    prompts = three_level_prompts()
    op = LLMOperator(tiny_llama_dir, backend="native", token_batching=False, max_batch_size=2)
    results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 6, ignore_eos=True)
    assert op.backend().last_profile.max_running == 2
    hf = LLMOperator(tiny_llama_dir, backend="hf", token_batching=False)
    with pytest.raises(ValueError, match="token_batching=False"):
        hf.generate(["Why"], SamplingParams(max_tokens=2))


def test_interpreted_triton_kernels_match_hf(tiny_qwen3_dir, monkeypatch):
    """The engine with every attention op forced to the Triton kernels (run by the Triton
    interpreter on the CPU) still gives HF generate's tokens: shared segments at two and
    three levels, chunked prefill, decodes."""
    pytest.importorskip("triton")
    from llm_operator.kernels import triton_attention

    levels = []  # segment levels of each attend call (the engine's Triton path)
    attend = triton_attention.attend

    def counting(q, k_cache, v_cache, own, prefixes, scale):
        levels.append(len(prefixes))
        return attend(q, k_cache, v_cache, own, prefixes, scale)

    monkeypatch.setattr(triton_attention, "attend", counting)
    prompts = three_level_prompts()[:6]
    op = LLMOperator(
        tiny_qwen3_dir, backend="native", kernels="triton", kv_block_size=4, prefill_batch_tokens=48
    )
    results = op.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert_matches_hf(op, tiny_qwen3_dir, prompts, results, 3, ignore_eos=True)
    assert levels and max(levels) >= 2  # own parts and segments at two levels, merged
    assert op.last_stats.prefill_tokens_computed == op.last_stats.planned_prefill_tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees_with_fp32(tiny_llama_dir, dtype):
    """The bf16/fp16 path (the GPU's dtypes) on the CPU: model, cache and attention in the
    half dtype, every row completes, sharing still prefills the planner's minimum, and
    the first tokens mostly match fp32 (rounding may flip a near tie, never most rows)."""
    prompts = three_level_prompts()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    full = LLMOperator(tiny_llama_dir, backend="native").generate(prompts, params)
    op = LLMOperator(tiny_llama_dir, backend="native", dtype=dtype)
    half = op.generate(prompts, params)
    assert next(op.backend().model.parameters()).dtype == getattr(torch, dtype)
    assert [r.completion_tokens for r in half] == [4] * len(prompts)
    assert op.last_stats.prefill_tokens_computed == op.last_stats.planned_prefill_tokens
    agree = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, half))
    assert agree >= 0.8 * len(prompts)


def test_pool_smaller_than_the_group_runs_in_waves_with_preemption(tiny_qwen3_dir):
    prompts = three_level_prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # qwen3 tiny: 2 layers x 2 kv heads x 32 dims x 2 (K, V) x 4 bytes = 1 KiB per token;
    # 48 blocks of 4 tokens hold about 190 tokens: a few rows at a time
    op = LLMOperator(
        tiny_qwen3_dir, backend="native", kv_block_size=4, kv_cache_memory=48 * 4 * 1024
    )
    results = op.generate(prompts, params)
    profile = op.backend().last_profile
    assert profile.num_blocks == 48
    assert profile.preemptions > 0
    assert profile.max_running < len(prompts)
    assert_matches_hf(op, tiny_qwen3_dir, prompts, results, 12, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_eos_hit_mid_batch(family, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    check_eos_hit_mid_batch(
        model_dir, tmp_path, "native", max_batch_size=3, prefill_batch_tokens=16
    )


def test_row_that_can_never_fit_is_an_error_row(tiny_llama_dir):
    # 512 bytes per token, blocks of 4: 12 blocks = 48 tokens of KV in all
    op = LLMOperator(
        tiny_llama_dir, backend="native", kv_block_size=4, kv_cache_memory=12 * 4 * 512
    )
    prompts = ["Why", SYSTEM * 3, "Great value for the price"]
    results = op.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert results[1].finish_reason == "error" and "num_blocks" in results[1].error
    assert_matches_hf(
        op, tiny_llama_dir, [prompts[0], prompts[2]], [results[0], results[2]], 4, ignore_eos=True
    )


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_qwen2_dir):
    prompts = three_level_prompts()[:6]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    together = LLMOperator(tiny_qwen2_dir, backend="native").generate(prompts, params)
    one_by_one = LLMOperator(
        tiny_qwen2_dir, backend="native", max_batch_size=1, prefill_batch_tokens=8
    ).generate(prompts[::-1], params)[::-1]
    assert [r.token_ids for r in one_by_one] == [r.token_ids for r in together]


def _unsupported_copy(tiny_llama_dir, tmp_path):
    """The tiny Llama with biases on its MLP: HF runs it (the biases load as new weights),
    the native engine does not."""
    import json
    import shutil

    copy = tmp_path / "mlp_bias"
    shutil.copytree(tiny_llama_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(mlp_bias=True)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_native_refuses_what_it_cannot_run(tiny_llama_dir, tmp_path):
    op = LLMOperator(_unsupported_copy(tiny_llama_dir, tmp_path), backend="native")
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        op.generate(["Why"], SamplingParams(max_tokens=2))


def test_auto_runs_native_where_supported_and_hf_elsewhere(
    native_model_dir, tiny_llama_dir, tmp_path
):
    op = LLMOperator(native_model_dir)
    assert op.backend_name == "native"
    op.generate(["Why"], SamplingParams(max_tokens=2))
    assert op.last_stats.backend == "native"
    windowed = LLMOperator(_unsupported_copy(tiny_llama_dir, tmp_path))
    assert windowed.backend_name == "hf"
    result = windowed.generate(["Why"], SamplingParams(max_tokens=2))[0]
    assert result.finish_reason != "error" and windowed.last_stats.backend == "hf"


@pytest.fixture
def without_cpu_kernels(monkeypatch):
    """This process as on a machine where the compiled CPU kernels could not be built."""
    from llm_operator.kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "_state", {"module": None, "failure": "no compiler"})


@pytest.mark.parametrize("path", ["compiled-decoder", "cpp-attention", "torch", "no-cpp"])
def test_every_cpu_path_matches_hf_generate(native_model_dir, path, monkeypatch, request):
    """The CPU paths a step can take, each token-identical to HF generate: the decoder in
    one compiled call; eager layers over the compiled attention and packed GEMMs (what
    Gemma and Phi-3 take: here a model the decoder is told it cannot run); the torch
    attention (kernels="torch"); and a machine whose kernels failed to build (torch
    attention, aten GEMMs)."""
    from llm_operator.models import cpu_decoder

    options = {}
    if path == "cpp-attention":
        monkeypatch.setattr(cpu_decoder, "unsupported", lambda model: "told so")
    elif path == "torch":
        options["kernels"] = "torch"
    elif path == "no-cpp":
        request.getfixturevalue("without_cpu_kernels")
    calls = {"decoder": 0}
    run_decoder = cpu_decoder.CompiledDecoder.__call__

    def counting(self, *args, **kwargs):
        calls["decoder"] += 1
        return run_decoder(self, *args, **kwargs)

    monkeypatch.setattr(cpu_decoder.CompiledDecoder, "__call__", counting)
    prompts = three_level_prompts()
    op = LLMOperator(
        native_model_dir, backend="native", kv_block_size=4, prefill_batch_tokens=40, **options
    )
    results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert_matches_hf(op, native_model_dir, prompts, results, 6, ignore_eos=True)
    backend = op.backend()
    assert backend.paths.forward == ("compiled" if path == "compiled-decoder" else "eager")
    expected = "cpp" if path in ("compiled-decoder", "cpp-attention") else "torch"
    assert backend._pool[0] == expected  # the kernels of the last run (its KV pool layout)
    assert (calls["decoder"] > 0) == (path == "compiled-decoder")
    packed = backend.model.layers[0].qkv_proj.packed  # the torch kernels take aten's GEMM
    assert (packed is None) == (path in ("torch", "no-cpp"))


def test_op_profile_splits_each_iteration(tiny_llama_dir, monkeypatch):
    from llm_operator.engine.native.op_profile import KINDS

    op = LLMOperator(tiny_llama_dir, backend="native", profile_ops=True)
    op.generate(three_level_prompts()[:4], SamplingParams(max_tokens=5, ignore_eos=True))
    profile = op.backend().last_profile
    assert len(profile.ops) == len(profile.steps) == profile.iterations
    for split, (_, _, seconds) in zip(profile.ops, profile.steps):
        assert set(split) == set(KINDS)
        assert all(value >= 0 for value in split.values())
        assert split["linear"] > 0 and split["attention"] > 0 and split["sampling"] > 0
        assert sum(split.values()) == pytest.approx(seconds, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_kv_pool_is_reused_by_a_smaller_run(tiny_llama_dir, path, monkeypatch):
    """The KV pool of a large run serves the next, smaller one (on every attention path):
    its block count is the pool's, not the run's, and answers stay HF's."""
    op = LLMOperator(tiny_llama_dir, backend="native", kv_block_size=4, kernels=path)
    prompts = three_level_prompts()
    op.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    backend = op.backend()
    pool = backend._pool
    assert pool is not None and pool[0] == ("cpp" if path == "cpp" else "torch")
    small = prompts[:2]
    results = op.generate(small, SamplingParams(max_tokens=4, ignore_eos=True))
    assert backend._pool is pool  # reused, not reallocated
    assert backend.last_profile.num_blocks < pool[1]
    assert_matches_hf(op, tiny_llama_dir, small, results, 4, ignore_eos=True)
