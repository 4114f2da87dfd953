"""Embeddings: each row's vector against Hugging Face ``AutoModel`` on that row alone.

The native engine (tiny random Llama and Qwen3 decoders) with and without prefix sharing,
at several KV block sizes, in both kernel modes (batch-invariant with tail copies, and
not), under preemption; the hf backend on the same decoders and on a tiny BERT encoder.
Every vector must have cosine >= 0.99999 with the reference (fp32), and sharing must
really compute fewer tokens.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import automodel_vectors

from llm_operator import LLMOperator
from llm_operator.embedding import POOLINGS, check_embedding_options

COSINE = 0.99999
DOCUMENT = (
    "The warehouse ships orders every weekday. Returns are accepted within thirty days "
    "when the item is unused, and refunds go back to the original card. "
)
# rows that share a document (a contextual-chunk shape), an instruction prefix, duplicates
PROMPTS = [
    DOCUMENT + "Chunk: returns within thirty days.",
    DOCUMENT + "Chunk: refunds to the card.",
    DOCUMENT + "Chunk: orders ship on weekdays.",
    DOCUMENT + "Chunk: returns within thirty days.",  # identical to row 0
    "Instruct: find the policy\nQuery: how do refunds work?",
    "Instruct: find the policy\nQuery: when do orders ship?",
    "A row that shares nothing with the others at all.",
    DOCUMENT,  # a row that is entirely another row's prefix
]


def reference(model_dir: Path, prompts, pooling: str, dimensions=None, normalize=True):
    """AutoModel on each prompt alone, tokenized as a user would (``helpers.automodel_vectors``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    token_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    return automodel_vectors(
        model_dir, token_ids, pooling, dimensions=dimensions, normalize=normalize
    )


def assert_close(results, expected) -> None:
    assert len(results) == len(expected)
    for row, (result, vector) in enumerate(zip(results, expected)):
        assert result.error is None, (row, result.error)
        got = torch.tensor(result.embedding)
        assert got.shape == vector.shape, (row, got.shape, vector.shape)
        cosine = torch.nn.functional.cosine_similarity(got, vector, dim=0).item()
        assert cosine >= COSINE, f"row {row}: cosine {cosine:.7f}"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def decoder_dir(request, tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> Path:
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[request.param]


@pytest.mark.parametrize("deterministic", [True, False], ids=["invariant", "default"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_native_embeddings_equal_automodel(decoder_dir: Path, block_size: int, deterministic):
    op = LLMOperator(
        decoder_dir, backend="native", kv_block_size=block_size, deterministic=deterministic,
        min_shared_tokens=2,
    )  # fmt: skip
    for pooling in POOLINGS:
        results = op.embed(PROMPTS, pooling=pooling)
        assert_close(results, reference(decoder_dir, PROMPTS, pooling))
        stats = op.last_stats
        assert stats.requests == len(PROMPTS) - 1  # the duplicate computed once
        # the document is computed once, not for each of its rows
        assert stats.prefill_tokens_computed < stats.prompt_tokens * 0.6, stats


def test_native_without_sharing_equals_automodel(tiny_llama_dir: Path) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native", share_prefixes=False)
    for pooling in POOLINGS:
        assert_close(
            op.embed(PROMPTS, pooling=pooling), reference(tiny_llama_dir, PROMPTS, pooling)
        )
        # every row's prompt computed whole, the duplicate row once
        duplicate = len(op.tokenize([PROMPTS[3]])[0])
        assert op.last_stats.prefill_tokens_computed == op.last_stats.prompt_tokens - duplicate


def test_native_in_a_small_kv_pool(tiny_qwen3_dir: Path) -> None:
    """A KV pool of a few blocks: rows wait for blocks, segments are released between
    documents."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen3_dir)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    op = LLMOperator(
        tiny_qwen3_dir, backend="native", kv_block_size=4, kv_cache_memory=per_token * 4 * 36,
        prefill_batch_tokens=16, min_shared_tokens=2,
    )  # fmt: skip
    other = "Support answers tickets within a day, in English or in German, by mail or phone. "
    prompts = PROMPTS + [other + f"Chunk {n}: tickets are answered." for n in range(3)]
    for pooling in ("mean", "last"):
        assert_close(
            op.embed(prompts, pooling=pooling), reference(tiny_qwen3_dir, prompts, pooling)
        )
        profile = op.embedder().backend.last_profile
        assert profile.num_blocks == 36
        assert profile.max_running < op.last_stats.requests, profile  # rows waited


def test_dimensions_and_normalize(tiny_llama_dir: Path) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    results = op.embed(PROMPTS[:3], pooling="mean", dimensions=16)
    assert all(len(r.embedding) == 16 for r in results)
    assert all(math.isclose(sum(v * v for v in r.embedding), 1.0, rel_tol=1e-5) for r in results)
    assert_close(results, reference(tiny_llama_dir, PROMPTS[:3], "mean", dimensions=16))
    raw = op.embed(PROMPTS[:3], pooling="last", normalize=False)
    assert_close(raw, reference(tiny_llama_dir, PROMPTS[:3], "last", normalize=False))
    assert not math.isclose(sum(v * v for v in raw[0].embedding), 1.0, rel_tol=1e-3)
    with pytest.raises(ValueError, match="dimensions"):
        op.embed(PROMPTS[:1], dimensions=10_000)


def test_a_row_alone_equals_the_row_in_its_batch(tiny_llama_dir: Path) -> None:
    """The batch-invariant default: the same bits whatever else the batch holds."""
    op = LLMOperator(tiny_llama_dir, backend="native", deterministic=True)
    together = op.embed(PROMPTS, pooling="mean")
    for row in (0, 4, 6):
        alone = op.embed([PROMPTS[row]], pooling="mean")[0]
        assert alone.embedding == together[row].embedding


def test_bad_rows_get_errors_and_the_rest_completes(tiny_llama_dir: Path) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    too_long = "word " * 2000
    rows = [PROMPTS[0], None, "", 42, too_long, PROMPTS[4]]
    results = op.embed(rows)
    assert [r.error is None for r in results] == [True, False, False, False, False, True]
    assert "null" in results[1].error and "empty" in results[2].error
    assert "int" in results[3].error and "context" in results[4].error
    assert all(r.embedding is None for r in results[1:5])
    assert_close(
        [results[0], results[5]], reference(tiny_llama_dir, [PROMPTS[0], PROMPTS[4]], "last")
    )
    assert op.last_stats.error_rows == 4


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"pooling": "max"}, ValueError),
        ({"normalize": "yes"}, TypeError),
        ({"dimensions": 0}, ValueError),
        ({"dimensions": 1.5}, TypeError),
    ],
)
def test_bad_options_are_named(options, error) -> None:
    with pytest.raises(error, match=next(iter(options))):
        check_embedding_options(**options)


def test_hf_backend_on_a_decoder(tiny_qwen3_dir: Path) -> None:
    op = LLMOperator(tiny_qwen3_dir, backend="hf", max_batch_size=3)
    for pooling in POOLINGS:
        assert_close(
            op.embed(PROMPTS, pooling=pooling), reference(tiny_qwen3_dir, PROMPTS, pooling)
        )
        assert op.last_stats.backend == "hf"
        assert op.last_stats.prefill_tokens_computed == op.last_stats.prompt_tokens - len(
            op.tokenize([PROMPTS[3]])[0]
        )  # nothing shared; the duplicate row computed once


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny random BERT encoder (bidirectional) with the tiny tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir, local_files_only=True)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(7)
    model = BertModel(config)
    out = tmp_path_factory.mktemp("tiny-bert") / "model"
    model.save_pretrained(out)
    for name in tiny_tokenizer_dir.iterdir():
        if name.name != "config.json":
            shutil.copy(name, out / name.name)
    return out


def test_hf_backend_on_an_encoder(tiny_bert_dir: Path) -> None:
    op = LLMOperator(tiny_bert_dir)  # not a decoder the native engine runs: hf
    assert op.backend_name == "hf"
    for pooling in ("cls", "mean"):
        results = op.embed(PROMPTS, pooling=pooling)
        assert_close(results, reference(tiny_bert_dir, PROMPTS, pooling))
    with pytest.raises(ValueError, match="native"):
        LLMOperator(tiny_bert_dir, backend="native").embed(PROMPTS[:1])


def test_an_embedding_run_is_profiled(tiny_llama_dir: Path) -> None:
    """The run's profile has its steps, and with profile_ops each step's split by kind."""
    op = LLMOperator(tiny_llama_dir, backend="native", profile_ops=True, prefill_batch_tokens=64)
    op.embed(PROMPTS, pooling="mean")
    profile = op.embedder().backend.last_profile
    assert profile.iterations == len(profile.steps) == len(profile.ops) > 1
    assert sum(tokens for tokens, _, _ in profile.steps) == op.last_stats.prefill_tokens_computed
    assert sum(rows for _, rows, _ in profile.steps) == op.last_stats.requests
    assert any(split.get("linear", 0) > 0 for split in profile.ops)
