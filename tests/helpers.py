"""Test helpers: building tiny offline models, and the Hugging Face greedy oracle.

Import from tests as `from helpers import hf_generate_greedy` (conftest puts this
folder on sys.path).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from pathlib import Path

import torch

from llm_operator_bench.testing.tiny import (  # noqa: F401 (the tests import them from here)
    CHATML_TEMPLATE,
    EOS_TOKEN,
    LONGROPE_FAMILY,
    NATIVE_FAMILIES,
    SPECIAL_TOKENS,
    TINY_INITIALIZER_RANGE,
    TINY_LONGROPE_POSITIONS,
    TINY_VOCAB_TARGET,
    TINY_WINDOW,
    WINDOW_FAMILIES,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
)

TINY_FAMILIES = ("llama", "qwen2", "mistral")
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


def hf_generate_after_prefix(
    model, prefix: list[int], rows: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The oracle for many prompts that share ``prefix`` (each row: the prefix's ids, then
    its own): HF ``generate`` (greedy, EOS ignored) on each whole prompt, given the
    prefix's K/V computed once by the same model (HF's own cache, sliding-window layers
    included) instead of recomputed per row. Only the new tokens, row by row."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        outputs = []
        for ids in rows:
            assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=copy.deepcopy(cache),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


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


def chat_wrapped(prompts):
    """The prompts Spark, Dask and the CLI send the operator by default (``chat="auto"``)
    for a model with a chat template, as the tiny tokenizers have: each string a user
    message."""
    from llm_operator.prompts.encode import as_chat

    return as_chat(list(prompts), chat=True)


MODE = "SPARK_CONNECT_MODE_ENABLED"  # PySpark builds Connect expressions while it is set


@contextlib.contextmanager
def connect_mode():
    """PySpark's functions build Connect expressions inside, classic ones outside."""
    os.environ[MODE] = "1"
    try:
        yield
    finally:
        os.environ.pop(MODE, None)


class PagedLayout:
    """Requests over one paged cache for the kernel invariance tests (reference layout
    [blocks, block_size, kv_heads, dim], unwritten slots NaN, blocks taken in a seeded random
    order): ``segment(keys, values, level)`` places shared keys at a chain level and returns
    its id; ``add(chain, keys, values, queries)`` a request reading those segments then its
    own keys, its query rows the last own positions."""

    def __init__(self, block_size, kv_heads, dim, generator, dtype=torch.float32, num_blocks=None):
        num_blocks = num_blocks or 12288 // block_size
        self.dtype, self.block_size = dtype, block_size
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.k = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
        self.v = self.k.clone()
        self.segments: list[tuple[list[int], int, int]] = []  # (table, length, level)
        self.requests: list[tuple[list[int], list[int], int, torch.Tensor]] = []

    def _place(self, keys, values) -> list[int]:
        blocks = [self.free.pop() for _ in range(-(-len(keys) // self.block_size))]
        for i in range(len(keys)):
            slot = (blocks[i // self.block_size], i % self.block_size)
            self.k[slot], self.v[slot] = keys[i], values[i]
        return blocks

    def segment(self, keys, values, level: int) -> int:
        self.segments.append((self._place(keys, values), len(keys), level))
        return len(self.segments) - 1

    def add(self, chain, keys, values, queries) -> None:
        self.requests.append((list(chain), self._place(keys, values), len(keys), queries))


def compile_for_sm90(script: str, **env_defaults: str) -> None:
    """Run ``script`` (a Triton compile for sm_90 that prints "compiled", or exits 77 where
    this Triton has no GPU compiler: skipped) in a fresh interpreter without the Triton
    interpreter; ``env_defaults`` are set where the environment does not set them."""
    import subprocess
    import sys

    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name, value in env_defaults.items():
        env.setdefault(name, value)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode == 77:
        pytest.skip(f"no Triton GPU compiler here: {result.stdout.strip()}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled" in result.stdout


def automodel_vectors(
    model_dir, token_ids, pooling: str, *, dimensions: int | None = None, normalize: bool = True
) -> list[torch.Tensor]:
    """Hugging Face ``AutoModel``'s last hidden states of each row alone (fp32), pooled
    ("last", "mean" or "cls"), truncated to ``dimensions``, then L2-normalized: the
    embedding oracle."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    vectors = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0].float()
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            if dimensions is not None:
                vector = vector[:dimensions]
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            vectors.append(vector)
    return vectors
