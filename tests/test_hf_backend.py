"""LLMOperator(backend="hf") against Hugging Face generate, prompt by prompt (greedy, fp32)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from helpers import hf_generate_greedy

from llm_operator import LLMOperator, SamplingParams

SYSTEM = "Classify the sentiment as positive, negative or neutral. Answer with a single word: yes or no. "
DOCS = [
    "The battery lasts two full days and charges in under an hour. ",
    "Shipping took 12 days and the box arrived crushed. The screen has a dead pixel. ",
    "The blender is loud, but it crushes ice in seconds. ",
]
QUESTIONS = [
    "Is it good?",
    "Summarize the review in one sentence.",
    "Rate the urgency",
    "Label:",
    "Why?",
]


def three_level_prompts() -> list[str]:
    """system -> document -> question: sharing at two and three levels, plus loners."""
    prompts = [SYSTEM + doc + q for doc in DOCS for q in QUESTIONS]
    prompts += [SYSTEM + "Thanks!", "Overall a solid purchase; setup took five minutes.", "Why"]
    random.Random(7).shuffle(prompts)
    return prompts


def assert_matches_hf(op: LLMOperator, model_dir, prompts, results, max_tokens, **oracle) -> None:
    for prompt, result in zip(prompts, results):
        ids = op.tokenizer(prompt)["input_ids"]
        expected = hf_generate_greedy(model_dir, ids, max_tokens, **oracle)
        assert list(result.token_ids) == expected, prompt
        assert result.prompt_tokens == len(ids)
        assert result.completion_tokens == len(expected)
        assert result.text == op.tokenizer.decode(expected, skip_special_tokens=True)


def test_multilevel_sharing_matches_hf_generate(tiny_model_dir):
    op = LLMOperator(tiny_model_dir, backend="hf", max_batch_size=3)
    prompts = three_level_prompts()
    results = op.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [r.finish_reason for r in results] == ["length"] * len(prompts)
    assert_matches_hf(op, tiny_model_dir, prompts, results, 10, ignore_eos=True)
    stats = op.last_stats
    plan = op.plan(prompts)
    # the engine prefilled exactly what the plan said, far less than the prompts
    assert (
        stats.prefill_tokens_computed == plan.stats.prefill_tokens == stats.planned_prefill_tokens
    )
    assert stats.prefill_tokens_computed < 0.6 * stats.prompt_tokens
    assert plan.stats.segments >= 4  # the system prompt and each document
    assert max(len(r.chain) for r in plan.requests) >= 2


def test_small_batch_many_replacements_and_lengths(tiny_llama_dir):
    rng = random.Random(3)
    words = "the battery screen box order refund shipping quiet fast broken great".split()
    prompts = [
        " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 5, 30, 60]))) for _ in range(24)
    ]
    op = LLMOperator(tiny_llama_dir, backend="hf", max_batch_size=2, prefill_batch_tokens=64)
    results = op.generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 7, ignore_eos=True)


def test_duplicates_computed_once_and_fanned_out(tiny_qwen2_dir):
    base = ["Great value for the price.", "The tent kept us dry.", "Great value for the price."]
    prompts = base * 3
    op = LLMOperator(tiny_qwen2_dir, backend="hf", max_batch_size=4)
    results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert op.last_stats.requests == 2
    assert op.last_stats.rows == 9
    assert len({r.token_ids for r in results}) <= 2
    assert_matches_hf(op, tiny_qwen2_dir, prompts, results, 6, ignore_eos=True)


def _model_with_eos(model_dir, tmp_path, eos_token_id: int):
    copy = tmp_path / "eos-model"
    shutil.copytree(model_dir, copy)
    for name in ("generation_config.json", "config.json"):
        path = copy / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos_token_id
        path.write_text(json.dumps(data))
    return copy


def check_eos_hit_mid_batch(model_dir, tmp_path, backend: str, **options) -> None:
    """Make EOS a token that some rows produce early and others not at all; every row must
    stop where HF generate stops it."""
    prompts = three_level_prompts()[:10]
    probe = LLMOperator(model_dir, backend=backend)
    outs = probe.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    counts: dict[int, int] = {}
    for r in outs:
        for t in set(r.token_ids[1:8]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((c, t) for t, c in counts.items() if c < len(prompts))[1]
    eos_dir = _model_with_eos(model_dir, tmp_path, eos)
    op = LLMOperator(eos_dir, backend=backend, **options)
    results = op.generate(prompts, SamplingParams(max_tokens=12))
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}
    for r in results:
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == eos)
    assert_matches_hf(op, eos_dir, prompts, results, 12)


def test_eos_hit_mid_batch(tiny_model_dir, tmp_path):
    check_eos_hit_mid_batch(tiny_model_dir, tmp_path, "hf", max_batch_size=3)


def test_stop_strings_match_hf_generate(tiny_mistral_dir):
    from transformers import AutoModelForCausalLM

    prompts = three_level_prompts()[:8]
    op = LLMOperator(tiny_mistral_dir, backend="hf", max_batch_size=3)
    free = op.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    # a stop string that appears in the middle of some outputs
    stop = next(
        r.text[len(r.text) // 2 : len(r.text) // 2 + 2] for r in free if len(r.text.strip()) > 6
    )
    results = op.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    model = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()
    stopped = 0
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([op.tokenizer(prompt)["input_ids"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            stop_strings=[stop],
            tokenizer=op.tokenizer,
        )[0, ids.shape[1] :].tolist()
        assert list(result.token_ids) == out
        full = op.tokenizer.decode(out, skip_special_tokens=True)
        if stop in full:
            stopped += 1
            assert result.finish_reason == "stop"
            assert result.text == full[: full.index(stop)]
        else:
            assert result.finish_reason == "length"
    assert stopped >= 1


def test_chat_messages_use_the_chat_template(tiny_llama_dir):
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc}] for doc in DOCS
    ] + [[{"role": "user", "content": "Why?"}]]
    op = LLMOperator(tiny_llama_dir, backend="hf", max_batch_size=2)
    results = op.generate(conversations, SamplingParams(max_tokens=8, ignore_eos=True))
    for messages, result in zip(conversations, results):
        ids = op.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert "<|im_start|>assistant" in op.tokenizer.decode(ids)
        assert list(result.token_ids) == hf_generate_greedy(
            tiny_llama_dir, list(ids), 8, ignore_eos=True
        )


def test_results_in_input_order(tiny_llama_dir):
    prompts = three_level_prompts()
    op = LLMOperator(tiny_llama_dir, backend="hf", max_batch_size=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    forward = op.generate(prompts, params)
    backward = op.generate(prompts[::-1], params)
    assert [r.token_ids for r in backward] == [r.token_ids for r in forward][::-1]


def test_bad_rows_get_errors_and_others_complete(tiny_llama_dir):
    too_long = "battery " * 400
    prompts = ["Great value for the price.", None, "", 42, too_long, [{"role": "user"}], "Why?"]
    op = LLMOperator(tiny_llama_dir, backend="hf")
    results = op.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(results) == len(prompts)
    reasons = [r.finish_reason for r in results]
    assert reasons == ["length", "error", "error", "error", "error", "error", "length"]
    assert "null" in results[1].error
    assert "empty" in results[2].error
    assert "int" in results[3].error
    assert "context of 256" in results[4].error
    assert "content" in results[5].error
    assert_matches_hf(
        op, tiny_llama_dir, [prompts[0], prompts[6]], [results[0], results[6]], 4, ignore_eos=True
    )
    assert op.last_stats.error_rows == 5


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_options_raise(options, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**options)


def test_bad_engine_options_raise(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_batch_size"):
        LLMOperator(tiny_llama_dir, max_batch_size=0)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMOperator(tiny_llama_dir, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="backend"):
        LLMOperator(tiny_llama_dir, backend="tensorrt")
    op = LLMOperator(tiny_llama_dir)
    with pytest.raises(ValueError, match="sampling"):
        op.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(TypeError, match="prompts"):
        op.generate("just one string")


def test_seeded_rows_sample_the_same_whatever_the_batch(tiny_qwen2_dir):
    prompts = three_level_prompts()[:6]
    params = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=11, ignore_eos=True
    )
    op = LLMOperator(tiny_qwen2_dir, backend="hf", max_batch_size=4)
    together = op.generate(prompts, params)
    alone = [op.generate([p], params)[0] for p in prompts[:3]]
    small_batches = LLMOperator(tiny_qwen2_dir, backend="hf", max_batch_size=1).generate(
        prompts[::-1], params
    )[::-1]
    assert [r.token_ids for r in alone] == [r.token_ids for r in together[:3]]
    assert [r.token_ids for r in small_batches] == [r.token_ids for r in together]
    other_seed = op.generate(
        prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=12, ignore_eos=True)
    )
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in together]
    greedy = op.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    top1 = op.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=3, ignore_eos=True)
    )
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_kv_budget_waits_instead_of_failing(tiny_llama_dir):
    prompts = three_level_prompts()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    unbounded = LLMOperator(tiny_llama_dir, backend="hf", max_batch_size=8).generate(
        prompts, params
    )
    # 2 layers x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes per token: room for ~3 rows
    tight = LLMOperator(tiny_llama_dir, backend="hf", max_batch_size=8, kv_cache_memory=512 * 450)
    assert [r.token_ids for r in tight.generate(prompts, params)] == [
        r.token_ids for r in unbounded
    ]
    tiny = LLMOperator(tiny_llama_dir, backend="hf", kv_cache_memory=512 * 8)
    results = tiny.generate(["Why", SYSTEM + DOCS[0]], params)
    assert results[1].finish_reason == "error" and "kv_cache_memory" in results[1].error


def test_generation_stops_at_the_context_length(tiny_llama_dir):
    op = LLMOperator(tiny_llama_dir, backend="hf")
    prompt = op.tokenizer.decode(op.tokenizer("battery screen " * 200)["input_ids"][:250])
    ids = op.tokenizer(prompt)["input_ids"]
    result = op.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert result.finish_reason == "length"
    assert result.completion_tokens == 256 - len(ids)


def test_padding_columns_are_trimmed():
    from llm_operator.engine.hf.batch_cache import DenseBatchCache

    def kv(rows, time):
        return [(torch.randn(rows, 2, time, 4), torch.randn(rows, 2, time, 4))]

    cache = DenseBatchCache(kv(1, 10), torch.ones(1, 10, dtype=torch.bool), torch.tensor([10]))
    cache.write_rows([1], kv(1, 3), torch.ones(1, 3, dtype=torch.bool), torch.tensor([3]))
    assert (cache.rows, cache.time) == (2, 10)
    assert cache.row_lengths().tolist() == [10, 3]
    cache.park_rows([0])  # the long row leaves: its 7 extra columns are padding everywhere
    assert cache.time == 3
    new_keys = kv(1, 5)
    cache.write_rows([0], new_keys, torch.ones(1, 5, dtype=torch.bool), torch.tensor([5]))
    assert cache.time == 5  # grew on the left for the longer row
    keys = cache.layers[0].keys
    assert torch.equal(keys[0], new_keys[0][0][0])
    assert torch.equal(keys[1, :, :2], torch.zeros(2, 2, 4))  # left padding of the short row
    assert cache.mask[:, cache.start : cache.length].sum(dim=1).tolist() == [5, 3]


def test_progress_bar_only_when_asked(tiny_llama_dir, capsys):
    prompts = three_level_prompts()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    LLMOperator(tiny_llama_dir, backend="hf").generate(prompts, params)
    assert capsys.readouterr().err == ""
    LLMOperator(tiny_llama_dir, backend="hf", progress=True).generate(prompts, params)
    err = capsys.readouterr().err
    assert f"{len(prompts)}/{len(prompts)}" in err and "row" in err and "tok/s" in err


def test_budget_limited_admission_reuses_and_appends_rows(tiny_qwen2_dir):
    """Rows finish at different steps while the KV budget, not max_batch_size, limits the
    batch: admissions then fill freed rows and append new ones in the same pass."""
    rng = random.Random(11)
    words = "the battery screen box order refund shipping quiet fast broken great".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(1, 9), ignore_eos=True) for _ in prompts]
    expected = None
    for rows in (3, 4, 5):
        # 512 bytes per token; each row may claim about 40 + 9 + 64 columns
        op = LLMOperator(
            tiny_qwen2_dir, backend="hf", max_batch_size=8, kv_cache_memory=512 * 120 * rows
        )
        results = op.generate(prompts, params)
        if expected is None:
            expected = [
                hf_generate_greedy(
                    tiny_qwen2_dir, op.tokenizer(prompt)["input_ids"], p.max_tokens, ignore_eos=True
                )
                for prompt, p in zip(prompts, params)
            ]
        assert [list(r.token_ids) for r in results] == expected


def test_a_lone_surrogate_is_an_error_row_and_the_rest_complete(tiny_llama_dir) -> None:
    """A JSON file with a bad \\ud800 escape gives Python such strings; the tokenizer raises
    TypeError on them, which once took the whole batch down."""
    from llm_operator import LLMOperator, SamplingParams

    op = LLMOperator(tiny_llama_dir, backend="hf")
    prompts = ["abc\ud800def", "The weather today is", [{"role": "user", "content": "x\udfffy"}]]
    results = op.generate(prompts, SamplingParams(max_tokens=3))
    assert results[0].finish_reason == "error" and "U+D800" in results[0].error
    assert "character 3" in results[0].error
    assert results[1].finish_reason in ("stop", "length") and results[1].completion_tokens > 0
    assert results[2].finish_reason == "error" and "U+DFFF" in results[2].error
    alone = op.generate(["The weather today is"], SamplingParams(max_tokens=3))
    assert results[1] == alone[0]
