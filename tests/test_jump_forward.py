"""Jump-forward inside constrained outputs (``Constraints.jump_forward``): tokens the
constraint forces are appended without sampling and fed to the model together in the row's
next step (native: one chunk; hf: several columns of the batch).

- ``"tokens"`` (only a lone allowed token): outputs equal HF ``generate`` under xgrammar's
  own mask, token for token;
- ``"text"`` (the forced text, tokenized): outputs equal HF ``generate`` under a processor
  that forces the same tokens where the engine jumped and applies the grammar's mask
  elsewhere, and parse to values of the schema (compared with stepping).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_prefix_of_hf, hf_generate_under
from transformers import LogitsProcessor

from llm_operator import LLMOperator, SamplingParams
from llm_operator.engine.constraints import ChoiceState, ChoiceTrie, Constraints

PROMPTS = [
    "The weather today is",
    "Classify the review: the battery died after a day. Label:",
    "Classify the review: great screen, fast delivery. Label:",
    "Route the ticket: my invoice is wrong. Team:",
]
# closed values (booleans, enums): a random tiny model completes it in a few tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "label": {"enum": ["refund request", "shipping delay"]},
        "priority": {"enum": ["high", "low"]},
    },
    "required": ["ok", "label", "priority"],
}
REGEX = r"(yes|no), order [0-9]{2,3} (shipped|refunded)"


def _reference(model_dir):
    from helpers import _load_reference_model

    return _load_reference_model(str(model_dir.resolve()))


class _JumpingMask(LogitsProcessor):
    """HF's side of a jumping row, step by step: after each token the model picked, the
    same ``forced`` tokens the engine appends are allowed one at a time; elsewhere the
    grammar's mask."""

    def __init__(self, state, prompt_length: int) -> None:
        self.state, self.seen, self.queue = state, prompt_length, []
        self.jumped = 0

    def __call__(self, input_ids, scores):
        for token in input_ids[0, self.seen :].tolist():
            if self.queue:
                assert token == self.queue.pop(0)
                self.state.accept(token)
            else:
                self.state.accept(token)
                self.queue = self.state.forced(10_000)
                self.jumped += len(self.queue)
        self.seen = input_ids.shape[1]
        scores = scores.clone()
        if self.queue:
            keep = scores[0, self.queue[0]].clone()
            scores.fill_(float("-inf"))
            scores[0, self.queue[0]] = keep
        else:
            self.state.mask(scores[0])
        return scores


def _values(results) -> list:
    return [json.loads(r.text) for r in results]


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_lone_tokens_jump_and_outputs_equal_generate_under_xgrammar_s_mask(
    tiny_llama_dir, backend
) -> None:
    from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

    op = LLMOperator(tiny_llama_dir, backend=backend)
    op.constraints().jump_forward = "tokens"
    model = _reference(tiny_llama_dir)
    eos = sorted(op.model_info.eos_token_ids)
    forced = 0
    for kind, value, params in (
        ("json_schema", json.dumps(SCHEMA), SamplingParams(max_tokens=80, json_schema=SCHEMA)),
        ("regex", REGEX, SamplingParams(max_tokens=40, regex=REGEX)),
    ):
        results = op.generate(PROMPTS, params)
        forced += op.last_stats.forced_tokens
        compiled = op.constraints().grammar(kind, value)
        for ids, result in zip(op.tokenize(PROMPTS), results):
            hf_tokens, _ = hf_generate_under(
                model, ids, params.max_tokens, GrammarProcessor(compiled), eos
            )
            assert_prefix_of_hf(result, hf_tokens, eos)
            assert result.finish_reason == "stop" and result.error is None, result
        assert op.last_stats.output_tokens == sum(r.completion_tokens for r in results)
    assert forced > 0  # the tiny vocabulary leaves lone tokens inside the enums and words


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_forced_text_jumps_and_outputs_equal_generate_forcing_the_same_tokens(
    tiny_llama_dir, backend
) -> None:
    op = LLMOperator(tiny_llama_dir, backend=backend)
    model = _reference(tiny_llama_dir)
    eos = sorted(op.model_info.eos_token_ids)
    params = SamplingParams(max_tokens=80, json_schema=SCHEMA)
    op.constraints().jump_forward = "off"
    stepped = op.generate(PROMPTS, params)
    stepped_stats = op.last_stats
    stepped_profile = getattr(op.backend(), "last_profile", None)
    op.constraints().jump_forward = "text"
    jumped = op.generate(PROMPTS, params)
    stats = op.last_stats
    if backend == "native":  # the forced tokens ran in chunks, not as one-token decodes
        profile = op.backend().last_profile
        assert profile.jump_chunk_tokens > 0 and stepped_profile.jump_chunk_tokens == 0
        assert profile.decode_tokens * 4 < stepped_profile.decode_tokens
        assert profile.iterations < stepped_profile.iterations
        assert stats.prefill_tokens_computed == stepped_stats.prefill_tokens_computed
    for ids, result in zip(op.tokenize(PROMPTS), jumped):
        assert result.finish_reason == "stop" and result.error is None, result
        processor = _JumpingMask(op.constraints().start(params), len(ids))
        hf_tokens, _ = hf_generate_under(model, ids, params.max_tokens, processor, eos)
        assert_prefix_of_hf(result, hf_tokens, eos)
    # most of each output is the schema's text: keys, punctuation, the enums' tails
    assert stats.forced_tokens * 2 > stats.output_tokens
    assert stats.output_tokens == sum(r.completion_tokens for r in jumped)
    assert stepped_stats.forced_tokens < stats.forced_tokens
    # both ways parse to values of the schema (the tokens of the forced text may be split
    # otherwise than the model splits them, so the values may differ: compared, counted)
    for values in (_values(stepped), _values(jumped)):
        for value in values:
            assert set(value) == {"ok", "label", "priority"}
            assert isinstance(value["ok"], bool)
            assert value["label"] in SCHEMA["properties"]["label"]["enum"]
            assert value["priority"] in ("high", "low")
    differ = sum(a != b for a, b in zip(_values(stepped), _values(jumped)))
    assert 0 <= differ <= len(PROMPTS)


def test_forced_text_regex_equals_generate_forcing_the_same_tokens(tiny_llama_dir) -> None:
    import re

    op = LLMOperator(tiny_llama_dir, backend="native")
    op.constraints().jump_forward = "text"
    model = _reference(tiny_llama_dir)
    eos = sorted(op.model_info.eos_token_ids)
    params = SamplingParams(max_tokens=40, regex=REGEX)
    results = op.generate(PROMPTS, params)
    assert op.last_stats.forced_tokens > 0
    for ids, result in zip(op.tokenize(PROMPTS), results):
        assert re.fullmatch(REGEX, result.text), result.text
        processor = _JumpingMask(op.constraints().start(params), len(ids))
        hf_tokens, _ = hf_generate_under(model, ids, params.max_tokens, processor, eos)
        assert_prefix_of_hf(result, hf_tokens, eos)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_forced_tokens_stop_at_max_tokens(tiny_llama_dir, backend) -> None:
    op = LLMOperator(tiny_llama_dir, backend=backend)
    op.constraints().jump_forward = "text"
    full = op.generate(PROMPTS[:2], SamplingParams(max_tokens=80, json_schema=SCHEMA))
    for limit in (2, 5):
        cut = op.generate(PROMPTS[:2], SamplingParams(max_tokens=limit, json_schema=SCHEMA))
        for short, long in zip(cut, full):
            # the cut row is the full row's first tokens: forced ones count as output
            assert short.completion_tokens == limit and short.finish_reason == "length"
            assert short.token_ids == long.token_ids[:limit]
            assert short.error is not None and "not valid" in short.error
        assert op.last_stats.forced_tokens > 0
        assert op.last_stats.output_tokens == 2 * limit


def test_a_stop_string_inside_forced_text_cuts_the_row(tiny_llama_dir) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    op.constraints().jump_forward = "text"
    (result,) = op.generate(
        PROMPTS[:1], SamplingParams(max_tokens=80, json_schema=SCHEMA, stop=('"label"',))
    )
    assert result.finish_reason == "stop"
    assert '"label"' not in result.text and result.text.startswith('{"ok": ')
    # the grammar walked in step with the kept tokens: the cut text is not valid
    assert result.error is not None and "not valid" in result.error


def test_logprob_rows_do_not_jump_and_keep_exact_scores(tiny_llama_dir) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    op.constraints().jump_forward = "text"
    params = SamplingParams(max_tokens=80, json_schema=SCHEMA, logprobs=True)
    with_logprobs = op.generate(PROMPTS[:2], params)
    assert op.last_stats.forced_tokens == 0
    op.constraints().jump_forward = "off"
    plain = op.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in with_logprobs] == [r.token_ids for r in plain]
    for a, b in zip(with_logprobs, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_choices_force_a_lone_trie_child_and_stay_exact() -> None:
    # "billing team" / "billing" / "shipping": after "bill" only "ing" may follow
    trie = ChoiceTrie(["billing team", "billing", "shipping"], [[7, 8, 9], [7, 8], [5]])
    state = ChoiceState(trie, [0])
    assert state.forced(10) == []  # three choices: 7 or 5
    state.accept(7)
    assert state.forced(10) == [8]  # a lone child; then "billing" may end or go on
    assert state.forced(0) == []
    state.accept(8)
    assert state.forced(10) == [] and state.remaining() is None
    off = ChoiceState(trie, [0], jump=False)
    off.accept(7)
    assert off.forced(10) == []


def test_modes_are_checked(tiny_llama_dir) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    constraints: Constraints = op.constraints()
    constraints.jump_forward = "sometimes"
    with pytest.raises(ValueError, match="jump_forward"):
        op.generate(PROMPTS[:1], SamplingParams(max_tokens=4, json_schema=SCHEMA))


def test_text_mode_keeps_a_boundary_token_only_when_nothing_reaches_past_it(
    tiny_llama_dir,
) -> None:
    op = LLMOperator(tiny_llama_dir, backend="native")
    constraints = op.constraints()
    constraints.jump_forward = "text"
    params = SamplingParams(json_schema=SCHEMA)
    state = constraints.start(params)
    tokenizer = op.tokenizer
    forced = state.forced(1000)
    text = tokenizer.decode(forced)
    # the forced text starts the object and its first key; it stops before the value
    # (true/false) and never spells past the grammar's forced string
    forced_string = state.matcher.find_jump_forward_string()
    assert forced and forced_string.startswith(text) and text.startswith('{"ok')
    # the row's own matcher has not moved
    assert state.matcher.find_jump_forward_string() == forced_string
    # after the last value the closing brace is kept: nothing can follow it
    for token in tokenizer('{"ok": true, "label": "refund request", "priority": "low"', add_special_tokens=False)["input_ids"]:  # fmt: skip
        state.accept(token)
    assert tokenizer.decode(state.forced(1000)) == "}"
    assert torch.is_tensor(state.bitmask)


def test_scheduler_runs_a_sampled_token_and_its_forced_tokens_as_one_chunk() -> None:
    from llm_operator.engine.native.block_manager import BlockManager
    from llm_operator.engine.native.scheduler import Scheduler
    from llm_operator.planner import build_plan

    plan = build_plan([[5, 6, 7, 8, 9]], [12])
    scheduler = Scheduler(plan, BlockManager(8, 4), max_batched_tokens=16)
    (prefill,) = scheduler.schedule()
    assert (prefill.start, prefill.length, prefill.sample) == (0, 5, True)
    scheduler.complete([prefill])
    seq = prefill.seq
    scheduler.append_token(seq, 40, [41, 42, 43])
    (chunk,) = scheduler.schedule()
    # one step computes the sampled token and the three forced ones, then samples once
    assert (chunk.start, chunk.length, chunk.sample, chunk.is_decode) == (5, 4, True, False)
    scheduler.complete([chunk])
    assert scheduler.stats.jump_chunk_tokens == 4 and scheduler.stats.prefill_tokens == 5
    scheduler.append_token(seq, 44)
    (decode,) = scheduler.schedule()
    assert decode.is_decode and decode.start == 9
    scheduler.complete([decode])
    assert scheduler.stats.decode_tokens == 1 and scheduler.stats.jump_chunk_tokens == 4
    # a budget smaller than the jump splits it like a prefill; only its last part samples
    small = Scheduler(plan, BlockManager(8, 4), max_batched_tokens=3)
    chunks = []
    while not chunks or not chunks[-1].sample:
        (part,) = small.schedule()
        small.complete([part])
        chunks.append(part)
    small.append_token(chunks[-1].seq, 40, [41, 42, 43, 44, 45])
    (first,) = small.schedule()
    small.complete([first])
    (second,) = small.schedule()
    assert (first.length, first.sample, second.length, second.sample) == (3, False, 3, True)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_free_rows_batched_with_jumping_rows_are_unchanged(tiny_llama_dir, backend) -> None:
    # hf: the jumping rows widen the step, so the free rows get masked holes before their
    # token; native: the jump chunks run beside the free rows' decodes
    op = LLMOperator(tiny_llama_dir, backend=backend)
    op.constraints().jump_forward = "text"
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(max_tokens=80, json_schema=SCHEMA)
    mixed = op.generate(PROMPTS, [free, constrained, free, constrained])
    assert op.last_stats.forced_tokens > 0
    alone_free = op.generate([PROMPTS[0], PROMPTS[2]], free)
    alone_constrained = op.generate([PROMPTS[1], PROMPTS[3]], constrained)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [r.token_ids for r in alone_free]
    assert [mixed[1].token_ids, mixed[3].token_ids] == [r.token_ids for r in alone_constrained]


def test_the_jump_forward_option_sets_the_mode(tiny_llama_dir) -> None:
    """EngineConfig.jump_forward reaches the constraints: "off" forces nothing, "text"
    forces more than "tokens", and "tokens" keeps the outputs of "off"."""
    params = SamplingParams(max_tokens=40, json_schema=SCHEMA)
    runs = {}
    for mode in ("off", "tokens", "text"):
        op = LLMOperator(tiny_llama_dir, backend="native", jump_forward=mode)
        assert op.constraints().jump_forward == mode
        results = op.generate(PROMPTS[:3], params)
        runs[mode] = ([r.token_ids for r in results], op.last_stats.forced_tokens)
    assert runs["off"][1] == 0
    assert runs["text"][1] > runs["tokens"][1]
    assert runs["tokens"][0] == runs["off"][0]
    with pytest.raises(ValueError, match="jump_forward"):
        LLMOperator(tiny_llama_dir, jump_forward="sometimes")
