"""``llm-operator embed``: the input columns plus the vectors (Parquet:
``fixed_size_list<float>[d]``; JSONL: a list), each row's error, a summary line; the same
vectors on every engine as ``LLMOperator.embed``; clear errors for bad options."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_operator import LLMOperator
from llm_operator.cli import main

DOCUMENT = "The store ships orders every weekday and refunds unused items within a month. "
TEXTS = [
    DOCUMENT + "Chunk: shipping.",
    None,
    DOCUMENT + "Chunk: refunds.",
    "",
    "Instruct: find the policy\nQuery: refunds?",
    DOCUMENT + "Chunk: shipping.",
]
GOOD = [True, False, True, False, True, True]


@pytest.fixture()
def texts_parquet(tmp_path):
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), path)
    return path


def _embed(model, source, output, *extra) -> int:
    argv = ["embed", "--input", str(source), "--output", str(output), "--column", "text"]
    return main([*argv, "--model", str(model), "--no-progress", *extra])


def test_embed_writes_a_fixed_size_list_column(tiny_llama_dir, texts_parquet, tmp_path, capsys):
    out = tmp_path / "vectors.parquet"
    assert _embed(tiny_llama_dir, texts_parquet, out, "--dimensions", "16") == 0
    table = pq.read_table(out)
    assert table.column_names == ["id", "text", "embedding", "embedding_prompt_tokens", "embedding_error"]  # fmt: skip
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 16)
    reference = LLMOperator(tiny_llama_dir).embed(TEXTS, dimensions=16)
    assert table.column("embedding").to_pylist() == [r.embedding for r in reference]
    errors = table.column("embedding_error").to_pylist()
    assert [e is None for e in errors] == GOOD and "null" in errors[1] and "empty" in errors[3]
    line = capsys.readouterr().out
    assert "6 rows (2 errors, 16-dimensional vectors) on local" in line
    assert "prefilled (saving" in line and f"wrote {out}" in line


def test_embed_jsonl_options_pass_through(tiny_qwen3_dir, texts_parquet, tmp_path):
    out = tmp_path / "vectors.jsonl"
    extra = ["--pooling", "mean", "--no-normalize", "--output-col", "vec"]
    assert _embed(tiny_qwen3_dir, texts_parquet, out, *extra) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    reference = LLMOperator(tiny_qwen3_dir).embed(TEXTS, pooling="mean", normalize=False)
    assert [r["vec"] for r in rows] == [r.embedding for r in reference]
    assert [r["vec_error"] is None for r in rows] == GOOD
    assert [r["id"] for r in rows] == list(range(len(TEXTS)))


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_embed_on_spark_and_dask_equals_local(
    engine, spark, tiny_llama_dir, texts_parquet, tmp_path, capsys
):
    local, other = tmp_path / "local.parquet", tmp_path / f"{engine}.parquet"
    assert _embed(tiny_llama_dir, texts_parquet, local) == 0
    capsys.readouterr()
    assert _embed(tiny_llama_dir, texts_parquet, other, "--engine", engine) == 0
    line = capsys.readouterr().out
    assert f"6 rows (2 errors, 64-dimensional vectors) on {engine}" in line
    assert "co-location" in line
    assert pq.read_table(other).equals(pq.read_table(local))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pooling", "max"], "invalid choice: 'max'"),
        (["--dimensions", "0"], "expected an integer >= 1, got 0"),
        (["--dimensions", "4096"], "dimensions=4096 is more than the model's 64 values"),
        (["--max-tokens", "4"], "unrecognized arguments: --max-tokens"),
        (["--column", "id"], "--column 'id' holds int64 values, not text"),
        (["--column", "body"], "--column 'body' is not a column of the input"),
        (["--output-col", "id"], "output column 'id' already exists"),
        (["--master", "local[2]"], "--master is for --engine spark"),
    ],
)
def test_embed_errors_name_the_problem(
    tiny_llama_dir, texts_parquet, tmp_path, capsys, extra, message
):
    out = tmp_path / "vectors.parquet"
    try:
        code = _embed(tiny_llama_dir, texts_parquet, out, *extra)
    except SystemExit as exit_:  # argparse refuses it
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_embed_refuses_a_csv_output(tiny_llama_dir, texts_parquet, tmp_path, capsys):
    assert _embed(tiny_llama_dir, texts_parquet, tmp_path / "v.csv") == 2
    assert "CSV cannot hold vectors" in capsys.readouterr().err
