"""llm-operator plan --estimate: the predicted time of the rows `run` would run."""

from __future__ import annotations

import json
import re

import pytest

from llm_operator.cli import main

MAX_TOKENS = 6
ROWS = 10


@pytest.fixture()
def calibration_cache(tmp_path, monkeypatch):
    """A fresh cache folder: the first estimate calibrates, later ones read it."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def shared_cache_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("estimate-cache")


@pytest.fixture()
def shared_cache(shared_cache_folder, monkeypatch):
    """One cache for the tests that do not look at whether it was calibrated (faster)."""
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(shared_cache_folder))
    return shared_cache_folder


@pytest.fixture()
def items_csv(tmp_path):
    """Ten rows, two of them equal (merged by the plan, once with --dedupe)."""
    path = tmp_path / "items.csv"
    texts = [f"The item number {i} arrived late and the box was crushed." for i in range(ROWS)]
    texts[6] = texts[2]  # the same kind too: an equal row
    lines = ["id,kind,text"] + [
        f'{i},{"refund" if i % 2 else "shipping"},"{text}"' for i, text in enumerate(texts)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_argv(model_dir, path, *extra: str) -> list[str]:
    return [
        "plan",
        str(path),
        "--template",
        "Classify the ticket.\nKind: {kind}\nText: {text}\nLabel:",
        "--model",
        str(model_dir),
        "--max-tokens",
        str(MAX_TOKENS),
        "--no-progress",
        *extra,
    ]


def report_number(report: str, label: str) -> int:
    match = re.search(rf"^  {label}\s+([\d,]+)", report, flags=re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{report}"
    return int(match.group(1).replace(",", ""))


def test_estimate_report_matches_the_plan(tiny_llama_dir, items_csv, calibration_cache, capsys):
    assert main(plan_argv(tiny_llama_dir, items_csv, "--json")) == 0
    stats = json.loads(capsys.readouterr().out)
    assert "cost" not in stats  # no estimate, no model load

    assert main(plan_argv(tiny_llama_dir, items_csv, "--estimate", "--sample-rows", "2")) == 0
    out = capsys.readouterr().out
    assert "calibrating" in out  # a fresh cache: this run measured the machine
    plan_text, estimate_text = out.split("\nestimate (", 1)
    assert "prefix-sharing plan" in plan_text  # the plan report comes first
    # without --reorder-fields, `run` runs the given field order
    assert report_number(estimate_text, "rows") == stats["rows"] == ROWS
    assert report_number(estimate_text, "prompt tokens") == stats["given"]["prompt_tokens"]
    assert "(predicted from 2 sampled rows)" in estimate_text
    assert "machine-hours" in estimate_text
    assert "calibration " in estimate_text and "sample check" in estimate_text


def test_estimate_json_cost(tiny_llama_dir, items_csv, calibration_cache, capsys):
    argv = plan_argv(tiny_llama_dir, items_csv, "--json", "--estimate", "--ignore-eos")
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON alone
    assert "calibrating" in captured.err
    cost = report["cost"]
    assert cost["rows"] == report["rows"] == ROWS
    assert cost["prompt_tokens"] == report["given"]["prompt_tokens"]
    assert cost["requests"] == report["given"]["requests"] == ROWS - 1  # equal rows merged
    # every row runs to max_tokens: no sample needed, the output is known exactly
    assert cost["output_tokens"] == ROWS * MAX_TOKENS
    assert cost["sample_rows"] == 0
    assert cost["seconds"] > 0
    assert cost["low_seconds"] <= cost["seconds"] <= cost["high_seconds"]
    assert cost["executors"] == 1
    assert cost["executor_seconds"] == pytest.approx(cost["seconds"])
    assert cost["machine_hours"] == pytest.approx(cost["seconds"] / 3600)
    assert cost["calibration"]["cached"] is False
    assert cost["calibration"]["path"].startswith(str(calibration_cache))

    # the second run reads the calibration; --executors 2 splits the job
    assert main([*argv, "--executors", "2"]) == 0
    captured = capsys.readouterr()
    assert "calibrating" not in captured.err
    again = json.loads(captured.out)["cost"]
    assert again["calibration"]["cached"] is True
    assert again["calibration"]["path"] == cost["calibration"]["path"]
    assert again["executors"] == 2
    assert again["output_tokens"] == ROWS * MAX_TOKENS
    assert 0 < again["executor_seconds"] <= again["seconds"]

    # --recalibrate measures again
    assert main([*argv, "--recalibrate"]) == 0
    captured = capsys.readouterr()
    assert "calibrating" in captured.err
    assert json.loads(captured.out)["cost"]["calibration"]["cached"] is False


def test_estimate_samples_rows_without_ignore_eos(tiny_llama_dir, items_csv, shared_cache, capsys):
    argv = plan_argv(tiny_llama_dir, items_csv, "--json", "--estimate")
    assert main(argv) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]  # auto: a sample within a budget
    assert 0 <= cost["sample_rows"] <= cost["requests"]
    assert 0 < cost["output_tokens"] <= ROWS * MAX_TOKENS
    assert cost["low_seconds"] <= cost["seconds"] <= cost["high_seconds"]

    assert main([*argv, "--sample-rows", "3"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["sample_rows"] == 3
    assert cost["sample_seconds"] > 0
    assert 0 < cost["output_tokens"] <= ROWS * MAX_TOKENS
    assert cost["low_seconds"] <= cost["seconds"] <= cost["high_seconds"]

    argv = plan_argv(tiny_llama_dir, items_csv, "--json", "--estimate", "--sample-rows", "0")
    assert main(argv) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["sample_rows"] == 0
    assert cost["output_tokens"] == ROWS * MAX_TOKENS  # no sample: every row to max_tokens
    assert any("no sampled row" in line for line in cost["assumptions"])


def test_estimate_counts_the_rows_run_would_run(tiny_llama_dir, items_csv, shared_cache, capsys):
    """--dedupe: the distinct prompts; --reorder-fields: the chosen order's prompts."""
    flags = ["--json", "--estimate", "--ignore-eos", "--dedupe", "--reorder-fields"]
    assert main(plan_argv(tiny_llama_dir, items_csv, *flags)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dedupe"] is True
    assert "estimate" in report  # the field orders' statistics stay under their key
    cost = report["cost"]
    assert cost["rows"] == report["distinct_prompts"] == ROWS - 1
    assert cost["prompt_tokens"] == report["chosen"]["prompt_tokens"]
    assert cost["output_tokens"] == (ROWS - 1) * MAX_TOKENS


@pytest.mark.parametrize(
    ("flags", "option"),
    [
        (["--executors", "0"], "--executors"),
        (["--executors", "two"], "--executors"),
        (["--sample-rows", "-3"], "--sample-rows"),
        (["--sample-rows", "some"], "--sample-rows"),
    ],
)
def test_estimate_bad_values_exit_2(tiny_llama_dir, items_csv, capsys, flags, option):
    with pytest.raises(SystemExit) as exited:
        main(plan_argv(tiny_llama_dir, items_csv, "--estimate", *flags))
    assert exited.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_estimate_options_need_estimate(tiny_llama_dir, items_csv, capsys):
    assert main(plan_argv(tiny_llama_dir, items_csv, "--executors", "4")) == 2
    assert "--executors: only with --estimate" in capsys.readouterr().err
