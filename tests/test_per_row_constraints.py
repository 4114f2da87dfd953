"""Per-row constraints from a column (choices_col, regex_col, json_schema_col): Spark, Dask
and the CLI equal LLMOperator.generate with the per-row SamplingParams list; bad values are
error rows naming the column; option conflicts are refused before any work."""

from __future__ import annotations

import json

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.cli.main import main
from llm_operator.integrations import dask as llm_dask
from llm_operator.integrations.infer_options import make_options, row_sampling

MAX_TOKENS = 12
SENTIMENT = ["positive", "negative", "neutral"]
TOPIC = ["battery", "shipping", "price", "screen"]
YES_NO = ["yes", "no"]
REVIEWS = (
    "The battery lasts two full days.",
    "Shipping took 12 days and the box arrived crushed.",
    "Great value for the price, would buy again.",
    "The screen has a dead pixel in the top right corner.",
)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["red", "blue"]}},
    "required": ["ok", "label"],
    "additionalProperties": False,
}


def task_rows() -> tuple[list[str], list]:
    """Three tasks over the reviews (prompt, labels), one unconstrained row per review."""
    prompts, labels = [], []
    for review in REVIEWS:
        for task, choices in (("Sentiment", SENTIMENT), ("Topic", TOPIC), ("Useful?", YES_NO)):
            prompts.append(f"{task} of this review.\nReview: {review}\nAnswer:")
            labels.append(choices)
        prompts.append(f"Summarize: {review}")
        labels.append(None)
    return prompts, labels


def reference(model_dir, prompts, params: list[SamplingParams]):
    return LLMOperator(str(model_dir)).generate(chat_wrapped(prompts), params)


def per_row(base: SamplingParams, kind: str, values) -> list[SamplingParams]:
    return [base if v is None else SamplingParams(**{**_fields(base), kind: v}) for v in values]


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params)}


def assert_same(got: list[dict], want) -> None:
    assert len(got) == len(want)
    for row, (g, w) in enumerate(zip(got, want)):
        assert g["text"] == w.text, row
        assert g["finish_reason"] == w.finish_reason, row
        assert g["completion_tokens"] == w.completion_tokens, row
        assert g["error"] == w.error, row


# -- options and per-row values (no model) -----------------------------------------------
@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"choices": ["a", "b"], "choices_col": "labels"}, "choices and choices_col"),
        ({"regex": "[a-z]+", "choices_col": "labels"}, "regex and choices_col"),
        ({"choices_col": "labels", "json_schema_col": "schema"}, "choices_col and json_schema_col"),
    ],
)
def test_two_constraints_per_call_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=f"at most one of .*; got {named}"):
        make_options(model="/some/model", **kwargs)
    ddf = dd.from_pandas(pd.DataFrame({"p": ["x"], "labels": [["a"]]}), npartitions=1)
    with pytest.raises(ValueError, match=named):
        llm_dask.llm_infer(ddf, "p", model="/some/model", **kwargs)
    with pytest.raises(TypeError, match="choices_col must be a column name"):
        make_options(model="/some/model", choices_col=3)
    with pytest.raises(ValueError, match="choices_col='nope' is not a column of ddf"):
        llm_dask.llm_infer(ddf, "p", model="/some/model", choices_col="nope")


def test_row_sampling_checks_each_value_and_shares_equal_ones():
    options = make_options(model="/m", max_tokens=5, logprobs=True, choices_col="labels")
    values = [
        ["a", "b"],
        ("a", "b"),
        np.array(["a", "b"], dtype=object),
        '["a", "b"]',
        "a, b",
        None,
        [],
        ["a", "a"],
        '["a", ',
        7,
        ["a", ""],
    ]
    rows = row_sampling(options, values)
    first = rows[0]
    assert first.choices == ("a", "b") and first.max_tokens == 5 and first.logprobs
    assert all(row is first for row in rows[1:5])  # equal labels: one SamplingParams
    assert rows[5] is options.sampling  # null: the call's own, unconstrained
    messages = rows[6:]
    assert all(isinstance(m, str) and m.startswith("choices_col 'labels': ") for m in messages)
    assert "at least one" in messages[0]
    assert "duplicates: ['a']" in messages[1]
    assert "not a JSON list" in messages[2]
    assert "list of strings, got 7" in messages[3]
    assert "non-empty strings" in messages[4]

    regex = row_sampling(make_options(model="/m", regex_col="r"), ["[0-9]+", "(", 5])
    assert regex[0].regex == "[0-9]+"
    assert regex[1].startswith("regex_col 'r': ") and regex[2].startswith("regex_col 'r': ")
    schema = row_sampling(
        make_options(model="/m", json_schema_col="s"), [SCHEMA, json.dumps(SCHEMA), "{", "[1]"]
    )
    assert schema[0].json_schema == schema[1].json_schema == json.dumps(SCHEMA)
    assert "not valid JSON" in schema[2] and schema[3].startswith("json_schema_col 's': ")


# -- Dask ---------------------------------------------------------------------------------
def test_dask_choices_col_equals_the_operator_with_per_row_params(tiny_llama_dir):
    prompts, labels = task_rows()
    bad = {1: [], 2: ["yes", "yes"]}  # rows whose labels are no valid constraint
    cells = [bad.get(i, value) for i, value in enumerate(labels)]
    cells[4] = tuple(cells[4])  # any sequence of strings
    cells[5] = np.array(cells[5], dtype=object)
    frame = pd.DataFrame({"prompt": prompts, "labels": pd.Series(cells, dtype=object)})
    with dask.config.set({"dataframe.convert-string": False}):
        ddf = dd.from_pandas(frame, npartitions=3)
        out = llm_dask.llm_infer(
            ddf, "prompt", model=str(tiny_llama_dir), max_tokens=MAX_TOKENS, choices_col="labels"
        )
        computed = out.compute(scheduler="sync")
    base = SamplingParams(max_tokens=MAX_TOKENS)
    good = [None if i in bad else v for i, v in enumerate(labels)]
    want = reference(tiny_llama_dir, prompts, per_row(base, "choices", good))
    got = [
        {
            "text": r["out"],
            "finish_reason": r["out_finish_reason"],
            "completion_tokens": r["out_completion_tokens"],
            "error": r["out_error"] if isinstance(r["out_error"], str) else None,
        }
        for r in computed.to_dict("records")
    ]
    for i in bad:  # error rows name the column and the problem
        assert got[i]["finish_reason"] == "error" and got[i]["text"] == ""
        assert got[i]["error"].startswith("choices_col 'labels': ")
    assert "at least one" in got[1]["error"] and "duplicates" in got[2]["error"]
    keep = [i for i in range(len(prompts)) if i not in bad]
    assert_same([got[i] for i in keep], [want[i] for i in keep])
    for i in keep:  # the constraint held: each constrained row is one of its labels
        if labels[i] is not None:
            assert got[i]["text"] in labels[i]
    assert len({tuple(v) for v in labels if v is not None}) == 3  # three tasks, one call


def test_dask_regex_and_json_schema_cols_with_dedupe(tiny_llama_dir):
    """One prompt under several constraints: dedupe keeps (prompt, constraint) pairs apart;
    json_schema_col gives parsed values on the rows given a schema."""
    prompt = "Describe the review.\nReview: " + REVIEWS[0]
    schemas = [SCHEMA, json.dumps(SCHEMA), None, {"type": "object", "properties": {"n": {}}}]
    schemas += ["{not json"]
    regexes = ["[0-9]{3}", "[a-z]{4}", None, "[0-9]{3}", "("]
    frame = pd.DataFrame(
        {
            "prompt": [prompt] * 5,
            "schema": pd.Series(schemas, dtype=object),
            "regex": pd.Series(regexes, dtype=object),
        }
    )
    with dask.config.set({"dataframe.convert-string": False}):
        ddf = dd.from_pandas(frame, npartitions=1)
        common = dict(model=str(tiny_llama_dir), dedupe=True, max_tokens=40)
        by_regex = llm_dask.llm_infer(ddf, "prompt", regex_col="regex", **common)
        by_schema = llm_dask.llm_infer(ddf, "prompt", json_schema_col="schema", **common)
        by_regex, by_schema = dask.compute(by_regex, by_schema, scheduler="sync")
    base = SamplingParams(max_tokens=40)
    want = reference(tiny_llama_dir, [prompt] * 4, per_row(base, "regex", regexes[:4]))
    got = by_regex.to_dict("records")
    assert [r["out"] for r in got[:4]] == [w.text for w in want]
    assert got[0]["out"] == got[3]["out"] and got[0]["out"] != got[1]["out"]
    assert got[4]["out_finish_reason"] == "error"
    assert got[4]["out_error"].startswith("regex_col 'regex': ")
    want = reference(tiny_llama_dir, [prompt] * 4, per_row(base, "json_schema", schemas[:4]))
    got = by_schema.to_dict("records")
    assert [r["out"] for r in got[:4]] == [w.text for w in want]
    for row in (0, 1, 3):
        if got[row]["out_finish_reason"] == "stop":
            assert got[row]["out_value"] == json.loads(got[row]["out"])
    assert got[2]["out_value"] is None  # unconstrained: free text, not parsed
    assert not isinstance(got[2]["out_error"], str)
    assert "not valid JSON" in got[4]["out_error"] and got[4]["out_value"] is None


# -- Spark --------------------------------------------------------------------------------
def test_spark_choices_and_json_schema_cols_equal_the_operator(spark, tiny_llama_dir):
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import RESULT_TYPE, llm_infer, llm_infer_df

    prompts, labels = task_rows()
    labels[3] = ["a", "a"]  # was None: a bad row
    schemas = [json.dumps(SCHEMA) if i % 3 == 0 else None for i in range(len(prompts))]
    schemas[1] = '{"type": "object", "properties": '  # bad
    rows = list(zip(range(len(prompts)), prompts, labels, schemas))
    df = spark.createDataFrame(
        rows, "id int, prompt string, labels array<string>, schema string"
    ).repartition(2, "id")
    model = str(tiny_llama_dir)
    out = llm_infer_df(df, "prompt", model=model, max_tokens=MAX_TOKENS, choices_col="labels")
    out = out.withColumn(
        "json", llm_infer("prompt", model=model, max_tokens=40, json_schema_col="schema")
    )
    assert out.schema["json"].dataType == RESULT_TYPE  # no typed value: types differ per row
    collected = sorted(out.select("id", "out", "json").collect(), key=lambda r: r["id"])
    base = SamplingParams(max_tokens=MAX_TOKENS)
    good = [None if i == 3 else v for i, v in enumerate(labels)]
    want = reference(tiny_llama_dir, prompts, per_row(base, "choices", good))
    got = [r["out"].asDict() for r in collected]
    assert got[3]["finish_reason"] == "error"
    assert got[3]["error"] == "choices_col 'labels': choices has duplicates: ['a']"
    keep = [i for i in range(len(prompts)) if i != 3]
    assert_same([got[i] for i in keep], [want[i] for i in keep])
    base = SamplingParams(max_tokens=40)
    good = [None if i == 1 else v for i, v in enumerate(schemas)]
    want = reference(tiny_llama_dir, prompts, per_row(base, "json_schema", good))
    got = [r["json"].asDict() for r in collected]
    assert got[1]["finish_reason"] == "error"
    assert got[1]["error"].startswith("json_schema_col 'schema': json_schema is not valid JSON")
    assert_same(
        [got[i] for i in range(len(prompts)) if i != 1], [w for i, w in enumerate(want) if i != 1]
    )
    with pytest.raises(TypeError, match="regex_col='id' must be a column of string"):
        llm_infer_df(df, "prompt", model=model, regex_col="id")
    with pytest.raises(ValueError, match="choices and choices_col"):
        llm_infer("prompt", model=model, choices=YES_NO, choices_col="labels")
    assert df.select(F.col("labels")).count() == len(prompts)


# -- the CLI ------------------------------------------------------------------------------
def test_cli_choices_col_from_csv_text_cells(tiny_llama_dir, tmp_path):
    """A CSV cell holds a JSON list or comma-separated labels; an empty cell is null."""
    prompts, labels = task_rows()
    cells = []
    for i, value in enumerate(labels):
        if value is None:
            cells.append("")
        elif i % 2:
            cells.append(json.dumps(value))
        else:
            cells.append(", ".join(value))
    cells[1] = "[]"  # a bad row
    source = tmp_path / "tasks.csv"
    pd.DataFrame({"prompt": prompts, "labels": cells}).to_csv(source, index=False)
    out = tmp_path / "out.jsonl"
    argv = ["run", str(source), "--prompt-col", "prompt", "--choices-col", "labels"]
    argv += ["--output", str(out), "--model", str(tiny_llama_dir), "--no-progress"]
    assert main([*argv, "--max-tokens", str(MAX_TOKENS), "--dedupe"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    good = [None if i == 1 else v for i, v in enumerate(labels)]
    want = reference(
        tiny_llama_dir, prompts, per_row(SamplingParams(max_tokens=MAX_TOKENS), "choices", good)
    )
    records = [
        {
            "text": r["out"],
            "finish_reason": r["out_finish_reason"],
            "completion_tokens": r["out_completion_tokens"],
            "error": r["out_error"],
        }
        for r in got
    ]
    assert records[1]["finish_reason"] == "error"
    assert records[1]["error"].startswith("choices_col 'labels': ")
    keep = [i for i in range(len(prompts)) if i != 1]
    assert_same([records[i] for i in keep], [want[i] for i in keep])


@pytest.mark.parametrize("engine", ["dask", "spark"])
def test_cli_choices_col_on_spark_and_dask_equals_local(engine, tiny_llama_dir, tmp_path, request):
    if engine == "spark":
        request.getfixturevalue("spark")  # share the suite's session
    prompts, labels = task_rows()
    labels[2] = ["no", "no"]  # a bad row
    source = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"prompt": prompts, "labels": labels}), source)
    outputs = {}
    for run in ("local", engine):
        out = tmp_path / f"{run}.jsonl"
        argv = ["run", str(source), "--prompt-col", "prompt", "--choices-col", "labels"]
        argv += ["--output", str(out), "--model", str(tiny_llama_dir), "--no-progress"]
        argv += ["--engine", run, "--max-tokens", str(MAX_TOKENS), "--logprobs"]
        assert main(argv) == 0
        outputs[run] = [json.loads(line) for line in out.read_text().splitlines()]
    local, other = outputs["local"], outputs[engine]
    assert [r["out"] for r in other] == [r["out"] for r in local]
    assert [r["out_error"] for r in other] == [r["out_error"] for r in local]
    assert local[2]["out_error"] == "choices_col 'labels': choices has duplicates: ['no']"
    assert "out_choice_logprobs" in local[0]
    for row, value in zip(local, labels):
        if value is not None and len(set(value)) == len(value):
            assert row["out"] in value and set(json.loads(row["out_choice_logprobs"])) == set(value)


def test_cli_refuses_two_constraints_and_a_missing_column(tiny_llama_dir, tmp_path, capsys):
    source = tmp_path / "t.csv"
    pd.DataFrame({"prompt": ["a"], "labels": ["x,y"]}).to_csv(source, index=False)
    argv = ["run", str(source), "--prompt-col", "prompt", "--output", str(tmp_path / "o.csv")]
    argv += ["--model", str(tiny_llama_dir)]
    assert main([*argv, "--choices-col", "labels", "--choices", "x,y"]) == 2
    assert "--choices and --choices-col" in capsys.readouterr().err
    assert main([*argv, "--regex-col", "nope"]) == 2
    assert "--regex-col 'nope' is not a column of the input" in capsys.readouterr().err
