"""Test helpers: building tiny offline models, and the Hugging Face greedy oracle.

Import from tests as `from helpers import hf_generate_greedy` (conftest puts this
folder on sys.path).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

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
TINY_FAMILIES = ("llama", "qwen2", "mistral")
# Families the native engine's own forward supports (tests of llm_operator.models.llama).
NATIVE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Llama 3.1-style rope scaling sized for the tiny models (head_dim 16, rope_theta 10000):
# with an original context of 128 the 8 frequencies fall in all three llama3 regions
# (kept, smoothed, divided by `factor`).
LLAMA3_ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


# Ten short product reviews: the row texts of the Spark and fault tests.
REVIEWS = (
    "The battery lasts two full days.",
    "Shipping took 12 days and the box arrived crushed.",
    "Great value for the price, would buy again.",
    "The app crashes every time I open the settings page.",
    "Terrible fit: the shoes run a full size small.",
    "Refund received, thank you for the quick help!",
    "The screen has a dead pixel in the top right corner.",
    "Sound quality is clear, but the bass is weak.",
    "Two of the six glasses arrived broken.",
    "The tent kept us dry during a heavy storm.",
)


def build_tiny_tokenizer(output_dir: Path, corpus: Sequence[str]) -> Path:
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
        vocab_size=TINY_VOCAB_TARGET,
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

    shared = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=TINY_INITIALIZER_RANGE,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
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


def build_tiny_model(
    output_dir: Path,
    family: str,
    tokenizer_dir: Path,
    seed: int,
    *,
    rope_parameters: dict | None = None,
) -> Path:
    """Save a randomly initialized tiny `family` model (fp32 safetensors) with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos_token_id = tokenizer.eos_token_id
    config = tiny_config(family, len(tokenizer), eos_token_id, rope_parameters=rope_parameters)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, do_sample=False
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


@functools.lru_cache(maxsize=16)
def _load_reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, use_safetensors=True, local_files_only=True
    )
    return model.eval()


def hf_generate_greedy(
    model_dir: Path | str,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    *,
    ignore_eos: bool = False,
) -> list[int]:
    """The oracle: HF `generate` (fp32, CPU, greedy) on this one prompt; only the new tokens.

    `eos_token_id=None` uses the directory's generation_config eos. When
    generation stops at an eos token, that token is the last one returned.
    `ignore_eos=True` never stops early (eos is generated like any token).
    The model is loaded once per directory.
    """
    assert prompt_token_ids, "hf_generate_greedy needs a non-empty prompt"
    model = _load_reference_model(str(Path(model_dir).resolve()))
    generation_config = copy.deepcopy(model.generation_config)
    if ignore_eos:
        generation_config.eos_token_id = []  # None would be refilled from the model's config
    elif eos_token_id is not None:
        generation_config.eos_token_id = eos_token_id
    if generation_config.pad_token_id is None:
        generation_config.pad_token_id = 0
    generation_config.do_sample = False
    generation_config.max_new_tokens = max_new_tokens
    input_ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config,
        )
    return output[0, input_ids.shape[1] :].tolist()


def hf_generate_under(model, ids: list[int], max_new_tokens: int, processor, eos: list[int]):
    """The constrained oracle: greedy HF ``generate`` on one prompt under a logits
    ``processor``; (the new tokens, the raw logits of each step)."""
    from transformers import LogitsProcessorList

    input_ids = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([processor]),
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), out.logits


def assert_prefix_of_hf(result, hf_tokens: list[int], eos: list[int]) -> None:
    """A constrained row's tokens are HF's, less the one end token HF spends where the
    constraint leaves nothing but the end (the operator ends the row without that step)."""
    n = len(result.token_ids)
    assert list(result.token_ids) == hf_tokens[:n], (result, hf_tokens)
    assert hf_tokens[n:] in ([], [hf_tokens[-1]]) and (n == len(hf_tokens) or hf_tokens[n] in eos)


def hf_logprob(model, ids: list[int], tokens: list[int]) -> float:
    """log P(tokens | ids) under the model, without any mask (one forward pass)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids) + list(tokens)])).logits[0].float()
    log_probs = torch.log_softmax(logits, -1)
    return sum(log_probs[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens))


# a closed JSON schema of every nesting the typed value maps (an object, an array): a random
# tiny model completes it (booleans, enums, a bounded array) in ~70 tokens
TYPED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "label": {"enum": ["red", "blue"]},
        "detail": {
            "type": "object",
            "properties": {"urgent": {"type": "boolean"}},
            "required": ["urgent"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "label", "detail", "tags"],
}


@contextlib.contextmanager
def job_group(spark, name: str):
    """Run the Spark jobs inside as job group ``name``; yields the status tracker."""
    context = spark.sparkContext
    context.setJobGroup(name, name)
    try:
        yield context.statusTracker()
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            context.setLocalProperty(key, None)  # type: ignore[arg-type]
