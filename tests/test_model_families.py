"""Gemma 3, Gemma 2, Phi-3 and sliding-window attention in the native engine against
Hugging Face ``generate`` (greedy, fp32; issue 32).

Every tiny family has windows of TINY_WINDOW tokens: the prompts are longer than the
window, their shared prefixes (the system prompt, the documents) are too, and short
prompts cross the window while they decode. Gemma 3 mixes sliding layers (a local rope
base) with a global one; Gemma 2 soft-caps its attention scores (the torch kernels) and
its logits; Phi-3's checkpoint holds fused projections; Qwen2 slides in its upper layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import (
    LONGROPE_FAMILY,
    TINY_LONGROPE_POSITIONS,
    TINY_WINDOW,
    WINDOW_FAMILIES,
    hf_generate_greedy,
)
from test_hf_backend import assert_matches_hf, three_level_prompts

from llm_operator import LLMOperator, SamplingParams
from llm_operator.models import llama
from llm_operator.models.llama import LlamaModel, native_config

SHORT = ["Why", "Great value", "Refund received, thank"]  # cross the window mid-decode


def _prompts() -> list[str]:
    return three_level_prompts() + SHORT


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_window_families_match_hf_generate(family, window_family_dirs):
    """The default engine (on a CPU without AMX: the batch-invariant kernels, segments on
    block boundaries), blocks of 4 tokens (a window of 12 spans blocks and parts of them)."""
    model_dir = window_family_dirs(family)
    op = LLMOperator(model_dir, backend="native", kv_block_size=4)
    assert op.plan(_prompts()).requests  # the plan shares prefixes longer than the window
    prompts = _prompts()
    results = op.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert op.last_stats.backend == "native"
    assert_matches_hf(op, model_dir, prompts, results, 16, ignore_eos=True)
    stats = op.last_stats
    assert stats.prefill_tokens_computed == stats.planned_prefill_tokens < stats.prompt_tokens
    ids = [op.tokenizer(p)["input_ids"] for p in prompts]
    assert max(len(i) for i in ids) > 4 * TINY_WINDOW
    assert min(len(i) for i in ids) < TINY_WINDOW < min(len(i) for i in ids) + 16


@pytest.mark.parametrize("family", ["gemma3", "mistral_window", "qwen2_mixed", "phi3"])
@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_window_kernels_match_hf_generate(family, kernels, window_family_dirs):
    """The fast (not batch-invariant) compiled kernels, and the torch kernels, which also
    leave out of a row's batch the segments its window misses."""
    model_dir = window_family_dirs(family)
    op = LLMOperator(
        model_dir, backend="native", kernels=kernels, deterministic=False, kv_block_size=8
    )
    prompts = _prompts()
    results = op.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 12, ignore_eos=True)


def test_the_window_changes_the_tokens(window_family_dirs, monkeypatch):
    """The negative control: the same engine with the windows taken away disagrees with
    HF on most rows (the tests above would catch a window that is not applied)."""
    model_dir = window_family_dirs("mistral_window")
    original = llama.native_config

    def without_windows(config):
        native = original(config)
        return dataclasses.replace(native, layer_windows=(None,) * native.num_layers)

    monkeypatch.setattr(llama, "native_config", without_windows)
    op = LLMOperator(model_dir, backend="native")
    prompts = three_level_prompts()
    results = op.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    differ = sum(
        list(r.token_ids)
        != hf_generate_greedy(model_dir, op.tokenizer(p)["input_ids"], 8, ignore_eos=True)
        for p, r in zip(prompts, results)
    )
    assert differ > len(prompts) // 2


def test_family_configs_read(window_family_dirs):
    from transformers import AutoConfig

    def read(family):
        return native_config(AutoConfig.from_pretrained(window_family_dirs(family)))

    gemma3 = read("gemma3")
    assert gemma3.layer_windows == (TINY_WINDOW, TINY_WINDOW, None, TINY_WINDOW)
    assert gemma3.gemma and gemma3.qk_norm and gemma3.local_rope
    assert gemma3.scale == 24**-0.5 and gemma3.hidden_act == "gelu_pytorch_tanh"
    gemma2 = read("gemma2")
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (5.0, 3.0)
    assert gemma2.layer_windows == (TINY_WINDOW, None) and not gemma2.qk_norm
    assert read("phi3").fused_checkpoint and read("phi3").layer_windows == (TINY_WINDOW,) * 2
    assert read("qwen2_mixed").layer_windows == (None, TINY_WINDOW)


def test_unsupported_families_say_what_runs_them():
    from transformers import Gemma3Config, GPT2Config, Phi3Config

    with pytest.raises(ValueError, match="model_type='gpt2'.*backend='hf'"):
        native_config(GPT2Config())
    with pytest.raises(ValueError, match="multimodal Gemma 3.*gemma3_text"):
        native_config(Gemma3Config())
    odd = Phi3Config(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.31})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.31 rotates 29 of 96"):
        native_config(odd)


def test_gemma3_bfloat16_logits_match_hf(window_family_dirs):
    """bf16: Gemma's norms in fp32 then rounded once (HF's order); logits within bf16
    rounding of HF's and the same argmax, on a prompt past the window."""
    from transformers import AutoModelForCausalLM

    model_dir = window_family_dirs("gemma3")
    model = LlamaModel.from_pretrained(model_dir, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert model.layers[0].input_layernorm.weight.dtype == torch.float32
    config = model.config
    groups = config.num_heads // config.num_kv_heads

    def attention(layer: int, q, k, v):
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        count = q.shape[2]
        position = torch.arange(count)
        visible = position[None, :] <= position[:, None]
        window = config.layer_windows[layer]
        if window is not None:
            visible &= position[None, :] > position[:, None] - window
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=config.scale
        )
        return out[0].transpose(0, 1).contiguous()

    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(40), attention))
        expected = reference(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.02)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def _long_documents(rows: int, words: int) -> list[str]:
    from conftest import TINY_CORPUS

    prompts = []
    for row in range(rows):
        sentences = [TINY_CORPUS[(row * 7 + i) % len(TINY_CORPUS)] for i in range(words)]
        prompts.append("Summarize the review in one sentence. " + " ".join(sentences))
    return prompts


@pytest.mark.parametrize("deterministic", [True, False])
def test_blocks_behind_every_window_are_reused(window_family_dirs, monkeypatch, deterministic):
    """A long-document job (every row ~4x its window of own tokens) under a KV budget far
    below the job's: blocks that left every window go back to the pool while rows run,
    a row holds about a window of blocks, and no token changes. (The margin kept before
    the window is cut from 128 keys to 8 here, so the tiny context frees blocks at all:
    freed blocks are then re-used by other rows inside the kernels' aligned key runs,
    masked.)"""
    from llm_operator.engine.native import scheduler

    monkeypatch.setattr(scheduler, "WINDOW_MARGIN", 8)
    model_dir = window_family_dirs("mistral_window")
    block_size = 4
    prompts = _long_documents(8, 5)
    block_bytes = 2 * 2 * block_size * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads of 16, fp32
    op = LLMOperator(
        model_dir, backend="native", kv_block_size=block_size, deterministic=deterministic,
        kv_cache_memory=120 * block_bytes,
    )  # fmt: skip
    ids = [op.tokenizer(p)["input_ids"] for p in prompts]
    assert min(len(i) for i in ids) > 4 * TINY_WINDOW
    job_blocks = sum(-(-(len(i) + 16) // block_size) for i in ids)
    assert job_blocks > 2 * 120  # the job needs over twice the budget
    results = op.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 16, ignore_eos=True)
    profile = op.backend().last_profile
    assert profile.num_blocks == 120 and profile.preemptions == 0
    assert profile.window_freed_blocks > job_blocks // 2
    prefix_blocks = sum(-(-len(s.token_ids) // block_size) for s in op.plan(prompts).segments)
    window_blocks = -(-(TINY_WINDOW + 8 + TINY_WINDOW) // block_size) + 1
    assert profile.max_running >= 4  # more rows than fit the budget without freeing
    assert profile.peak_blocks <= profile.max_running * window_blocks + prefix_blocks


def test_mixed_layers_keep_every_block(window_family_dirs):
    """Gemma 3's full-attention layers read every position: nothing is freed early."""
    model_dir = window_family_dirs("gemma3")
    op = LLMOperator(model_dir, backend="native", kv_block_size=4)
    prompts = _long_documents(4, 4)
    results = op.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 8, ignore_eos=True)
    assert op.backend().last_profile.window_freed_blocks == 0


def test_longrope_and_partial_rotary_match_hf_generate(window_family_dirs):
    """Phi-3.5 / Phi-4-mini's rope: longrope's short factors (HF's while a row stays
    within the pretraining length) and half of each head rotated. The native engine keeps
    rows within that length: a longer prompt is that row's error, a row that would
    outgrow it stops there; the hf backend runs both."""
    model_dir = window_family_dirs(LONGROPE_FAMILY)
    op = LLMOperator(model_dir, backend="native", kv_block_size=4)
    assert op.max_context == TINY_LONGROPE_POSITIONS
    config = op.backend().model.config
    assert (config.rotary_dim, config.head_dim) == (8, 16)
    prompts = [p for p in _prompts() if len(op.tokenizer(p)["input_ids"]) <= 40]
    assert len(prompts) >= 4
    results = op.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 12, ignore_eos=True)
    long = three_level_prompts()[0]
    assert len(op.tokenizer(long)["input_ids"]) > TINY_LONGROPE_POSITIONS
    refused = op.generate([long], SamplingParams(max_tokens=4))[0]
    assert refused.finish_reason == "error" and "context of 64" in refused.error
    near = max(prompts, key=lambda p: len(op.tokenizer(p)["input_ids"]))
    stopped = op.generate([near], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert stopped.prompt_tokens + stopped.completion_tokens == TINY_LONGROPE_POSITIONS
    hf = LLMOperator(model_dir, backend="hf")
    assert hf.max_context == 256
    assert hf.generate([long], SamplingParams(max_tokens=4))[0].finish_reason != "error"


def test_triton_kernels_take_windows(window_family_dirs):
    """The Triton kernels take sliding windows (under the interpreter here): Gemma 3's
    mixed layers run on them, exact against HF generate; Gemma 2's soft caps stay on the
    torch kernels, which alone compute them."""
    pytest.importorskip("triton")
    prompts = three_level_prompts()[:4]
    for family, implementation in (("gemma3", "triton"), ("gemma2", "torch")):
        model_dir = window_family_dirs(family)
        op = LLMOperator(
            model_dir, backend="native", kernels="triton", kv_block_size=8, cuda_graphs="off"
        )
        results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert op.backend().paths.attention == implementation
        assert_matches_hf(op, model_dir, prompts, results, 6, ignore_eos=True)
