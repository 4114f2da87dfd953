"""Tests of the bundled demo data and its loader (``llm_operator.cli.demo_data``)."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from llm_operator.cli.demo_data import (
    DEFAULT_DATA_DIR,
    DemoTask,
    build_demo_rows,
    load_rows,
    load_tasks,
    parse_label,
)

EXPECTED_TASKS = {
    "review-sentiment": ("reviews", {"positive", "negative", "neutral"}),
    "review-category": (
        "reviews",
        {"electronics", "kitchen", "clothing", "books", "toys", "home"},
    ),
    "ticket-routing": ("tickets", {"billing", "account", "shipping", "technical", "other"}),
    "ticket-urgency": ("tickets", {"high", "medium", "low"}),
}


@pytest.fixture(scope="module")
def tasks() -> list[DemoTask]:
    return load_tasks()


@pytest.fixture(scope="module")
def demo_rows() -> list[dict]:
    return build_demo_rows()


def test_default_data_dir_is_examples_data() -> None:
    assert DEFAULT_DATA_DIR.is_dir()
    assert DEFAULT_DATA_DIR.parts[-2:] == ("examples", "data")


def test_tasks_load(tasks: list[DemoTask]) -> None:
    assert {task.name: (task.source, set(task.labels)) for task in tasks} == EXPECTED_TASKS
    for task in tasks:
        assert 4 <= len(task.examples) <= 6
        assert {label for _, label in task.examples} <= set(task.labels)
        assert 1000 <= len(task.prompt_prefix) <= 2200, task.name
        assert "{" not in task.answer_cue


def test_every_task_source_exists(tasks: list[DemoTask]) -> None:
    for task in tasks:
        assert (DEFAULT_DATA_DIR / f"{task.source}.jsonl").is_file()
        assert load_rows(task.source)


def test_reviews_file() -> None:
    rows = load_rows("reviews")
    assert 240 <= len(rows) <= 280
    categories = EXPECTED_TASKS["review-category"][1]
    for row in rows:
        assert set(row) == {"id", "product", "category", "rating", "text"}
        assert row["category"] in categories
        assert row["rating"] in {1, 2, 3, 4, 5}
        assert 15 <= len(row["text"].split()) <= 60, row["id"]
    assert len({row["id"] for row in rows}) == len(rows)
    assert len({row["text"] for row in rows}) == len(rows)
    assert set(Counter(row["category"] for row in rows)) == categories
    assert set(Counter(row["rating"] for row in rows)) == {1, 2, 3, 4, 5}


def test_tickets_file() -> None:
    rows = load_rows("tickets")
    assert 220 <= len(rows) <= 260
    for row in rows:
        assert set(row) == {"id", "channel", "subject", "text"}
        assert row["channel"] in {"email", "chat", "web"}
        assert row["subject"].strip()
        assert 15 <= len(row["text"].split()) <= 70, row["id"]
    assert len({row["id"] for row in rows}) == len(rows)
    assert len({row["text"] for row in rows}) == len(rows)


def test_demo_rows_shape(demo_rows: list[dict], tasks: list[DemoTask]) -> None:
    assert 480 <= len(demo_rows) <= 520
    assert len(demo_rows) == len(load_rows("reviews")) + len(load_rows("tickets"))
    ids = [row["id"] for row in demo_rows]
    assert len(set(ids)) == len(ids)
    counts = Counter(row["task"] for row in demo_rows)
    assert set(counts) == set(EXPECTED_TASKS)
    assert abs(counts["review-sentiment"] - counts["review-category"]) <= 1
    assert abs(counts["ticket-routing"] - counts["ticket-urgency"]) <= 1
    by_name = {task.name: task for task in tasks}
    for row in demo_rows:
        task = by_name[row["task"]]
        assert set(row) == {"id", "task", "input", "messages", "prompt", "labels", "gold"}
        assert row["labels"] == list(task.labels)
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system"] + ["user", "assistant"] * len(task.examples) + ["user"]
        assert row["messages"][0]["content"] == f"{task.system}\n\n{task.instructions}"
        shots = row["messages"][1:-1]
        for (example, label), (user, assistant) in zip(task.examples, zip(shots[::2], shots[1::2])):
            assert user["content"] == f"{example}\n{task.answer_cue}"
            assert assistant["content"] == label
        assert row["messages"][-1]["content"] == row["input"]
        assert row["prompt"] == f"{task.system}\n\n{task.user_prefix}{row['input']}"
        assert row["gold"] is None or row["gold"] in task.labels
        assert row["input"].endswith(task.answer_cue)


def test_demo_rows_are_interleaved_not_grouped(demo_rows: list[dict]) -> None:
    first = [row["task"] for row in demo_rows[:8]]
    assert (
        first
        == [
            "review-sentiment",
            "ticket-routing",
            "review-category",
            "ticket-urgency",
        ]
        * 2
    )
    assert demo_rows[0]["id"] == load_rows("reviews")[0]["id"]
    assert demo_rows[1]["id"] == load_rows("tickets")[0]["id"]


def test_demo_rows_are_deterministic(demo_rows: list[dict]) -> None:
    assert build_demo_rows() == demo_rows


def test_rows_of_a_task_share_the_full_prefix(demo_rows: list[dict], tasks: list[DemoTask]) -> None:
    for task in tasks:
        rows = [row for row in demo_rows if row["task"] == task.name]
        first, second = rows[0], rows[1]
        prefix = task.prompt_prefix
        assert first["prompt"].startswith(prefix)
        assert second["prompt"].startswith(prefix)
        # They differ right after the prefix's constant lead-in, i.e. in the row text.
        a, b = first["prompt"][len(prefix) :], second["prompt"][len(prefix) :]
        assert a != b
        assert a == first["input"] and b == second["input"]
        for example, _ in task.examples:
            assert example in prefix
        assert all(row["messages"][:-1] == first["messages"][:-1] for row in rows)


def test_example_block_format(tasks: list[DemoTask]) -> None:
    task = next(task for task in tasks if task.name == "review-sentiment")
    example, label = task.examples[0]
    assert f"{example}\n{task.answer_cue} {label}\n\n" in task.user_prefix
    assert task.user_prefix.startswith(task.instructions)
    assert task.user_prefix.endswith("\n\n")


def test_limit(demo_rows: list[dict]) -> None:
    assert build_demo_rows(limit=10) == demo_rows[:10]
    assert build_demo_rows(limit=0) == []
    assert build_demo_rows(limit=10_000) == demo_rows
    with pytest.raises(ValueError):
        build_demo_rows(limit=-1)


def test_explicit_data_dir(tmp_path: Path, demo_rows: list[dict]) -> None:
    copy = tmp_path / "data"
    shutil.copytree(DEFAULT_DATA_DIR, copy)
    assert build_demo_rows(copy) == demo_rows
    assert build_demo_rows(str(copy), limit=3) == demo_rows[:3]


def test_missing_data_dir_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for call in (
        lambda: load_tasks(missing),
        lambda: load_rows("reviews", missing),
        lambda: build_demo_rows(missing),
    ):
        with pytest.raises(FileNotFoundError, match="nowhere") as info:
            call()
        assert "data_dir" in str(info.value)


def test_missing_data_file_raises(tmp_path: Path) -> None:
    (tmp_path / "tasks.json").write_text((DEFAULT_DATA_DIR / "tasks.json").read_text())
    with pytest.raises(FileNotFoundError, match="reviews.jsonl"):
        build_demo_rows(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tasks.json"):
        load_tasks(empty)
    with pytest.raises(ValueError):
        load_rows("../tasks", DEFAULT_DATA_DIR)


def test_template_missing_field_is_reported(tmp_path: Path) -> None:
    entries = json.loads((DEFAULT_DATA_DIR / "tasks.json").read_text())
    entries = [dict(entries[0], template="Review: {body}\nSentiment:")]
    (tmp_path / "tasks.json").write_text(json.dumps(entries))
    shutil.copy(DEFAULT_DATA_DIR / "reviews.jsonl", tmp_path / "reviews.jsonl")
    with pytest.raises(ValueError, match="body"):
        build_demo_rows(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("positive", "positive"),
        (" Positive", "positive"),
        ("NEGATIVE.", "negative"),
        ("Sentiment: neutral\n", "neutral"),
        ("The label is: negative, not positive", "negative"),
        ("positive or negative? negative", "positive"),
        ("non-negative", None),
        ("negatively", None),
        ("I think it's unpositive", None),
        ("", None),
        ("no idea", None),
        ("**neutral**", "neutral"),
        ("'positive'", "positive"),
    ],
)
def test_parse_label_sentiment(text: str, expected: str | None) -> None:
    assert parse_label(text, ["positive", "negative", "neutral"]) == expected


def test_parse_label_word_boundaries_and_spelling() -> None:
    urgency = ["high", "medium", "low"]
    assert parse_label("lower priority", urgency) is None
    assert parse_label("below average; low", urgency) == "low"
    assert parse_label("highly urgent", urgency) is None
    assert parse_label("High", urgency) == "high"
    routing = ["billing", "account", "shipping", "technical", "other"]
    assert parse_label("another one", routing) is None
    assert parse_label("Team: Technical\nother", routing) == "technical"
    # Labels come back spelled as given, and the longer wins at the same start.
    assert parse_label("GOOD", ["Good"]) == "Good"
    assert parse_label("high priority", ["high", "high priority"]) == "high priority"
    assert parse_label("anything", []) is None


def test_gold_labels_follow_the_row_fields(demo_rows: list[dict]) -> None:
    reviews = {row["id"]: row for row in load_rows("reviews")}
    sentiment = [row for row in demo_rows if row["task"] == "review-sentiment"]
    category = [row for row in demo_rows if row["task"] == "review-category"]
    tickets = [row for row in demo_rows if row["task"].startswith("ticket-")]
    for row in sentiment:
        rating = reviews[row["id"]]["rating"]
        assert row["gold"] == {5: "positive", 4: "positive", 3: "neutral"}.get(rating, "negative")
    assert all(row["gold"] == reviews[row["id"]]["category"] for row in category)
    assert all(row["gold"] is None for row in tickets)


# -- the demo job: constrained to each row's task labels ------------------------------------
@pytest.fixture(scope="module")
def long_context_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its context raised to fit the few-shot demo prompts."""
    model_dir = tmp_path_factory.mktemp("demo-model") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        settings = json.loads((model_dir / name).read_text())
        settings[key] = 4096
        (model_dir / name).write_text(json.dumps(settings))
    return model_dir


def test_demo_classify_names_a_label_on_every_engine(long_context_model_dir: Path) -> None:
    """Even a random model names a label with choices; Dask runs one call (each row's
    labels from a column) and puts the results back in row order, the same texts as one
    local call."""
    pytest.importorskip("dask.dataframe")
    from llm_operator import LLMOperator
    from llm_operator.cli.demo import classify

    rows = build_demo_rows(limit=8)
    model = str(long_context_model_dir)
    op = LLMOperator(model, progress=False)
    common = dict(op=op, model=model, options={"progress": False}, partitions=2)
    local = classify(rows, engine="local", **common)
    dask = classify(rows, engine="dask", **common)
    assert len({row["task"] for row in rows}) > 1  # several tasks, several label sets
    for run in (local, dask):
        assert [r.finish_reason for r in run.results] == ["stop"] * len(rows)
        assert [r.text for r in run.results] == run.labels
        assert all(label in row["labels"] for label, row in zip(run.labels, rows))
    assert dask.labels == local.labels
    assert local.stats.rows == len(rows) and dask.stats is None
    free = classify(rows, engine="local", choices=False, **common)
    assert all(r.finish_reason in ("stop", "length") for r in free.results)


def test_demo_compare_static_runs_hf_generate_beside_the_local_engine(
    long_context_model_dir: Path, tmp_path: Path, capsys
) -> None:
    """``demo --engine local --compare-free --compare-static`` on the tiny model: both runs'
    lines, the records with the free outputs, and plain HF generate on fixed batches."""
    from llm_operator.cli import main

    output = tmp_path / "demo.jsonl"
    argv = ["demo", "--model", str(long_context_model_dir), "--limit", "6", "--engine", "local"]
    argv += ["--output", str(output), "--compare-free", "--compare-static", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "free generation: 6 rows in" in printed and "with choices: 6 rows in" in printed
    assert "side by side, free generation (same rows, batch size" in printed
    assert "hf-static (generate)" in printed
    assert re.search(r"speed-up [\d.]+x; identical outputs \d/6; static real prompt", printed)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 6 and all("free_output" in record for record in records)


@pytest.mark.slow
def test_demo_with_choices_names_a_label_on_every_row(tmp_path: Path, capsys) -> None:
    """``llm-operator demo`` on SmolLM2: every answer is one of its task's labels; the free
    run (``--compare-free``) sits beside it."""
    from llm_operator.cli import main

    output = tmp_path / "demo.jsonl"
    argv = ["demo", "--limit", "8", "--engine", "local", "--output", str(output)]
    assert main([*argv, "--compare-free", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "with choices: 8 rows in" in printed and "8/8 outputs name a label" in printed
    assert "free: name a label" in printed and "choices: agree" in printed
    records = [json.loads(line) for line in output.read_text().splitlines()]
    rows = build_demo_rows(limit=8)
    assert [r["id"] for r in records] == [row["id"] for row in rows]
    for record, row in zip(records, rows):
        assert record["output"] == record["label"] and record["label"] in row["labels"]
        assert record["finish_reason"] == "stop" and record["error"] is None
        assert record["free_label"] == parse_label(record["free_output"], row["labels"])


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_compare_static_gets_hugging_face_s_model_from_either_backend(tiny_llama_dir, backend):
    """``demo --compare-static`` runs HF generate: the hf backend's own model, or for the
    native engine (whose forward has no ``generate``) the checkpoint loaded by HF, whose
    greedy tokens are the native engine's."""
    import torch

    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.cli.demo import _hf_model

    op = LLMOperator(tiny_llama_dir, backend=backend)
    model = _hf_model(op)
    assert hasattr(model, "generate") and not model.training
    assert next(model.parameters()).dtype == torch.float32
    if backend == "hf":
        assert model is op.backend().model
    prompt = "The weather today"
    [want] = op.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    ids = torch.tensor([op.tokenizer(prompt)["input_ids"]])
    got = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert got[0, ids.shape[1] :].tolist() == list(want.token_ids)
