"""``llm-operator bench`` end to end on a tiny model: every field of the JSON, not the speed."""

from __future__ import annotations

import json

import pytest

from llm_operator.cli import main

OUR_SYSTEMS = (
    "hf",
    "hf-noshare",
    "hf-nodecodefirst",
    "native",
    "native-noshare",
    "native-notokenbatch",
)
STATIC_SYSTEMS = ("hf-static", "hf-static-shuffled")
VLLM_SYSTEMS = ("vllm", "vllm-plan")  # plain vLLM, and our backend="vllm" (both need the venv)
RECORD_FIELDS = (
    "system",
    "workload",
    "status",
    "rows",
    "prompt_tokens",
    "min_prefill_tokens",
    "load_seconds",
    "seconds",
    "seconds_all",
    "output_tokens",
    "output_tokens_per_second",
    "rows_per_second",
    "prefill_tokens_computed",
    "prefill_vs_min",
    "peak_rss_bytes",
    "agreement_with_hf_static",
    "speedup_vs_hf_static",
)


@pytest.fixture(scope="module")
def quick_report(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    systems = ",".join((*STATIC_SYSTEMS, *OUR_SYSTEMS, *VLLM_SYSTEMS))
    code = main(
        [
            "bench",
            "--quick",
            "--size",
            "tiny",
            "--model",
            str(tiny_llama_dir),
            "--systems",
            systems,
            "--repeat",
            "2",
            "--out",
            str(out),
            "--name",
            "tiny",
            "--vllm-python",
            str(out / "no-such-venv" / "python"),
        ]
    )
    assert code == 0
    return out, json.loads((out / "tiny.json").read_text())


def test_quick_run_writes_every_field(quick_report):
    out, report = quick_report
    for key in ("name", "created", "model", "size", "repeat", "machine", "workloads", "results"):
        assert report[key] is not None, key
    assert report["size"] == "tiny" and report["repeat"] == 2
    names = [w["name"] for w in report["workloads"]]
    assert names == ["etl-fewshot", "doc-qa", "table-rows", "no-sharing"]
    systems = len(STATIC_SYSTEMS) + len(OUR_SYSTEMS) + len(VLLM_SYSTEMS)
    assert len(report["results"]) == len(names) * systems
    for record in report["results"]:
        if record["system"] in VLLM_SYSTEMS:
            continue
        assert record["status"] == "ok", record
        for field in RECORD_FIELDS:
            assert record[field] is not None, (record["system"], record["workload"], field)
        assert len(record["seconds_all"]) == 2
        assert record["seconds"] > 0 and record["output_tokens"] > 0
        assert record["peak_rss_bytes"] > 50 * 2**20  # python + torch + the model, at least
    assert (out / "tiny.md").read_text().count("| hf-static |") == len(names)
    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["chart"] == str(out / "tiny.png")


def test_vllm_without_its_venv_is_skipped_with_the_reason(quick_report):
    _, report = quick_report
    skipped = [r for r in report["results"] if r["system"] in VLLM_SYSTEMS]
    assert len(skipped) == 2 * len(report["workloads"])
    for record in skipped:
        assert record["status"] == "skipped"
        assert "vllm-env" in record["error"]


def test_every_system_gives_hf_static_answers(quick_report):
    """Greedy outputs are token-identical to the baseline: sharing, order and batching
    change the speed, never the answer."""
    _, report = quick_report
    for record in report["results"]:
        if record["status"] == "ok":
            assert record["agreement_with_hf_static"] == 1.0, record


def test_prefill_figures_follow_the_plan(quick_report):
    _, report = quick_report
    by = {(r["system"], r["workload"]): r for r in report["results"]}
    for workload in report["workloads"]:
        name = workload["name"]
        assert workload["min_prefill_tokens"] <= workload["prompt_tokens"]
        for system in (*STATIC_SYSTEMS, *OUR_SYSTEMS):
            assert by[system, name]["prefill_tokens_computed"] >= workload["min_prefill_tokens"]
        for unshared in ("hf-noshare", "native-noshare"):
            assert by[unshared, name]["prefill_tokens_computed"] == workload["prompt_tokens"]
        assert by["hf-static", name]["prefill_tokens_computed"] >= workload["prompt_tokens"]
        assert by["hf", name]["speedup_vs_hf_static"] == pytest.approx(
            by["hf-static", name]["seconds"] / by["hf", name]["seconds"]
        )
    for name in ("etl-fewshot", "doc-qa", "table-rows"):
        for ours in ("hf", "native"):
            assert (
                by[ours, name]["prefill_tokens_computed"]
                < 0.8 * by[f"{ours}-noshare", name]["prefill_tokens_computed"]
            ), (ours, name)


def test_bad_bench_options_are_clear_errors(tiny_llama_dir, capsys, tmp_path):
    assert main(["bench", "--model", str(tiny_llama_dir), "--systems", "hf,nope"]) == 2
    assert "unknown system" in capsys.readouterr().err
    assert main(["bench", "--model", str(tiny_llama_dir), "--workloads", "etl"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    # the default sizes do not fit the tiny model's 256-token context
    code = main(
        ["bench", "--model", str(tiny_llama_dir), "--systems", "hf", "--out", str(tmp_path)]
    )
    assert code == 2
    assert "--size" in capsys.readouterr().err


def test_bench_planner_writes_rates(tmp_path, capsys):
    code = main(
        [
            "bench",
            "planner",
            "--prompts",
            "300,600",
            "--prompt-tokens",
            "60",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "planner.json").read_text())
    assert [r["prompts"] for r in report["results"]] == [300, 600]
    for result in report["results"]:
        assert result["tokens"] == pytest.approx(result["prompts"] * 60, rel=0.25)
        assert result["prompts_per_second"] > 0 and result["tokens_per_second"] > 0
        assert 0 < result["saving_ratio"] < 1
    assert "planner:" in capsys.readouterr().out
