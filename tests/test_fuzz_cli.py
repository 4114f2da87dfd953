"""Property-based tests of ``llm-operator run`` on generated CSV, JSONL and Parquet files.

Tables with odd column names and values (unicode, nulls, numbers, empty strings), files
with bad encodings, empty files, and prompt columns that are missing or misnamed.
Properties: the command either writes one output row per input row (every row whose
prompt cannot run an error row with a message), or exits 2 with a message naming what is
wrong; it never crashes with a traceback.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_operator.cli import main

settings.register_profile(
    "ci-cli", max_examples=15, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "long-cli", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck)
)
PROFILE = "long-cli" if os.environ.get("HYPOTHESIS_PROFILE") == "long" else "ci-cli"

# text a UTF-8 file can hold (no lone surrogates)
VALUE_TEXT = st.text(st.characters(codec="utf-8"), max_size=20)
VALUES = st.one_of(VALUE_TEXT, st.none(), st.integers(-5, 5), st.just(""))
COLUMN = st.text(st.characters(codec="utf-8", exclude_characters="\n\r\x00"), min_size=1,
                 max_size=8)  # fmt: skip


@st.composite
def tables(draw):
    names = draw(st.lists(COLUMN, min_size=1, max_size=3, unique=True))
    rows = draw(st.integers(0, 5))
    kind = draw(st.sampled_from(["text", "mixed"]))
    columns = {}
    for name in names:
        values = VALUE_TEXT if kind == "text" else VALUES
        columns[name] = draw(st.lists(values, min_size=rows, max_size=rows))
    return columns


def _write(columns: dict, path, fmt: str) -> None:
    if fmt == "jsonl":
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return
    # one type per column for Arrow: mixed values as text
    arrays = {
        name: pa.array([None if v is None else str(v) for v in values], type=pa.string())
        for name, values in columns.items()
    }
    table = pa.table(arrays)
    if fmt == "csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


@settings(settings.get_profile(PROFILE))
@given(
    columns=tables(),
    fmt=st.sampled_from(["csv", "jsonl", "parquet"]),
    pick=st.one_of(st.none(), st.integers(0, 2)),
)
def test_run_writes_every_row_or_says_what_is_wrong(
    model, tmp_path_factory, capsys, columns, fmt, pick
) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    source = folder / f"in.{fmt}"
    _write(columns, source, fmt)
    names = list(columns)
    prompt_col = names[pick] if pick is not None and pick < len(names) else "no such column"
    out = folder / "out.jsonl"
    argv = ["run", str(source), f"--prompt-col={prompt_col}", "--output", str(out)]
    argv += ["--model", model, "--max-tokens", "2", "--no-progress"]
    code = main(argv)
    captured = capsys.readouterr()
    if code == 2:
        assert "error:" in captured.err and captured.err.strip(), captured.err
        return
    assert code == 0, captured.err
    from llm_operator.cli.tables import read_table

    rows = read_table(source).num_rows  # as read (CSV readers skip blank lines)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == rows
    for row in written:
        if row["out_finish_reason"] == "error":
            assert row["out_error"], row
        else:
            assert row["out_finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"a,b\n1,2,3\n", "columns"),
    ],
)
def test_unreadable_csv_files_exit_2_with_the_reason(model, tmp_path, capsys, content, message):
    source = tmp_path / "in.csv"
    source.write_bytes(content)
    code = main(
        ["run", str(source), "--prompt-col", "prompt", "--output", str(tmp_path / "o.jsonl"),
         "--model", model, "--no-progress"]
    )  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err.lower()


def test_a_row_that_is_not_utf8_is_an_error_row_naming_the_encoding(model, tmp_path) -> None:
    source = tmp_path / "in.csv"
    source.write_bytes(b"prompt\n\xff\xfe bad bytes\n")
    out = tmp_path / "o.jsonl"
    argv = ["run", str(source), "--prompt-col", "prompt", "--output", str(out)]
    assert main([*argv, "--model", model, "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["out_finish_reason"] == "error" and "UTF-8" in row["out_error"]
