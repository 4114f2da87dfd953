"""The llm-operator command: run, plan, and their errors."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import chat_wrapped, hf_generate_greedy

from llm_operator import LLMOperator
from llm_operator.cli import main

SYSTEM = "Classify the sentiment as positive, negative or neutral.\n"


@pytest.fixture()
def reviews_csv(tmp_path):
    """A Parquet table (despite the name, any format works) with a null text in row 2."""
    path = tmp_path / "reviews.parquet"
    texts = [
        "Great value for the price.",
        "The box arrived crushed.",
        None,
        "Great value for the price.",
        "Works fine.",
    ]
    pq.write_table(pa.table({"id": list(range(5)), "text": texts}), path)
    return path


def test_run_template_writes_outputs_in_order(tiny_llama_dir, reviews_csv, tmp_path, capsys):
    out = tmp_path / "out.parquet"
    template = SYSTEM + "Review: {text}\nSentiment:"
    code = main(
        [
            "run",
            str(reviews_csv),
            "--template",
            template,
            "--output",
            str(out),
            "--model",
            str(tiny_llama_dir),
            "--max-tokens",
            "5",
            "--no-progress",
        ]
    )
    assert code == 0
    table = pq.read_table(out)
    assert table.column_names == [
        "id",
        "text",
        "out",
        "out_finish_reason",
        "out_prompt_tokens",
        "out_completion_tokens",
        "out_error",
    ]
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]
    # a null field renders as the empty value (the label stays): that row runs too
    assert all(r["out_error"] is None for r in rows)
    op = LLMOperator(tiny_llama_dir)
    for r in (rows[0], rows[1], rows[2], rows[4]):
        ids = op.tokenize(chat_wrapped([template.format(text=r["text"] or "")]))[0]
        expected = hf_generate_greedy(tiny_llama_dir, ids, 5)
        assert r["out"] == op.tokenizer.decode(expected, skip_special_tokens=True)
        assert r["out_completion_tokens"] == len(expected)
    assert rows[0]["out"] == rows[3]["out"]
    assert "5 rows (0 errors)" in capsys.readouterr().out


def test_run_prompt_column_jsonl_chat(tiny_llama_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps({"q": q}) for q in ["Why?", "Is it good?"]) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "run",
            str(source),
            "--prompt-col",
            "q",
            "--system",
            "Answer briefly.",
            "--output",
            str(out),
            "--output-col",
            "answer",
            "--model",
            str(tiny_llama_dir),
            "--max-tokens",
            "3",
            "--no-progress",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["q"] for r in rows] == ["Why?", "Is it good?"]
    assert all(r["answer_finish_reason"] in ("stop", "length") for r in rows)
    # the chat template wrapped the prompt: more prompt tokens than the bare question
    assert all(r["answer_prompt_tokens"] > 8 for r in rows)


def test_plan_prints_the_report_without_the_model(tiny_llama_dir, reviews_csv, capsys):
    code = main(
        [
            "plan",
            str(reviews_csv),
            "--template",
            SYSTEM + "Review: {text}",
            "--model",
            str(tiny_llama_dir),
            "--json",
        ]
    )
    assert code == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows"] == 5  # the null text renders as the empty value: a row like others
    assert stats["requests"] == 4  # two identical rows merged
    assert stats["prefill_tokens"] < stats["prompt_tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-col", "missing"], "prompt column 'missing' is not in the table"),
        (["--prompt-col", "id"], "prompt column 'id' holds int64 values, not text"),
        (["--template", "Review: {nope}"], "the prompt names column(s) ['nope']"),
        (["--columns", "text,nope"], "the prompt names column(s) ['nope']"),
        (["--columns", ""], "column names"),
        ([], "give --prompt-col, or build prompts with --template or --columns"),
        (
            ["--prompt-col", "text", "--template", "{text}"],
            "give --prompt-col or --template, not both",
        ),
        (["--prompt-col", "text", "--columns", "text"], "give --prompt-col or --columns, not both"),
        (["--template", '{"a": 1} {text}'], "write a literal brace as {{ or }}"),
        (["--template", "{text}", "--reorder-fields"], "no movable lines"),
    ],
)
def test_run_errors_name_the_problem(tiny_llama_dir, reviews_csv, tmp_path, capsys, args, message):
    code = main(
        [
            "run",
            str(reviews_csv),
            *args,
            "--output",
            str(tmp_path / "o.parquet"),
            "--model",
            str(tiny_llama_dir),
            "--no-progress",
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err


def test_run_refuses_unknown_formats_and_missing_files(
    tiny_llama_dir, reviews_csv, tmp_path, capsys
):
    assert (
        main(
            [
                "run",
                str(reviews_csv),
                "--prompt-col",
                "text",
                "--output",
                str(tmp_path / "o.xlsx"),
                "--model",
                str(tiny_llama_dir),
            ]
        )
        == 2
    )
    assert "cannot tell the format" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                str(tmp_path / "nope.csv"),
                "--prompt-col",
                "text",
                "--model",
                str(tiny_llama_dir),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_add_result_columns_refuses_to_overwrite():
    from llm_operator.cli.tables import add_result_columns
    from llm_operator.results import GenerationResult

    table = pa.table({"out": ["x"]})
    with pytest.raises(ValueError, match="already exists"):
        add_result_columns(table, [GenerationResult("a", (1,), "stop", 1, 1)], "out")


@pytest.mark.parametrize("engine", ["dask", "spark"])
def test_run_on_spark_and_dask_equals_local(engine, tiny_llama_dir, reviews_csv, tmp_path, request):
    if engine == "spark":
        request.getfixturevalue("spark")  # share the suite's session
    template = SYSTEM + "Review: {text}\nSentiment:"
    outputs = {}
    for name in ("local", engine):
        out = tmp_path / f"{name}.jsonl"
        code = main(
            [
                "run",
                str(reviews_csv),
                "--template",
                template,
                "--output",
                str(out),
                "--model",
                str(tiny_llama_dir),
                "--max-tokens",
                "4",
                "--no-progress",
                "--engine",
                name,
            ]
        )
        assert code == 0
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in outputs[engine]] == [0, 1, 2, 3, 4]
    for key in ("out", "out_finish_reason", "out_completion_tokens", "out_error"):
        assert [r[key] for r in outputs[engine]] == [r[key] for r in outputs["local"]], key
    assert outputs[engine][2]["out_error"] is None  # the null text rendered as the empty value


def test_bench_help_lists_every_workload_and_system(capsys):
    from llm_operator_bench.core.systems import SYSTEMS
    from llm_operator_bench.core.workloads import WORKLOAD_NAMES

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name in [*WORKLOAD_NAMES, *SYSTEMS]:
        # each name starts a line of its own, followed by its description
        entry = [line for line in lines if line.split()[:1] == [name]]
        assert len(entry) == 1, name
        assert len(entry[0].split()) > 1, name


# -- constrained outputs: --choices, --regex, --json-schema FILE, --logprobs ---------------
CLOSED_SCHEMA = {  # a random tiny model completes it within a few dozen tokens
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["red", "blue"]}},
    "required": ["ok", "label"],
}
REGEX = r"(yes|no), [0-9]{2,3}"
LABELS = ("positive", "negative", "neutral")
BASE_COLUMNS = [
    "id",
    "text",
    "prompt",
    "out",
    "out_finish_reason",
    "out_prompt_tokens",
    "out_completion_tokens",
    "out_error",
]


def _run_constrained(engine: str, source, folder, model_dir) -> dict[str, list[dict]]:
    """The first 3 rows (row 2's text is null) under each constraint, on ``engine``."""
    schema_file = folder / "schema.json"
    schema_file.write_text(json.dumps(CLOSED_SCHEMA))
    runs = {
        "choices": ["--choices", "positive, negative,neutral", "--logprobs", "--max-tokens", "8"],
        "regex": ["--regex", REGEX, "--max-tokens", "24"],
        "json": ["--json-schema", str(schema_file), "--max-tokens", "60", "--logprobs"],
    }
    outputs = {}
    # prompts in a column, so that the null text stays a null prompt: an error row
    table = pq.read_table(source)
    prompts = [None if t is None else f"{SYSTEM}Review: {t}\nSentiment:" for t in
               table.column("text").to_pylist()]  # fmt: skip
    source = folder / f"{engine}-prompts.parquet"
    pq.write_table(table.append_column("prompt", pa.array(prompts, pa.string())), source)
    for name, flags in runs.items():
        out = folder / f"{engine}-{name}.jsonl"
        argv = ["run", str(source), "--prompt-col", "prompt"]
        argv += ["--limit", "3", "--output", str(out), "--model", str(model_dir)]
        argv += ["--no-progress", "--engine", engine, *flags]
        assert main(argv) == 0, (engine, name)
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    return outputs


@pytest.fixture(scope="module")
def constrained_local(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("constrained-local")
    source = folder / "reviews.parquet"
    texts = ["Great value for the price.", "The box arrived crushed.", None]
    pq.write_table(pa.table({"id": [0, 1, 2], "text": texts}), source)
    return _run_constrained("local", source, folder, tiny_llama_dir)


def test_constraint_flags_on_the_local_engine(constrained_local):
    choices, regex, schema = (constrained_local[k] for k in ("choices", "regex", "json"))
    # --choices with --logprobs: the label, its log-probability and every choice's (JSON text)
    assert list(choices[0]) == [*BASE_COLUMNS, "out_logprob", "out_choice_logprobs"]
    for row in choices[:2]:
        assert row["out"] in LABELS and row["out_finish_reason"] == "stop"
        assert row["out_logprob"] < 0
        scores = json.loads(row["out_choice_logprobs"])
        assert set(scores) == set(LABELS) and all(score < 0 for score in scores.values())
    assert choices[2]["out_finish_reason"] == "error" and choices[2]["out_logprob"] is None
    assert choices[2]["out_choice_logprobs"] is None
    # --regex: no scores asked, none written
    assert list(regex[0]) == BASE_COLUMNS
    assert all(re.fullmatch(REGEX, row["out"]) for row in regex[:2])
    # --json-schema FILE with --logprobs: JSON text, a log-probability, no choice scores
    assert list(schema[0]) == [*BASE_COLUMNS, "out_logprob"]
    for row in schema[:2]:
        value = json.loads(row["out"])
        assert isinstance(value["ok"], bool) and value["label"] in ("red", "blue")
        assert row["out_error"] is None and row["out_logprob"] < 0


def test_the_summary_counts_constrained_rows_cut_by_max_tokens(
    tiny_llama_dir, reviews_csv, tmp_path, capsys
):
    """Rows whose JSON was cut by max_tokens keep their text and say why in out_error; the
    summary must count them rather than report "0 errors"."""
    schema = (
        '{"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}'
    )
    out = tmp_path / "o.jsonl"
    argv = ["run", str(reviews_csv), "--prompt-col", "text", "--output", str(out), "--model",
            str(tiny_llama_dir), "--json-schema", schema, "--max-tokens", "2", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cut = [r for r in rows if r["out_finish_reason"] == "length" and r["out_error"]]
    assert len(cut) == 4  # every row but the null one
    summary = capsys.readouterr().out
    assert "5 rows (1 errors, 4 constrained outputs cut before they were valid" in summary
    assert "raise --max-tokens" in summary


@pytest.mark.parametrize("engine", ["dask", "spark"])
def test_constraint_flags_on_spark_and_dask_equal_local(
    engine, constrained_local, tiny_llama_dir, tmp_path, request
):
    if engine == "spark":
        request.getfixturevalue("spark")  # share the suite's session
    source = tmp_path / "reviews.parquet"
    texts = ["Great value for the price.", "The box arrived crushed.", None]
    pq.write_table(pa.table({"id": [0, 1, 2], "text": texts}), source)
    outputs = _run_constrained(engine, source, tmp_path, tiny_llama_dir)
    for name, rows in outputs.items():
        local = constrained_local[name]
        assert [list(row) for row in rows] == [list(row) for row in local], name
        for row, want in zip(rows, local):
            for key in ("id", "out", "out_finish_reason", "out_completion_tokens", "out_error"):
                assert row[key] == want[key], (name, key)
            if want.get("out_logprob") is not None:
                assert row["out_logprob"] == pytest.approx(want["out_logprob"], abs=1e-4)
            if want.get("out_choice_logprobs") is not None:
                got_scores = json.loads(row["out_choice_logprobs"])
                assert got_scores == pytest.approx(
                    json.loads(want["out_choice_logprobs"]), abs=1e-4
                )


def test_a_bad_constraint_flag_fails_before_any_work(tiny_llama_dir, reviews_csv, tmp_path, capsys):
    schema_file = tmp_path / "bad.json"
    schema_file.write_text('{"type": "objekt"}')
    for flags, message in (
        (["--json-schema", str(schema_file)], "json_schema"),
        (["--json-schema", str(tmp_path / "missing.json")], "nor a readable file"),
        (["--json-schema", '{"type": "objekt"}'], "json_schema"),
        (["--regex", "[0-9"], "regex"),
        (["--choices", "a,a"], "duplicates"),
        (["--choices", "a", "--regex", "a"], "at most one"),
    ):
        argv = ["run", str(reviews_csv), "--prompt-col", "text", "--model", str(tiny_llama_dir)]
        argv += ["--output", str(tmp_path / "o.jsonl"), *flags]
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse refuses an unreadable file itself
            code = exit_info.code
        assert code == 2, flags
        assert message in capsys.readouterr().err, flags
        assert not (tmp_path / "o.jsonl").exists()


def test_master_is_for_the_spark_engine_only(tiny_llama_dir, reviews_csv, tmp_path, capsys):
    """--master (a Spark master URL or sc://host:port; run on Spark Connect in
    test_spark_connect.py) is refused with another engine, before any work."""
    for engine in ("local", "dask"):
        argv = ["run", str(reviews_csv), "--prompt-col", "text", "--model", str(tiny_llama_dir)]
        argv += ["--output", str(tmp_path / "o.jsonl"), "--engine", engine]
        assert main([*argv, "--master", "local[2]"]) == 2
        err = capsys.readouterr().err
        assert f"--master is for --engine spark (got --engine {engine})" in err
        assert not (tmp_path / "o.jsonl").exists()


def test_plan_shows_the_prompt_as_the_model_sees_it(tiny_llama_dir, reviews_csv, capsys):
    """chat="auto" (the default) wraps each row as a user message of the chat template;
    --no-chat sends the raw text; plan prints row 0 either way, and --json holds it."""
    argv = [
        "plan",
        str(reviews_csv),
        "--template",
        "Review: {text}",
        "--model",
        str(tiny_llama_dir),
    ]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    expected = (
        "<|im_start|>user\nReview: Great value for the price.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert f"the prompt of row 0 as the model sees it:\n{expected}\n" in shown
    assert main([*argv, "--no-chat"]) == 0
    assert "as the model sees it:\nReview: Great value for the price.\n" in capsys.readouterr().out
    argv = ["plan", str(reviews_csv), "--prompt-col", "text", "--model", str(tiny_llama_dir)]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["example_prompt"] == expected.replace("Review: ", "")


def test_run_default_chat_equals_explicit_chat_and_differs_from_raw(
    tiny_llama_dir, reviews_csv, tmp_path
):
    outputs = {}
    for name, flags in (("auto", []), ("chat", ["--chat"]), ("raw", ["--no-chat"])):
        out = tmp_path / f"{name}.jsonl"
        argv = ["run", str(reviews_csv), "--prompt-col", "text", "--output", str(out)]
        code = main([*argv, "--model", str(tiny_llama_dir), "--max-tokens", "4", *flags])
        assert code == 0
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert outputs["auto"] == outputs["chat"]
    prompt_tokens = {k: [r["out_prompt_tokens"] for r in v] for k, v in outputs.items()}
    # the template adds its role markers around each (non-null) prompt
    assert all(
        c > r
        for c, r, row in zip(prompt_tokens["auto"], prompt_tokens["raw"], outputs["raw"])
        if row["out_error"] is None
    )
