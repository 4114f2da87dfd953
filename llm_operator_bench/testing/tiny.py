"""Tiny random models with trained tokenizers, built offline: what the tests and the
benchmarks that measure the integration (not the model) run.

    tokenizer_dir = build_tiny_tokenizer(path / "tok", corpus)      # byte-level BPE, ChatML
    model_dir = build_tiny_model(path / "llama", "llama", tokenizer_dir, seed=1234)

Every model: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), fp32 safetensors, random
weights from a fixed seed (std 0.2, so greedy decoding has clear winners).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_VOCAB_TARGET = 512
# Random init std (transformers default is 0.02). With std 0.2 the logits of the
# tiny models spread over several units, so greedy decoding has clear winners
# instead of near ties that float reordering could flip.
TINY_INITIALIZER_RANGE = 0.2
# Families the native engine's own forward supports (tests of llm_operator.models.llama).
NATIVE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Families with sliding-window layers (and Gemma's norms, Gemma 2's soft caps, Phi-3's fused
# checkpoint), each with a window of TINY_WINDOW tokens: shorter than the test prompts.
WINDOW_FAMILIES = ("gemma3", "gemma2", "mistral_window", "phi3", "qwen2_mixed")
TINY_WINDOW = 12
# Phi-3.5 / Phi-4-mini's rope: longrope (short factors up to TINY_LONGROPE_POSITIONS) and
# a partial rotary factor of 1/2
LONGROPE_FAMILY = "phi3_longrope"
TINY_LONGROPE_POSITIONS = 64


def build_tiny_tokenizer(
    output_dir: Path, corpus: Sequence[str], *, vocab_size: int = TINY_VOCAB_TARGET
) -> Path:
    """Train a byte-level BPE tokenizer on `corpus` and save it as a fast HF tokenizer.

    Special tokens get ids 0, 1, 2 in the order of SPECIAL_TOKENS; eos and pad are
    `<|endoftext|>` (id 0), there is no bos, and the chat template is ChatML.
    Training is deterministic for a fixed corpus.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    # transformers loads a model_type "qwen2" directory with Qwen2Tokenizer, which imposes
    # this normalizer and pre-tokenizer; using them here makes every fixture directory
    # tokenize identically whichever tokenizer class AutoTokenizer picks.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(output_dir)
    return output_dir


def tiny_config(
    family: str, vocab_size: int, eos_token_id: int, *, rope_parameters: dict | None = None
):
    """A tiny config of `family`: hidden 64, 2 layers, 4 heads, 2 kv heads (GQA).

    qwen3 has head_dim 32 (not hidden / heads = 16) and an untied head.
    `rope_parameters` (e.g. LLAMA3_ROPE_PARAMETERS) replaces the default rope.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family in WINDOW_FAMILIES or family == LONGROPE_FAMILY:
        return _window_config(family, vocab_size, eos_token_id)

    shared = _tiny_shape(vocab_size, eos_token_id, num_hidden_layers=2)
    if rope_parameters is not None:
        shared["rope_parameters"] = dict(rope_parameters)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=True, **shared)
    if family == "qwen2":
        return Qwen2Config(
            tie_word_embeddings=False, sliding_window=None, use_sliding_window=False, **shared
        )
    if family == "mistral":
        return MistralConfig(tie_word_embeddings=False, sliding_window=None, **shared)
    if family == "qwen3":
        return Qwen3Config(
            head_dim=32,
            tie_word_embeddings=False,
            sliding_window=None,
            use_sliding_window=False,
            **shared,
        )
    raise ValueError(f"family={family!r} is not one of {NATIVE_FAMILIES}")


def _tiny_shape(vocab_size: int, eos_token_id: int, **extra) -> dict:
    """The config fields every tiny model shares: hidden 64, 4 heads, 2 kv heads, a
    256-token context, no bos, eos = pad."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=TINY_INITIALIZER_RANGE,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        **extra,
    )


def _window_config(family: str, vocab_size: int, eos_token_id: int):
    """A tiny config of a sliding-window family (``WINDOW_FAMILIES``): hidden 64, 4 heads,
    2 kv heads of 16 dims, windows of TINY_WINDOW tokens."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen2Config

    shared = _tiny_shape(vocab_size, eos_token_id, sliding_window=TINY_WINDOW)
    if family == "gemma3":  # two sliding layers, a global one, a sliding one
        return Gemma3TextConfig(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            **shared,
        )  # fmt: skip
    if family == "gemma2":  # soft caps on the scores and the logits
        return Gemma2Config(
            num_hidden_layers=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            **shared,
        )
    if family == "mistral_window":
        return MistralConfig(num_hidden_layers=2, tie_word_embeddings=False, **shared)
    if family == "phi3":
        return Phi3Config(num_hidden_layers=2, tie_word_embeddings=False, **shared)
    if family == LONGROPE_FAMILY:  # no window; 8 of each head's 16 dims rotate
        del shared["sliding_window"]
        rotary = 8  # head_dim 16 x partial_rotary_factor 0.5
        return Phi3Config(
            num_hidden_layers=2,
            tie_word_embeddings=True,
            original_max_position_embeddings=TINY_LONGROPE_POSITIONS,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0 + 0.25 * i for i in range(rotary // 2)],
                "long_factor": [4.0 + i for i in range(rotary // 2)],
                "original_max_position_embeddings": TINY_LONGROPE_POSITIONS,
            },
            **shared,
        )  # fmt: skip
    if family == "qwen2_mixed":  # layer 0 full attention, layer 1 sliding
        return Qwen2Config(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            use_sliding_window=True,
            max_window_layers=1,
            **shared,
        )
    raise ValueError(f"family={family!r} is not one of {WINDOW_FAMILIES}")


def build_tiny_model(
    output_dir: Path,
    family: str,
    tokenizer_dir: Path,
    seed: int,
    *,
    rope_parameters: dict | None = None,
) -> Path:
    """Save a randomly initialized tiny `family` model (fp32 safetensors) with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos_token_id = tokenizer.eos_token_id
    config = tiny_config(family, len(tokenizer), eos_token_id, rope_parameters=rope_parameters)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in ("gemma2", "gemma3"):  # Gemma's norms start at weight 0 (a factor 1): vary them
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(0.0, TINY_INITIALIZER_RANGE)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, do_sample=False
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
