"""The llm-operator command: run, plan, and their errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import hf_generate_greedy

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
    # the null text makes that row an error; the others ran
    assert rows[2]["out_finish_reason"] == "error" and rows[2]["out_error"] == "prompt is null"
    op = LLMOperator(tiny_llama_dir)
    for r in (rows[0], rows[1], rows[4]):
        ids = op.tokenizer(template.format(text=r["text"]))["input_ids"]
        expected = hf_generate_greedy(tiny_llama_dir, ids, 5)
        assert r["out"] == op.tokenizer.decode(expected, skip_special_tokens=True)
        assert r["out_completion_tokens"] == len(expected)
    assert rows[0]["out"] == rows[3]["out"]
    assert "5 rows (1 errors)" in capsys.readouterr().out


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
    assert stats["rows"] == 4  # the null row is left out
    assert stats["requests"] == 3  # two identical rows merged
    assert stats["prefill_tokens"] < stats["prompt_tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-col", "missing"], "prompt column 'missing' is not in the table"),
        (["--template", "Review: {nope}"], "template fields ['nope']"),
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
    from llm_operator.results import GenerationResult
    from llm_operator.tables import add_result_columns

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
    assert outputs[engine][2]["out_finish_reason"] == "error"


def test_bench_help_lists_every_workload_and_system(capsys):
    from llm_operator.bench.systems import SYSTEMS
    from llm_operator.bench.workloads import WORKLOAD_NAMES

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name in [*WORKLOAD_NAMES, *SYSTEMS]:
        # each name starts a line of its own, followed by its description
        entry = [line for line in lines if line.split()[:1] == [name]]
        assert len(entry) == 1, name
        assert len(entry[0].split()) > 1, name
