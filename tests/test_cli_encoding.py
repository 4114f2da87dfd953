"""Input files that are not UTF-8: --encoding, and errors that name the byte and the fix."""

from __future__ import annotations

import json

import pytest
from helpers import chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.cli import main

TEXTS = ["Café au lait, très bon.", "Plain ASCII review.", "Crème brûlée was cold."]


@pytest.fixture()
def latin1_csv(tmp_path):
    """Two of three rows hold Latin-1 bytes that are not UTF-8 (é = 0xE9)."""
    path = tmp_path / "reviews.csv"
    lines = ["id,text"] + [f'{i},"{t}"' for i, t in enumerate(TEXTS)]
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    return path


def _run(source, out, model, *extra) -> int:
    argv = ["run", str(source), "--output", str(out), "--model", str(model)]
    return main([*argv, "--max-tokens", "3", "--no-progress", *extra])


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_encoding_reads_latin1_and_equals_the_utf8_file(latin1_csv, tiny_llama_dir, tmp_path):
    utf8 = tmp_path / "utf8.csv"
    utf8.write_text(latin1_csv.read_bytes().decode("latin-1"), encoding="utf-8")
    out_latin, out_utf8 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    template = ["--template", "Review: {text}\nSentiment:"]
    assert _run(latin1_csv, out_latin, tiny_llama_dir, *template, "--encoding", "latin-1") == 0
    assert _run(utf8, out_utf8, tiny_llama_dir, *template) == 0
    latin, reference = _rows(out_latin), _rows(out_utf8)
    assert [r["text"] for r in latin] == TEXTS
    assert [r["out"] for r in latin] == [r["out"] for r in reference]
    assert all(r["out_error"] is None for r in latin)
    prompts = [f"Review: {t}\nSentiment:" for t in TEXTS]
    operator = LLMOperator(str(tiny_llama_dir))
    expected = operator.generate(chat_wrapped(prompts), SamplingParams(max_tokens=3))
    assert [r["out"] for r in latin] == [x.text for x in expected]


def test_template_over_bytes_that_are_not_utf8_names_row_offset_and_encoding(
    latin1_csv, tiny_llama_dir, tmp_path, capsys
):
    out = tmp_path / "o.jsonl"
    assert _run(latin1_csv, out, tiny_llama_dir, "--template", "Review: {text}") == 2
    err = capsys.readouterr().err
    # row 0 "Café": C a f then 0xE9 at byte 3
    assert "column 'text', row 0, holds byte 0xE9 at byte 3" in err
    assert "--encoding latin-1" in err
    assert not out.exists()


def test_prompt_col_keeps_utf8_rows_and_names_the_byte_of_the_others(
    latin1_csv, tiny_llama_dir, tmp_path
):
    out = tmp_path / "o.jsonl"
    assert _run(latin1_csv, out, tiny_llama_dir, "--prompt-col", "text") == 0
    rows = _rows(out)
    assert [r["out_finish_reason"] == "error" for r in rows] == [True, False, True]
    assert "byte 0xE9 at byte 3" in rows[0]["out_error"]
    assert "--encoding" in rows[0]["out_error"]
    operator = LLMOperator(str(tiny_llama_dir))
    (expected,) = operator.generate(chat_wrapped([TEXTS[1]]), SamplingParams(max_tokens=3))
    assert rows[1]["out"] == expected.text


def test_encoding_is_checked(latin1_csv, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert (
        _run(latin1_csv, out, tiny_llama_dir, "--prompt-col", "text", "--encoding", "klingon") == 2
    )
    assert "unknown encoding 'klingon'" in capsys.readouterr().err
    parquet = tmp_path / "t.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), parquet)
    assert _run(parquet, out, tiny_llama_dir, "--prompt-col", "text", "--encoding", "latin-1") == 2
    assert "Parquet text is UTF-8" in capsys.readouterr().err


def test_jsonl_with_an_encoding(tiny_llama_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in TEXTS]
    source.write_bytes(("\n".join(lines) + "\n").encode("cp1252"))
    out = tmp_path / "o.jsonl"
    assert _run(source, out, tiny_llama_dir, "--prompt-col", "text", "--encoding", "cp1252") == 0
    assert [r["text"] for r in _rows(out)] == TEXTS
