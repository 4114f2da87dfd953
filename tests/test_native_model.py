"""The native Llama-family forward (llm_operator.models.llama) against Hugging Face, fp32 on CPU.

A test-local dense attention stands in for the engine's: per request, causal SDPA of
the request's new rows over its kept K/V plus the new K/V (GQA by repeat_interleave).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers import LLAMA3_ROPE_PARAMETERS, NATIVE_FAMILIES, tiny_config
from torch import Tensor

from llm_operator.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel, NativeConfig, native_config
from llm_operator.models.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_inverse_frequencies

PROMPT_LENGTHS = (5, 17, 30)
LOGITS_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}  # measured max |diff| is a few 1e-6
REFERENCE_MODELS = (*NATIVE_FAMILIES, "llama3_rope")


class DenseAttention:
    """Causal attention per request over its own rows; keeps each request's K/V across calls.

    Set `segments` to [(request, rows), ...] in packed order before each forward call.
    """

    def __init__(self, config: NativeConfig) -> None:
        self.config = config
        self.segments: list[tuple[str, int]] = []
        self.kept: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}  # (request, layer) -> K, V
        self.calls: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        self.calls.append((layer_index, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        groups = self.config.num_heads // self.config.num_kv_heads
        window = self.config.sliding_window
        outputs, start = [], 0
        for request, rows in self.segments:
            new = slice(start, start + rows)
            start += rows
            keys, values = k[new], v[new]
            if (request, layer_index) in self.kept:
                kept_keys, kept_values = self.kept[request, layer_index]
                keys, values = torch.cat([kept_keys, keys]), torch.cat([kept_values, values])
            self.kept[request, layer_index] = keys, values
            key_positions = torch.arange(keys.shape[0])
            query_positions = key_positions[-rows:]
            visible = key_positions[None, :] <= query_positions[:, None]  # [rows, keys]
            if window is not None:
                visible &= key_positions[None, :] > query_positions[:, None] - window
            out = torch.nn.functional.scaled_dot_product_attention(
                q[new].transpose(0, 1),  # [heads, rows, dim]
                keys.repeat_interleave(groups, dim=1).transpose(0, 1),
                values.repeat_interleave(groups, dim=1).transpose(0, 1),
                attn_mask=visible,
                scale=self.config.scale,
            )
            outputs.append(out.transpose(0, 1))  # [rows, heads, dim]
        assert start == q.shape[0], f"segments cover {start} rows of {q.shape[0]}"
        return torch.cat(outputs)


def run_packed(
    model: LlamaModel, attention: DenseAttention, chunks: list[tuple[str, list[int], int]]
) -> list[Tensor]:
    """One forward over chunks (request, token ids, first position); each chunk's logits."""
    attention.segments = [(request, len(ids)) for request, ids, _ in chunks]
    input_ids = torch.tensor([token for _, ids, _ in chunks for token in ids])
    positions = torch.cat([torch.arange(start, start + len(ids)) for _, ids, start in chunks])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, attention))
    assert logits.dtype == torch.float32
    return list(logits.split([len(ids) for _, ids, _ in chunks]))


@functools.lru_cache(maxsize=8)
def native_model(model_dir: Path) -> LlamaModel:
    return LlamaModel.from_pretrained(model_dir, device=torch.device("cpu"), dtype=torch.float32)


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def hf_logits(model_dir: Path, ids: list[int]) -> Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


def prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(params=REFERENCE_MODELS)
def reference_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def test_packed_batch_matches_hf(reference_dir: Path) -> None:
    model = native_model(reference_dir)
    attention = DenseAttention(model.config)
    batch = prompts(model.config.vocab_size)
    outputs = run_packed(model, attention, [(f"r{i}", ids, 0) for i, ids in enumerate(batch)])
    assert [call[0] for call in attention.calls] == list(range(model.config.num_layers))
    config = model.config
    total = sum(PROMPT_LENGTHS)
    assert attention.calls[0][1:] == (
        (total, config.num_heads, config.head_dim),
        (total, config.num_kv_heads, config.head_dim),
        (total, config.num_kv_heads, config.head_dim),
    )
    for ids, logits in zip(batch, outputs):
        expected = hf_logits(reference_dir, ids)
        torch.testing.assert_close(logits, expected, **LOGITS_TOLERANCE)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_positions_continue_across_calls(reference_dir: Path) -> None:
    """A prompt split over two calls (packed with other requests) equals one call."""
    model = native_model(reference_dir)
    attention = DenseAttention(model.config)
    first, other, late = prompts(model.config.vocab_size, lengths=(30, 5, 17), seed=1)
    head, _ = run_packed(model, attention, [("a", first[:12], 0), ("b", other, 0)])
    late_logits, tail = run_packed(model, attention, [("late", late, 0), ("a", first[12:], 12)])
    split = torch.cat([head, tail])
    whole = run_packed(model, DenseAttention(model.config), [("a", first, 0)])[0]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, hf_logits(reference_dir, first), **LOGITS_TOLERANCE)
    torch.testing.assert_close(late_logits, hf_logits(reference_dir, late), **LOGITS_TOLERANCE)


def test_native_config_reads_each_family(native_model_dir: Path) -> None:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(native_model_dir, local_files_only=True)
    config = native_config(hf_config)
    family = hf_config.model_type
    assert config.model_type == family
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == (32 if family == "qwen3" else 16)
    assert config.scale == config.head_dim**-0.5
    assert config.qk_norm == (family == "qwen3")
    assert config.attention_bias == (family == "qwen2")
    assert config.tie_word_embeddings == (family == "llama")
    assert config.sliding_window is None
    assert config.max_position_embeddings == 256


def test_native_config_rejects_what_it_cannot_run() -> None:
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match=r"model_type='gpt2'.*'llama', 'qwen2', 'qwen3'"):
        native_config(GPT2Config())
    assert SUPPORTED_MODEL_TYPES[:4] == ("llama", "qwen2", "qwen3", "mistral")
    config = tiny_config("llama", 512, 0)
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type='mrope'"):
        native_config(config)
    qwen2 = tiny_config("qwen2", 512, 0)
    qwen2.sliding_window, qwen2.layer_types = 64, ["full_attention", "sliding_attention"]
    assert native_config(qwen2).layer_windows == (None, 64)  # mixed layers run (issue 32)
    qwen2.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        native_config(qwen2)
    qwen2.layer_types = ["sliding_attention"] * 2
    assert native_config(qwen2).sliding_window == 64
    mistral = tiny_config("mistral", 512, 0)
    mistral.sliding_window = 4096
    assert native_config(mistral).sliding_window == 4096
    assert native_config(LlamaConfig(attention_bias=True)).attention_bias


@pytest.mark.parametrize("rope_type", SUPPORTED_ROPE_TYPES)
def test_rope_tables_equal_hf(rope_type: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    parameters = {
        "default": {"rope_type": "default", "rope_theta": 10_000.0},
        "linear": {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
        "llama3": LLAMA3_ROPE_PARAMETERS,
        "yarn": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0},
        "longrope": {  # Phi-3.5's shape: short factors up to original_max_position_embeddings
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            "original_max_position_embeddings": 128,
        },
    }[rope_type]
    config = tiny_config("llama", 512, 0, rope_parameters=parameters)
    rotary = RotaryEmbedding(*rope_inverse_frequencies(config, head_dim=16))
    # longrope is exact within the positions its short factors serve (the engine keeps rows there)
    positions = torch.arange(128 if rope_type == "longrope" else config.max_position_embeddings)
    cos, sin = rotary(positions, torch.float32)
    x = torch.zeros(1, 1, 16)
    expected_cos, expected_sin = LlamaRotaryEmbedding(config)(x, positions[None])
    assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
    # Scaled types change the tables; dynamic equals the default below max_position_embeddings.
    unscaled = rope_inverse_frequencies(tiny_config("llama", 512, 0), head_dim=16)
    default_cos, _ = RotaryEmbedding(*unscaled)(positions, torch.float32)
    assert torch.equal(cos, default_cos) == (rope_type in ("default", "dynamic"))


def test_sliding_window_matches_hf(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = tiny_config("mistral", 512, 0)
    config.sliding_window = 8
    torch.manual_seed(6789)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = native_model(tmp_path)
    assert model.config.sliding_window == 8
    batch = prompts(512)
    chunks = [(f"r{i}", ids, 0) for i, ids in enumerate(batch)]
    for ids, logits in zip(batch, run_packed(model, DenseAttention(model.config), chunks)):
        torch.testing.assert_close(logits, hf_logits(tmp_path, ids), **LOGITS_TOLERANCE)


def test_sharded_checkpoint_loads_the_same_weights(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    hf_model(tiny_qwen3_dir).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = LlamaModel.from_pretrained(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    single = native_model(tiny_qwen3_dir)
    for (name, tensor), (other_name, other) in zip(
        sharded.state_dict().items(), single.state_dict().items(), strict=True
    ):
        assert name == other_name and torch.equal(tensor, other), name


def test_bfloat16_matches_hf_bfloat16(tiny_qwen3_dir: Path) -> None:
    """One prompt, attention as HF's sdpa computes it: on this CPU the logits are bitwise equal;
    the tolerance leaves room for a rounding flip on other kernels."""
    from transformers import AutoModelForCausalLM

    model = LlamaModel.from_pretrained(
        tiny_qwen3_dir, device=torch.device("cpu"), dtype=torch.bfloat16
    )
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    groups = model.config.num_heads // model.config.num_kv_heads

    def causal_attention(layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, T, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=model.config.scale
        )
        return out[0].transpose(0, 1)

    ids = prompts(model.config.vocab_size, lengths=(30,))[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        input_ids = torch.tensor(ids)
        hidden = model(input_ids, torch.arange(len(ids)), causal_attention)
        logits = model.compute_logits(hidden)
        expected = reference(input_ids[None]).logits[0].float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.02)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_from_pretrained_rejects_bad_input(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        LlamaModel.from_pretrained(
            tmp_path / "nope", device=torch.device("cpu"), dtype=torch.float32
        )
    with pytest.raises(ValueError, match="dtype="):
        LlamaModel.from_pretrained(tiny_llama_dir, device=torch.device("cpu"), dtype=torch.int8)
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="neither model.safetensors"):
        LlamaModel.from_pretrained(tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_other_activations_run_eagerly_and_match_hf(tmp_path):
    """Only SiLU is a region: a GELU model takes the layer's eager act_fn and still gives
    HF's logits."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", 512, 0)
    config.hidden_act = "gelu_pytorch_tanh"
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = native_model(tmp_path)
    assert not model.layers[0].fuse_activation
    batch = prompts(512, lengths=(9, 14))
    chunks = [(f"r{i}", ids, 0) for i, ids in enumerate(batch)]
    for ids, logits in zip(batch, run_packed(model, DenseAttention(model.config), chunks)):
        torch.testing.assert_close(logits, hf_logits(tmp_path, ids), atol=1e-5, rtol=1e-5)
