"""The classify workload through the benchmark: per-row choices reach every system kind,
free generation stops at the workload's stop string, and the label figures (outputs read
as labels, agreement with gold and between systems) follow hand-checked inputs.

The classify workload end to end is in tests/test_bench.py (its bench run takes classify
and the choices systems along: a run of its own here cost three more system processes)."""

from __future__ import annotations

import pytest

from llm_operator.cli import main
from llm_operator_bench.baselines.vllm_runner import _resolve_runs
from llm_operator_bench.core.records import build_records
from llm_operator_bench.core.report import labels_table, markdown_table
from llm_operator_bench.core.systems import SYSTEMS, SystemSpec, runs_on
from llm_operator_bench.core.worker import _sampling


def test_choices_systems_need_a_workload_with_labels(tiny_llama_dir, tmp_path, capsys):
    common = ["bench", "--size", "tiny", "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    code = main([*common, "--workloads", "etl-fewshot", "--systems", "native-choices"])
    assert code == 2
    assert "--workloads classify" in capsys.readouterr().err
    assert runs_on(SYSTEMS["native"], {"choices": None})
    assert not runs_on(SYSTEMS["native-choices"], {"choices": None})
    assert runs_on(SYSTEMS["vllm-choices"], {"choices": [["a"]]})
    with pytest.raises(ValueError, match="takes no choices"):
        SystemSpec("x", "static", "d", choices=True)


def test_worker_rows_get_their_choices_or_the_stop_strings():
    workload = {"max_tokens": [3, 4], "stop": ["\n"], "choices": [["yes", "no"], None]}
    constrained, free = _sampling(workload, 0), _sampling(workload, 1)
    assert constrained.choices == ("yes", "no") and constrained.stop == ()
    assert free.choices is None and free.stop == ("\n",) and free.max_tokens == 4
    plain = _sampling({"max_tokens": [2], "ignore_eos": True}, 0)
    assert plain.stop == () and plain.choices is None and plain.ignore_eos


def test_vllm_runner_reads_per_row_choices_and_stop():
    job = {
        "prompts": [[1, 2], [3]],
        "max_tokens": [2, 2],
        "runs": [{"name": "c", "choices": [["a", "b"], None]}, {"name": "f", "stop": ["\n"]}],
    }
    constrained, free = _resolve_runs(job)
    assert constrained["choices"] == [("a", "b"), None] and constrained["stop"] == ()
    assert free["choices"] == [None, None] and free["stop"] == ("\n",)
    job["runs"] = [{"name": "bad", "choices": [["a"]]}]
    with pytest.raises(ValueError, match="one entry per prompt"):
        _resolve_runs(job)


def _workload(name: str, labelled: bool) -> dict:
    rows = 3
    return {
        "name": name,
        "description": name,
        "summary": {
            "rows": rows,
            "prompt_tokens": 30,
            "min_prefill_tokens": 10,
            "max_tokens_total": 9,
        },
        "token_ids": [[1] * 10] * rows,
        "ignore_eos": False,
        "stop": ["\n"] if labelled else [],
        "choices": [["yes", "no"]] * rows if labelled else None,
        "gold": ["yes", "no", "yes"] if labelled else None,
    }


def _run(workload: str, texts: list[str]) -> dict:
    return {
        "workload": workload,
        "seconds": [1.0],
        "token_ids": [[ord(c) for c in t] for t in texts],
        "prefill_tokens_computed": 10,
    }


def test_label_figures_on_hand_checked_outputs():
    """Outputs are cut at the stop string and read as the first label they name."""
    free = SystemSpec("free", "operator", "d")
    chosen = SystemSpec("chosen", "operator", "d", choices=True)
    classify, other = _workload("classify", True), _workload("etl", False)
    raw = {
        # "Yes" (cut at the newline) -> yes; "maybe" names no label; "no." -> no
        "free": {"runs": [_run("classify", ["Yes\nno", "maybe", "no."]), _run("etl", ["x"] * 3)]},
        "chosen": {"runs": [_run("classify", ["yes", "no", "no"])]},
    }
    records = build_records(
        [free, chosen],
        raw,
        [classify, other],
        set(),
        decode=lambda ids: "".join(map(chr, ids)),
    )
    by = {(r["system"], r["workload"]): r for r in records}
    assert set(by) == {("free", "classify"), ("free", "etl"), ("chosen", "classify")}
    assert by["free", "classify"]["names_label"] == pytest.approx(2 / 3)
    assert by["free", "classify"]["gold_agreement"] == pytest.approx(1 / 3)
    assert by["chosen", "classify"]["names_label"] == 1.0
    assert by["chosen", "classify"]["gold_agreement"] == pytest.approx(2 / 3)
    assert by["free", "classify"]["same_label_as"] == {"chosen": pytest.approx(2 / 3)}
    assert by["chosen", "classify"]["same_label_as"] == {"free": pytest.approx(2 / 3)}
    assert "names_label" not in by["free", "etl"] and "same_label_as" not in by["free", "etl"]
    table = labels_table(records, "classify")
    assert "| free | 3.00 | 67% | 33% | - | 67% |" in table
    assert "| chosen | 3.00 | 100% | 67% | 67% | - |" in table
    assert labels_table(records, "etl") == []
    assert "Labels (classify)" in markdown_table(records, [classify, other])
