"""The run command's summary line: every row's prompt tokens, prefill computed and the
saving against them, the same with --dedupe, after a resume, and on Dask."""

from __future__ import annotations

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.cli import main

SYSTEM = "You label support tickets for the billing team. Classify the ticket below.\n"
TICKETS = [
    "I was charged twice this month.",
    "The invoice shows the wrong address.",
    "I was charged twice this month.",  # a duplicate
    "How do I cancel my plan?",
    "The invoice shows the wrong address.",  # a duplicate
    None,  # an error row
]
MAX_TOKENS = 3


@pytest.fixture()
def tickets(tmp_path):
    path = tmp_path / "tickets.parquet"
    prompts = [None if t is None else f"{SYSTEM}Ticket: {t}\nLabel:" for t in TICKETS]
    pq.write_table(pa.table({"id": list(range(len(TICKETS))), "prompt": prompts}), path)
    return path, prompts


def _run(source, out, model, *extra) -> int:
    argv = ["run", str(source), "--prompt-col", "prompt", "--output", str(out)]
    return main([*argv, "--model", str(model), "--max-tokens", str(MAX_TOKENS), *extra])


def _figures(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if " rows (" in line)
    found = re.search(
        r"(\d+) rows \((\d+) errors\) on (\w+) in .* s, ([\d.]+) rows/s; ([\d,]+) prompt tokens"
        r"(?:, ([\d,]+) prefilled \(saving ([\d.]+)%\)| \(prefill computed: [^)]*\))"
        r", ([\d,]+) output tokens",
        line,
    )
    assert found, line
    keys = ("rows", "errors", "engine", "rate", "prompt", "prefilled", "saving", "output")
    return dict(zip(keys, found.groups()))


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_local_summary_counts_every_row_and_the_prefill_computed(
    tickets, tiny_llama_dir, tmp_path, capsys
):
    source, prompts = tickets
    out = tmp_path / "o.jsonl"
    assert _run(source, out, tiny_llama_dir, "--no-progress") == 0
    figures = _figures(capsys.readouterr().out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    operator = LLMOperator(str(tiny_llama_dir))
    operator.generate(chat_wrapped(prompts), SamplingParams(max_tokens=MAX_TOKENS))
    stats = operator.last_stats
    assert (figures["rows"], figures["errors"], figures["engine"]) == ("6", "1", "local")
    assert _number(figures["prompt"]) == sum(r["out_prompt_tokens"] for r in rows[:5])
    assert _number(figures["prefilled"]) == stats.prefill_tokens_computed
    saving = 1 - stats.prefill_tokens_computed / _number(figures["prompt"])
    assert float(figures["saving"]) == pytest.approx(100 * saving, abs=0.05)
    assert _number(figures["output"]) == sum(r["out_completion_tokens"] for r in rows)


def test_dedupe_keeps_the_saving_against_every_row(tickets, tiny_llama_dir, tmp_path, capsys):
    source, _ = tickets
    assert _run(source, tmp_path / "a.jsonl", tiny_llama_dir, "--no-progress") == 0
    plain = _figures(capsys.readouterr().out)
    assert _run(source, tmp_path / "b.jsonl", tiny_llama_dir, "--no-progress", "--dedupe") == 0
    deduped = _figures(capsys.readouterr().out)
    # duplicates are computed once either way (the planner merges identical greedy rows),
    # and the prompt tokens are every row's: the same figures
    for key in ("rows", "errors", "prompt", "prefilled", "saving", "output"):
        assert plain[key] == deduped[key], key


def test_a_resumed_run_sums_every_chunk(tickets, tiny_llama_dir, tmp_path, capsys):
    source, _ = tickets
    folder = tmp_path / "ckpt"
    args = ["--no-progress", "--checkpoint", str(folder), "--checkpoint-rows", "2"]
    assert _run(source, tmp_path / "a.jsonl", tiny_llama_dir, *args) == 0
    whole = _figures(capsys.readouterr().out)
    assert whole["prefilled"] is not None
    part = sorted(folder.glob("part-*.jsonl"))[1]
    part.unlink()  # as if the run had died before that chunk
    assert _run(source, tmp_path / "b.jsonl", tiny_llama_dir, *args) == 0
    out = capsys.readouterr().out
    assert "2 of 3 chunks done already" in out
    resumed = _figures(out)
    for key in ("rows", "errors", "prompt", "prefilled", "saving", "output"):
        assert whole[key] == resumed[key], key


def test_dask_summary_points_to_the_partition_lines(
    tickets, tiny_llama_dir, tmp_path, capsys, caplog
):
    source, _ = tickets
    logger = logging.getLogger("llm_operator.integrations")
    level = logger.level
    try:
        args = ["--no-progress", "--engine", "dask", "--partitions", "2"]
        assert _run(source, tmp_path / "o.jsonl", tiny_llama_dir, *args) == 0
    finally:
        logger.setLevel(level)
    captured = capsys.readouterr()
    figures = _figures(captured.out)
    assert figures["prefilled"] is None and figures["engine"] == "dask"
    assert "prefill computed: each partition's line above" in captured.out
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert _number(figures["prompt"]) == sum(r["out_prompt_tokens"] for r in rows[:5])
    lines = [r.getMessage() for r in caplog.records if "dask partition" in r.getMessage()]
    assert len(lines) == 2, lines  # one per partition, with its prefill and saving
    assert all("prefilled" in line and "saving ratio" in line for line in lines)
