"""Constrained outputs (choices, regex, JSON schema) and logprobs on the hf and native
backends, against Hugging Face ``generate`` with a logits processor applying the same mask."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_prefix_of_hf, hf_generate_under, hf_logprob
from transformers import LogitsProcessor

from llm_operator import LLMOperator, SamplingParams
from llm_operator.engine.constraints import ChoiceTrie

PROMPTS = [
    "The weather today is",
    "Classify the review: the battery died after a day. Label:",
    "Classify the review: great screen, fast delivery. Label:",
    "Route the ticket: my invoice is wrong. Team:",
]
CHOICES = ("billing team", "billing", "shipping", "tech support", "red")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# one a random tiny model completes within a few tokens (free strings and integers run on)
CLOSED_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["red", "blue"]}},
    "required": ["ok", "label"],
}


class _TrieMask(LogitsProcessor):
    """The same trie as the operator's: children of the node the generated tokens reach,
    plus EOS where a choice ends; after a leaf only EOS."""

    def __init__(self, trie: ChoiceTrie, prompt_length: int, eos: list[int]) -> None:
        self.trie, self.prompt_length, self.eos = trie, prompt_length, eos

    def __call__(self, input_ids, scores):
        node = 0
        for token in input_ids[0, self.prompt_length :].tolist():
            node = self.trie.children[node].get(token, node)
        allowed = list(self.trie.children[node])
        if self.trie.ends[node] >= 0:
            allowed += self.eos
        masked = torch.full_like(scores, float("-inf"))
        masked[:, allowed] = scores[:, allowed]
        return masked


def _reference(model_dir):
    from helpers import _load_reference_model

    return _load_reference_model(str(model_dir.resolve()))


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_choices_match_generate_with_the_same_mask(tiny_llama_dir, backend) -> None:
    op = LLMOperator(tiny_llama_dir, backend=backend)
    params = SamplingParams(max_tokens=16, choices=CHOICES)
    results = op.generate(PROMPTS, params)
    trie = op.constraints().trie(CHOICES)
    eos = sorted(op.model_info.eos_token_ids)
    model = _reference(tiny_llama_dir)
    for prompt, ids, result in zip(PROMPTS, op.tokenize(PROMPTS), results):
        assert result.text in CHOICES, (prompt, result)
        assert result.finish_reason == "stop" and result.error is None
        hf_tokens, _ = hf_generate_under(model, ids, 16, _TrieMask(trie, len(ids), eos), eos)
        assert_prefix_of_hf(result, hf_tokens, eos)
    # a decided choice is appended without model steps
    assert op.last_stats.forced_tokens > 0
    assert op.last_stats.output_tokens == sum(r.completion_tokens for r in results)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_logprobs_and_choice_logprobs_are_the_unconstrained_model_s(
    tiny_llama_dir, backend
) -> None:
    op = LLMOperator(tiny_llama_dir, backend=backend)
    results = op.generate(
        PROMPTS[:2], SamplingParams(max_tokens=16, choices=CHOICES, logprobs=True)
    )
    model = _reference(tiny_llama_dir)
    trie = op.constraints().trie(CHOICES)
    eos = sorted(op.model_info.eos_token_ids)
    for ids, result in zip(op.tokenize(PROMPTS[:2]), results):
        hf_tokens, raw = hf_generate_under(model, ids, 16, _TrieMask(trie, len(ids), eos), eos)
        n = len(result.token_ids)
        assert list(result.token_ids) == hf_tokens[:n]
        expected = sum(
            torch.log_softmax(raw[i][0].float(), -1)[hf_tokens[i]].item() for i in range(n)
        )
        assert result.logprob == pytest.approx(expected, abs=1e-3)
        assert set(result.choice_logprobs) == set(CHOICES)
        for choice, logprob in result.choice_logprobs.items():
            tokens = op.tokenizer(choice, add_special_tokens=False)["input_ids"]
            want = hf_logprob(model, ids, tokens)
            assert logprob == pytest.approx(want, abs=1e-3), choice
    # plain rows report a logprob too, and rows without logprobs report none
    plain = op.generate(PROMPTS[:1], SamplingParams(max_tokens=4, logprobs=True))[0]
    assert plain.logprob is not None and plain.logprob <= 0
    assert op.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].logprob is None


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_regex_and_json_schema_match_generate_with_xgrammar_s_processor(
    tiny_llama_dir, backend
) -> None:
    from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

    op = LLMOperator(tiny_llama_dir, backend=backend)
    model = _reference(tiny_llama_dir)
    eos = sorted(op.model_info.eos_token_ids)
    regex = r"(yes|no), [0-9]{2,3}"
    for kind, value, params in (
        ("regex", regex, SamplingParams(max_tokens=24, regex=regex)),
        ("json_schema", json.dumps(CLOSED_SCHEMA),
         SamplingParams(max_tokens=60, json_schema=CLOSED_SCHEMA)),
    ):  # fmt: skip
        results = op.generate(PROMPTS[:2], params)
        for ids, result in zip(op.tokenize(PROMPTS[:2]), results):
            compiled = op.constraints().grammar(kind, value)
            hf_tokens, _ = hf_generate_under(
                model, ids, params.max_tokens, GrammarProcessor(compiled), eos
            )
            assert_prefix_of_hf(result, hf_tokens, eos)
            assert result.finish_reason == "stop" and result.error is None, result
            if kind == "json_schema":
                value_out = json.loads(result.text)
                assert isinstance(value_out["ok"], bool) and value_out["label"] in ("red", "blue")
            else:
                import re

                assert re.fullmatch(regex, result.text), result.text


def test_json_cut_by_max_tokens_keeps_the_text_and_says_why(tiny_llama_dir) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    (result,) = op.generate(PROMPTS[:1], SamplingParams(max_tokens=3, json_schema=SCHEMA))
    assert result.finish_reason == "length"
    assert result.text.startswith("{") and result.completion_tokens == 3
    assert "not valid" in result.error and "JSON schema" in result.error
    assert op.last_stats.invalid_rows == 1 and op.last_stats.error_rows == 0


def test_constrained_and_free_rows_run_in_one_batch(tiny_llama_dir) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    free = SamplingParams(max_tokens=6)
    mixed = op.generate(PROMPTS, [free, SamplingParams(choices=CHOICES), free, free])
    alone = op.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], free)
    assert [mixed[0], mixed[2], mixed[3]] == alone
    assert mixed[1].text in CHOICES


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"choices": []}, "choices"),
        ({"choices": ["a", "a"]}, "duplicates"),
        ({"choices": "a,b"}, "choices"),
        ({"regex": "[0-9"}, "regex"),
        ({"json_schema": {"type": "objekt"}}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"choices": ["a"], "regex": "a"}, "at most one"),
    ],
)
def test_bad_constraints_are_refused_before_any_model_loads(kwargs, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**kwargs)
    from llm_operator.integrations import infer_options

    with pytest.raises((ValueError, TypeError), match=message):
        infer_options.make_options(model="no-such-model", **kwargs)


def test_choice_trie_jumps_forward_only_when_one_choice_is_left() -> None:
    trie = ChoiceTrie(["ab", "abc", "d"], [[1, 2], [1, 2, 3], [4]])
    assert trie.tail(0) is None  # "ab", "abc" or "d"
    node = trie.children[0][1]
    assert trie.tail(node) is None  # "ab" may end, or go on to "abc"
    assert trie.tail(trie.children[node][2]) is None
    assert trie.tail(trie.children[0][4]) == []  # "d" is complete
    with pytest.raises(ValueError, match="same tokens"):
        ChoiceTrie(["x", "y"], [[5], [5]])
