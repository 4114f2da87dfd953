"""Benchmark workloads: determinism, parameters, token lengths and the sharing each is built for.

Prompts are tokenized the way the library does (chat template, then no special tokens; plain
strings with them) and planned with ``build_plan`` to read their sharing structure.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from transformers import AutoTokenizer

from llm_operator.planner import build_plan
from llm_operator_bench.core import text
from llm_operator_bench.core.workloads import (
    CLASSIFY_STOP,
    DEFAULT_WORKLOADS,
    IGNORE_EOS_WORKLOADS,
    PRESETS,
    SIZES,
    WORKLOAD_NAMES,
    make_workload,
    shared_first_order,
)

# Overshoot allowed over a token target: one sentence plus a short label or answer. The tiny
# test tokenizer is almost character level, so one sentence is 10-60 of its tokens.
SENTENCE_SLACK = 80


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def token_ids(tokenizer, prompts) -> list[list[int]]:
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
        else:
            rendered = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )
            ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return ids


def plan_of(tokenizer, workload):
    return build_plan(token_ids(tokenizer, workload.prompts), workload.max_tokens)


def count(tokenizer, piece: str) -> int:
    return len(tokenizer(piece, add_special_tokens=False)["input_ids"])


def in_range(values, bounds) -> bool:
    return all(bounds[0] <= value <= bounds[1] for value in values)


# -- contract -----------------------------------------------------------------------------
def test_names_and_sizes_match_presets():
    assert tuple(PRESETS) == WORKLOAD_NAMES
    for name in WORKLOAD_NAMES:
        assert tuple(PRESETS[name]) == SIZES
        assert len({tuple(PRESETS[name][size]) for size in SIZES}) == 1, name


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_seed_same_workload_other_seed_differs(tokenizer, name):
    first = make_workload(name, tokenizer, size="tiny", seed=3)
    again = make_workload(name, tokenizer, size="tiny", seed=3)
    other = make_workload(name, tokenizer, size="tiny", seed=4)
    assert first == again
    assert first.prompts != other.prompts
    assert first.name == name and first.description
    assert len(first.max_tokens) == len(first.prompts)
    assert json.loads(json.dumps(first.params)) == first.params
    assert first.params["seed"] == 3 and first.params["size"] == "tiny"
    assert set(PRESETS[name]["tiny"]) <= set(first.params)


def test_global_random_state_is_neither_used_nor_changed(tokenizer):
    random.seed(1)
    state = random.getstate()
    first = make_workload("doc-qa", tokenizer, size="tiny")
    assert random.getstate() == state
    random.seed(2)
    assert make_workload("doc-qa", tokenizer, size="tiny") == first


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_tiny_fits_the_tiny_model(tokenizer, name):
    workload = make_workload(name, tokenizer, size="tiny")
    ids = token_ids(tokenizer, workload.prompts)
    assert 6 <= len(ids) <= 12
    budget = {"long-answers": (16, 24), "classify": (2, 12), "short-rows": (1, 2)}
    budget = budget.get(name, (2, 6))
    assert in_range(workload.max_tokens, budget)
    assert max(len(row) + m for row, m in zip(ids, workload.max_tokens)) <= 190  # context 256
    assert all(isinstance(p, str) == (name == "no-sharing") for p in workload.prompts)


@pytest.mark.parametrize("size", ["tiny", "default"])
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_every_row_is_a_distinct_prompt(tokenizer, name, size):
    prompts = make_workload(name, tokenizer, size=size, seed=5).prompts
    assert len({json.dumps(prompt) for prompt in prompts}) == len(prompts)


def test_bad_arguments_raise_value_errors_listing_the_choices(tokenizer):
    with pytest.raises(ValueError, match="etl-fewshot, doc-qa, table-rows, short-rows, no-sharing"):
        make_workload("etl", tokenizer)
    with pytest.raises(ValueError, match="tiny, quick, default"):
        make_workload("doc-qa", tokenizer, size="huge")
    with pytest.raises(ValueError, match="documents.*valid: groups, rows_per_group, prefix_tokens"):
        make_workload("etl-fewshot", tokenizer, size="tiny", documents=3)
    with pytest.raises(ValueError, match="shared-first, schema"):
        make_workload("table-rows", tokenizer, size="tiny", field_order="random")
    bad = [
        ("etl-fewshot", {"rows_per_group": 0}),
        ("etl-fewshot", {"groups": True}),
        ("etl-fewshot", {"prefix_tokens": (90, 30)}),
        ("doc-qa", {"document_tokens": (10, 20, 30)}),
        ("no-sharing", {"prompt_tokens": 0}),
        ("table-rows", {"categories": 99}),
        ("short-rows", {"genres": 99}),
    ]
    for name, override in bad:
        with pytest.raises(ValueError, match=next(iter(override))):
            make_workload(name, tokenizer, size="tiny", **override)


def test_overrides_replace_size_parameters_and_are_recorded(tokenizer):
    workload = make_workload(
        "etl-fewshot", tokenizer, size="tiny", groups=3, rows_per_group=2, max_tokens=5
    )
    assert len(workload.prompts) == 6
    assert workload.max_tokens == [5] * 6
    assert workload.params["groups"] == 3 and workload.params["rows_per_group"] == 2
    assert workload.params["max_tokens"] == [5, 5]
    assert workload.params["prefix_tokens"] == list(PRESETS["etl-fewshot"]["tiny"]["prefix_tokens"])
    assert make_workload("etl-fewshot", tokenizer, size="tiny").params["groups"] == 2


# -- etl-fewshot --------------------------------------------------------------------------
def test_etl_fewshot_one_group_per_task_in_input_order(tokenizer):
    workload = make_workload("etl-fewshot", tokenizer, size="default", seed=1)
    groups, rows = workload.params["groups"], workload.params["rows_per_group"]
    plan = plan_of(tokenizer, workload)
    assert plan.stats.groups == groups
    assert plan.stats.saving_ratio > 0.6
    # Rows arrive task by task: each run of `rows` prompts shares all turns but the last.
    shared = [json.dumps(prompt[:-1]) for prompt in workload.prompts]
    assert len(set(shared)) == groups
    for group in range(groups):
        block = slice(group * rows, (group + 1) * rows)
        assert len(set(shared[block])) == 1
        assert len(set(workload.max_tokens[block])) == 1
    assert len(set(workload.max_tokens)) == groups  # groups differ: decode-first matters
    assert in_range(workload.max_tokens, workload.params["max_tokens"])
    # The shared part (system + instructions + few-shot turns) has about prefix_tokens tokens.
    lo, hi = workload.params["prefix_tokens"]
    for group in range(groups):
        messages = workload.prompts[group * rows]
        assert messages[0]["role"] == "system" and len(messages) >= 4
        assert [m["role"] for m in messages[1:-1]] == ["user", "assistant"] * (
            len(messages) // 2 - 1
        )
        prefix = sum(count(tokenizer, m["content"]) for m in messages[:-1])
        assert lo <= prefix <= hi + SENTENCE_SLACK
    lo, hi = workload.params["input_tokens"]
    for messages in workload.prompts:
        row = messages[-1]["content"].split(": ", 1)[1]
        assert lo <= count(tokenizer, row) <= hi + SENTENCE_SLACK


def test_etl_fewshot_more_groups_than_tasks_stay_separate(tokenizer):
    workload = make_workload("etl-fewshot", tokenizer, size="tiny", groups=11, rows_per_group=2)
    assert plan_of(tokenizer, workload).stats.groups == 11


# -- doc-qa -------------------------------------------------------------------------------
def test_doc_qa_shares_on_two_levels(tokenizer):
    workload = make_workload("doc-qa", tokenizer, size="default")
    documents, questions = workload.params["documents"], workload.params["questions_per_document"]
    assert len(workload.prompts) == documents * questions
    assert len({json.dumps(p) for p in workload.prompts}) == len(workload.prompts)
    plan = plan_of(tokenizer, workload)
    assert plan.stats.groups == documents
    assert max(len(request.chain) for request in plan.requests) >= 2
    assert max(segment.num_requests for segment in plan.segments) == len(workload.prompts)
    assert plan.stats.saving_ratio > 0.6
    assert in_range(workload.max_tokens, workload.params["max_tokens"])
    system = {p[0]["content"] for p in workload.prompts}
    assert len(system) == 1
    target = workload.params["system_tokens"]
    assert target <= count(tokenizer, system.pop()) <= target + SENTENCE_SLACK
    # Input order: document by document, each with its questions.
    pattern = re.compile(r"Document:\n(.*)\n\nQuestion: (.*)", re.S)
    parts = [pattern.fullmatch(p[1]["content"]).groups() for p in workload.prompts]
    docs = [doc for doc, _ in parts]
    assert len(set(docs)) == documents
    assert docs == [docs[i - i % questions] for i in range(len(docs))]
    lo, hi = workload.params["document_tokens"]
    assert in_range([count(tokenizer, doc) for doc in set(docs)], (lo, hi + SENTENCE_SLACK))
    lo, hi = workload.params["question_tokens"]
    assert in_range([count(tokenizer, q) for _, q in parts], (lo, hi + SENTENCE_SLACK))


# -- long-answers -------------------------------------------------------------------------
def test_only_long_answers_ignores_eos(tokenizer):
    assert IGNORE_EOS_WORKLOADS == {"long-answers"}
    for name in WORKLOAD_NAMES:
        assert make_workload(name, tokenizer, size="tiny").ignore_eos == (name == "long-answers")


def test_long_answers_share_long_documents_and_decode_long(tokenizer):
    workload = make_workload("long-answers", tokenizer, size="default")
    p = workload.params
    assert (p["documents"], p["questions_per_document"]) == (2, 8)
    assert len(workload.prompts) == 16
    assert in_range(workload.max_tokens, p["max_tokens"])
    assert 230 <= sum(workload.max_tokens) / len(workload.max_tokens) <= 280  # ~256 each
    assert len(set(workload.max_tokens)) > 4  # rows end apart: decode batches shrink
    plan = plan_of(tokenizer, workload)
    assert plan.stats.groups == p["documents"]
    assert plan.stats.saving_ratio > 0.8  # the document is most of each prompt
    pattern = re.compile(r"Document:\n(.*)\n\nQuestion: (.*)", re.S)
    parts = [pattern.fullmatch(prompt[1]["content"]).groups() for prompt in workload.prompts]
    docs = {doc for doc, _ in parts}
    assert len(docs) == p["documents"]
    lo, hi = p["document_tokens"]
    assert in_range([count(tokenizer, doc) for doc in docs], (lo, hi + SENTENCE_SLACK))
    assert "long answers" in workload.description and "EOS ignored" in workload.description


# -- table-rows ---------------------------------------------------------------------------
def test_table_rows_shared_first_order_shares_much_more_than_schema_order(tokenizer):
    shared = make_workload("table-rows", tokenizer, size="default", seed=2)
    schema = make_workload("table-rows", tokenizer, size="default", seed=2, field_order="schema")
    assert shared.params["field_order"] == "shared-first"
    assert shared.params["fields"][:2] == ["category", "brand"]
    assert set(shared.params["fields"][2:4]) == {"product", "description"}
    assert shared.params["fields"][-1] == "review"
    assert schema.params["fields"][0] == "review"
    shared_plan, schema_plan = plan_of(tokenizer, shared), plan_of(tokenizer, schema)
    assert shared_plan.stats.saving_ratio > schema_plan.stats.saving_ratio + 0.3
    assert schema_plan.stats.saving_ratio < 0.15
    # The same table in the same (random, unsorted) row order: only the rendering differs.
    reviews = [re.search(r"Review: (.*)", p[-1]["content"]).group(1) for p in shared.prompts]
    assert reviews == [
        re.search(r"Review: (.*)", p[-1]["content"]).group(1) for p in schema.prompts
    ]
    contents = [p[-1]["content"] for p in shared.prompts]
    assert contents != sorted(contents)
    assert len(shared.prompts) == shared.params["rows"]
    assert in_range(shared.max_tokens, shared.params["max_tokens"])
    assert in_range([count(tokenizer, r) for r in reviews], (100, 220 + SENTENCE_SLACK))


def test_shared_first_order_counts_distinct_values_jointly():
    places = [("Lyon", "France"), ("Paris", "France"), ("Osaka", "Japan")] * 4
    table = [
        {"id": f"row {i}", "rating": str(i % 2), "city": city, "country": country}
        for i, (city, country) in enumerate(places)
    ]
    # country and rating have 2 values each (country is longer: first). After country, city
    # makes 3 combinations and rating 4, so city comes next although it has more values alone.
    order = shared_first_order(table, ["id", "rating", "city", "country"])
    assert order == ["country", "city", "rating", "id"]


# -- no-sharing ---------------------------------------------------------------------------
def test_no_sharing_prompts_share_no_prefix(tokenizer):
    workload = make_workload("no-sharing", tokenizer, size="default")
    assert len(workload.prompts) == workload.params["rows"]
    ids = token_ids(tokenizer, workload.prompts)
    assert len({tuple(row[:3]) for row in ids}) == len(ids)
    plan = plan_of(tokenizer, workload)
    assert plan.stats.segments == 0 and plan.stats.saving_ratio < 0.01
    assert all(
        p.endswith("the text above.") or p.endswith("one sentence.") for p in workload.prompts
    )
    lo, hi = workload.params["prompt_tokens"]
    assert in_range([len(row) for row in ids], (lo, hi + SENTENCE_SLACK))
    assert in_range(workload.max_tokens, workload.params["max_tokens"])


# -- text ---------------------------------------------------------------------------------
def test_text_is_seeded_and_rejects_unknown_topics():
    assert text.paragraph(random.Random(5), "support") == text.paragraph(
        random.Random(5), "support"
    )
    assert text.paragraph(random.Random(5), "policy") != text.paragraph(random.Random(6), "policy")
    with pytest.raises(ValueError, match="review"):
        text.sentence(random.Random(0), "weather")
    rng = random.Random(0)
    for topic in text.TOPICS:
        for _ in range(30):
            sentence = text.sentence(rng, topic)
            assert "{" not in sentence and sentence[0].isupper() and sentence[-1] in ".?!"
    paragraph = text.paragraph(rng, "technical", sentences=4)
    assert len(re.findall(r"[.?!](?:\s|$)", paragraph)) == 4


def test_fixed_slots_are_used():
    rng = random.Random(1)
    for _ in range(20):
        sentence, slots = text.sentence_with_slots(rng, "product", {"product": "blender"})
        assert slots["product"] == "blender"
        assert "{" not in sentence


def test_text_with_tokens_stops_at_the_first_sentence_that_reaches_the_target(tokenizer):
    def count_tokens(pieces):
        return [count(tokenizer, piece) for piece in pieces]

    rng = random.Random(7)
    assert text.sentences_with_tokens(rng, "review", 0, count_tokens) == []
    for target in (1, 12, 60, 300):
        for topic in ("review", "support", "company"):
            sentences = text.sentences_with_tokens(rng, topic, target, count_tokens)
            assert count(tokenizer, " ".join(sentences)) >= target
            assert count(tokenizer, " ".join(sentences[:-1])) < target
    joined = text.text_with_tokens(random.Random(3), "policy", 40, count_tokens)
    assert joined == " ".join(
        text.sentences_with_tokens(random.Random(3), "policy", 40, count_tokens)
    )


# -- classify -----------------------------------------------------------------------------
def test_classify_rows_carry_their_task_labels_and_gold(tokenizer):
    workload = make_workload("classify", tokenizer, size="default", seed=1)
    p = workload.params
    assert (p["tasks"], p["rows"]) == (4, 2000)
    assert len(workload.prompts) == len(workload.choices) == len(workload.gold) == p["rows"]
    assert workload.stop == CLASSIFY_STOP == ("\n",) and not workload.ignore_eos
    # Rows of the tasks in turn; each task's rows share everything but their last turn.
    prefixes = [json.dumps(prompt[:-1]) for prompt in workload.prompts]
    tasks = p["tasks"]
    assert len(set(prefixes)) == tasks
    assert all(prefixes[row] == prefixes[row % tasks] for row in range(len(prefixes)))
    labels_of = [workload.choices[task] for task in range(tasks)]
    assert [len(labels) for labels in labels_of] == [3, 4, 6, 3]
    assert "company news" in labels_of[3]  # a label of two words
    for row, (prompt, choices, gold) in enumerate(
        zip(workload.prompts, workload.choices, workload.gold)
    ):
        assert choices == labels_of[row % tasks] and gold in choices
        assert prompt[-1]["role"] == "user" and prompt[0]["role"] == "system"
        # max_tokens: the task's longest label plus extra_tokens
        longest = max(count(tokenizer, label) for label in choices)
        assert workload.max_tokens[row] == longest + p["extra_tokens"]
    for labels in labels_of:  # every label is drawn, roughly evenly
        golds = [g for g, c in zip(workload.gold, workload.choices) if c == labels]
        shares = [golds.count(label) / len(golds) for label in labels]
        assert min(shares) > 0.5 / len(labels), shares
    for task, labels in enumerate(labels_of):
        messages = workload.prompts[task]
        system = messages[0]["content"]
        assert ", ".join(labels) in system  # the instructions list the labels
        answers = [m["content"] for m in messages[1:-1] if m["role"] == "assistant"]
        assert set(answers) == set(labels)  # the few-shot examples show every label
        lo, hi = p["prefix_tokens"]
        prefix = sum(count(tokenizer, m["content"]) for m in messages[:-1])
        assert lo <= prefix <= hi + SENTENCE_SLACK
    lo, hi = p["input_tokens"]
    for messages in workload.prompts:
        row = messages[-1]["content"].split(": ", 1)[1].split("\nReview: ")[-1]
        assert lo <= count(tokenizer, row) <= hi + SENTENCE_SLACK
    plan = plan_of(tokenizer, workload)
    assert plan.stats.groups == tasks and plan.stats.saving_ratio > 0.8


def test_classify_inputs_are_written_for_their_gold_label(tokenizer):
    workload = make_workload("classify", tokenizer, size="quick", seed=2)
    for prompt, gold in zip(workload.prompts, workload.gold):
        field, written = prompt[-1]["content"].split(": ", 1)
        if field == "Product":  # "Product: <noun>\nReview: ...": the noun's category
            noun = written.split("\n", 1)[0]
            assert noun in text.CATEGORY_PRODUCTS[gold]
        elif field == "Ticket":  # sentences of that team's support templates
            assert gold in ("billing", "shipping", "account", "technical")
    assert len(workload.prompts) == 64 and workload.params["tasks"] == 4


def test_classify_sizes_and_overrides(tokenizer):
    tiny = make_workload("classify", tokenizer, size="tiny")
    assert tiny.params["tasks"] == 2 and len(tiny.prompts) == 8
    assert {len(c) for c in tiny.choices} == {3, 4}
    one = make_workload("classify", tokenizer, size="tiny", tasks=1, rows=3, extra_tokens=5)
    assert len({json.dumps(p[:-1]) for p in one.prompts}) == 1 and len(one.prompts) == 3
    longest = max(count(tokenizer, label) for label in one.choices[0])
    assert one.max_tokens == [longest + 5] * 3
    with pytest.raises(ValueError, match="tasks=5"):
        make_workload("classify", tokenizer, size="tiny", tasks=5)
    with pytest.raises(ValueError, match="extra_tokens"):
        make_workload("classify", tokenizer, size="tiny", extra_tokens=0)


def test_only_classify_has_labels_and_is_not_run_by_default(tokenizer):
    assert DEFAULT_WORKLOADS == tuple(n for n in WORKLOAD_NAMES if n != "classify")
    for name in DEFAULT_WORKLOADS:
        workload = make_workload(name, tokenizer, size="tiny")
        assert workload.choices is None and workload.gold is None and workload.stop == ()
