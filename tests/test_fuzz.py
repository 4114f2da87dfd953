"""Property-based tests of LLMOperator.generate: any input, rows in = rows out.

Every generated batch mixes good prompts with bad ones (any unicode, lone surrogates,
control characters, NUL, right-to-left text, chat lists with missing or extra keys and odd
types, None, NaN, bytes, numbers, prompts at and past the context) and per-row sampling
parameters. Properties: one result per row in input order; every bad row an error row
with a message; every good row answered as it is alone.

Profiles: ``ci`` (the default, fits the suite) and ``long`` (``make fuzz``,
``HYPOTHESIS_PROFILE=long``: thousands of cases).
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_operator import LLMOperator, SamplingParams

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck)
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

# every unicode code point, surrogates (category Cs) included
ANY_CHARACTER = st.characters(codec=None, categories=None)
TRICKY = st.sampled_from(
    [
        "\x00",
        "\ud800",
        "\udfff",
        "\u202e",
        "\u0301",
        "\n",
        "\t",
        "\r",
        "\x1b",
        "\ufeff",
        "é",
        "日本",
    ]
)
TEXT = st.lists(st.one_of(ANY_CHARACTER, TRICKY), max_size=24).map("".join)
WORDS = st.lists(st.sampled_from(["the", "weather", "review", "label", "ticket", "is"]),
                 min_size=1, max_size=8).map(" ".join)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.one_of(WORDS, TEXT)}
)
ODD_MESSAGE = st.one_of(
    st.fixed_dictionaries({"content": WORDS}),  # no role
    st.fixed_dictionaries({"role": st.just("user")}),  # no content
    st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}),
    st.fixed_dictionaries({"role": st.just("user"), "content": WORDS, "extra": st.integers()}),
)
PROMPT = st.one_of(
    WORDS,
    TEXT,
    st.lists(MESSAGE, min_size=1, max_size=3),
    st.lists(st.one_of(MESSAGE, ODD_MESSAGE), min_size=1, max_size=3),
    st.none(),
    st.just(math.nan),
    st.binary(max_size=8),
    st.integers(),
    st.floats(allow_nan=False),
    st.just([]),
    st.just(""),
    st.integers(200, 300).map(lambda n: "word " * n),  # at and past the 256-token context
)
PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.one_of(st.none(), st.integers(0, 5)),
    stop=st.sampled_from([(), ("e",)]),
    choices=st.sampled_from([None, None, ("yes", "no")]),
)


@pytest.fixture(scope="module")
def operator(tiny_llama_dir) -> LLMOperator:
    return LLMOperator(tiny_llama_dir, backend="native")


@settings(settings.get_profile(PROFILE))
@given(batch=st.lists(st.tuples(PROMPT, PARAMS), min_size=1, max_size=6))
def test_generate_answers_every_row_as_it_would_alone(operator, batch) -> None:
    prompts = [prompt for prompt, _ in batch]
    params = [p for _, p in batch]
    results = operator.generate(prompts, params)
    assert len(results) == len(prompts)
    token_ids = operator.tokenize(prompts)
    for row, (prompt, p, result, ids) in enumerate(zip(prompts, params, results, token_ids)):
        if ids is None:
            assert result.finish_reason == "error" and result.error, (row, prompt, result)
            continue
        assert result.finish_reason in ("stop", "length"), (row, prompt, result)
        # a greedy row, or the first of its (prompt, seed) in the batch, samples the same
        # tokens alone (a later occurrence draws the next stream; unseeded sampling is free)
        first = all(token_ids[k] != ids or params[k].seed != p.seed for k in range(row))
        if p.greedy or (p.seed is not None and first):
            (alone,) = operator.generate([prompt], p)
            assert result == alone, (row, prompt, p)
        if p.choices is not None:
            assert result.text in p.choices or result.error, (row, result)
