"""Resumable ``llm-operator run --checkpoint``: after a crash or kill -9, the same command
finishes only what is missing, and the output equals an uninterrupted run's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_operator.cli import engines, main

TEXTS = [f"Review {i}: the {'battery' if i % 3 else 'screen'} is {'fine' if i % 2 else 'bad'}"
         for i in range(14)]  # fmt: skip


@pytest.fixture()
def table(tmp_path):
    path = tmp_path / "in.parquet"
    texts = list(TEXTS)
    texts[5] = None  # an error row survives the resume too
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def _argv(table, out, model, checkpoint=None, *extra):
    argv = ["run", str(table), "--prompt-col", "text", "--output", str(out)]
    argv += ["--model", str(model), "--max-tokens", "6", "--seed", "3", "--temperature", "0.7"]
    argv += ["--no-progress", *extra]
    if checkpoint is not None:
        argv += ["--checkpoint", str(checkpoint), "--checkpoint-rows", "4"]
    return argv


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_crashed_run_resumes_with_only_the_missing_chunks(
    tiny_llama_dir, table, tmp_path, monkeypatch
) -> None:
    clean = tmp_path / "clean.jsonl"
    assert main(_argv(table, clean, tiny_llama_dir, tmp_path / "clean-ckpt")) == 0

    calls: list[int] = []
    real = engines.generate

    def crash_after_two(prompts, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real(prompts, **kwargs)

    monkeypatch.setattr(engines, "generate", crash_after_two)
    folder = tmp_path / "ckpt"
    out = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_argv(table, out, tiny_llama_dir, folder))
    assert not out.exists()
    assert len(list(folder.glob("part-*.jsonl"))) == 2  # two chunks of 4 rows were saved
    calls.clear()
    monkeypatch.setattr(engines, "generate", real)
    counted: list[int] = []
    monkeypatch.setattr(
        engines,
        "generate",
        lambda prompts, **kw: counted.append(len(prompts)) or real(prompts, **kw),
    )
    assert main(_argv(table, out, tiny_llama_dir, folder)) == 0
    assert counted == [4, 2]  # only the missing chunks: rows 8-11 and 12-13
    assert _rows(out) == _rows(clean)
    assert _rows(out)[5]["out_finish_reason"] == "error"


def test_a_checkpoint_of_another_job_is_refused(tiny_llama_dir, table, tmp_path, capsys) -> None:
    folder = tmp_path / "ckpt"
    assert main(_argv(table, tmp_path / "a.jsonl", tiny_llama_dir, folder)) == 0
    other = _argv(table, tmp_path / "b.jsonl", tiny_llama_dir, folder, "--max-tokens", "3")
    assert main(other) == 2
    assert "belongs to another job" in capsys.readouterr().err


def test_kill_9_mid_job_then_the_same_command_finishes_it(tiny_llama_dir, tmp_path) -> None:
    """A real kill -9 of the CLI process after its first chunk was written."""
    texts = [f"Row {i}: tell me about item {i} and its many parts" for i in range(60)]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), source)
    folder, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    argv = _argv(source, out, tiny_llama_dir, None, "--max-tokens", "24", "--ignore-eos")
    argv += ["--checkpoint", str(folder), "--checkpoint-rows", "2"]
    command = [sys.executable, "-m", "llm_operator.cli", *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(folder.glob("part-*.jsonl")) and time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the run ended before its first chunk: {process.stderr.read()!r}")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    parts_at_kill = len(list(folder.glob("part-*.jsonl")))
    assert 1 <= parts_at_kill < 30, parts_at_kill
    assert not out.exists()
    assert main(argv) == 0  # the same command, in this process
    clean = tmp_path / "clean.jsonl"
    uninterrupted = _argv(source, clean, tiny_llama_dir, None, "--max-tokens", "24", "--ignore-eos")
    assert (
        main([*uninterrupted, "--checkpoint", str(tmp_path / "c2"), "--checkpoint-rows", "2"]) == 0
    )
    assert _rows(out) == _rows(clean)
    assert len(_rows(out)) == 60 and all(r["out_completion_tokens"] == 24 for r in _rows(out))
