"""``llm-operator bench gpu``: the tiny run on the CPU (one CLI call, three system processes,
about half a minute) and the report's figures that could be wrong: token counts, the
floor, agreement with HF, the tables; the plan of the default run, a timed-out system, the
tokenizer folder. The tiny run on a GPU is marked ``gpu`` (``make test-gpu``)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from llm_operator.cli import main
from llm_operator_bench.core.flops import model_shape
from llm_operator_bench.gpu import bench as gpu_bench
from llm_operator_bench.gpu.models import build_job, llama_config, save_tokenizer, tokenizer_dir
from llm_operator_bench.gpu.report import NOT_ON_CPU, build_records

SYSTEMS = ("hf", "native", "native-graphs-off")


def run_tiny(tmp_path: Path, tokenizer: Path, device: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    code = main(
        ["bench", "gpu", "--size", "tiny", "--device", device, "--tokenizer", str(tokenizer),
         "--repeat", "2", "--out", str(out), "--cache-dir", str(tmp_path / "models")]
    )  # fmt: skip
    report = json.loads((out / "bench-gpu.json").read_text())
    return code, report, (out / "bench-gpu.md").read_text()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny run on the CPU."""
    return run_tiny(tmp_path_factory.mktemp("gpu-bench"), tiny_tokenizer_dir, "cpu")


def test_tiny_run_has_every_job_and_system(tiny_run):
    code, report, _ = tiny_run
    assert code == 0
    assert [(r["job"], r["system"]) for r in report["results"]] == [
        (job, system) for job in ("etl-128", "etl-1024") for system in SYSTEMS
    ]
    for record in report["results"]:
        assert record["status"] == "ok", record
        assert record["model"] == "tiny" and record["dtype"] == "float32"
        assert len(record["warm_seconds"]) == 2
        assert record["seconds"] == statistics.median(record["warm_seconds"])
        extra = record["first_seconds"] - record["seconds"]
        assert record["first_run_extra_seconds"] == pytest.approx(extra)
        # the first job of each system process is the process's first run
        assert record["fresh_process"] is (record["job"] == "etl-128")


def test_token_counts_match_the_workload(tiny_run, tiny_tokenizer_dir):
    from llm_operator import LLMOperator

    _, report, _ = tiny_run
    model_dir = Path(report["configs"][0]["model_dir"])
    operator = LLMOperator(str(model_dir))
    for name, job in report["jobs"].items():
        built = build_job(name, operator.tokenizer, size="tiny")
        token_ids = operator.tokenize(built["prompts"])
        assert job["rows"] == built["rows"] == len(token_ids)
        assert job["prompt_tokens"] == sum(len(ids) for ids in token_ids)
        assert 0 < job["min_prefill_tokens"] < job["prompt_tokens"]  # the groups share
        assert job["output_tokens_total"] == job["rows"] * job["output_tokens"]
        for record in report["results"]:
            if record["job"] == name:
                assert record["output_tokens"] == job["output_tokens_total"]  # EOS ignored
                assert record["prefill_tokens_computed"] >= job["min_prefill_tokens"]
    assert report["jobs"]["etl-1024"]["rows"] == 2 * report["jobs"]["etl-128"]["rows"]  # tails
    native = {r["job"]: r for r in report["results"] if r["system"] == "native"}
    hf = {r["job"]: r for r in report["results"] if r["system"] == "hf"}
    for name in report["jobs"]:  # native computes the shared prefixes once, HF every row
        assert native[name]["prefill_tokens_computed"] < hf[name]["prefill_tokens_computed"]


def test_floor_is_positive_and_below_every_measured_time(tiny_run):
    _, report, _ = tiny_run
    (config,) = report["configs"]
    assert (
        config["matmul_rate"]["float32"]["gflops"] > 0 and report["machine"]["copy_bandwidth"] > 0
    )
    for name, floor in config["floors"].items():
        assert floor["compute_seconds"] > 0 and floor["memory_seconds"] > 0
        assert floor["floor_seconds"] == pytest.approx(
            floor["compute_seconds"] + floor["memory_seconds"]
        )
        assert floor["decode_steps"] == report["jobs"][name]["output_tokens"]
    for record in report["results"]:
        assert 0 < record["floor_seconds"] < record["seconds"], record
        assert record["x_floor"] == pytest.approx(record["seconds"] / record["floor_seconds"])


def test_native_agrees_with_hf_in_fp32_and_cpu_has_no_gpu_figures(tiny_run):
    _, report, _ = tiny_run
    for record in report["results"]:
        assert record["agreement_with_hf"] == 1.0, record
        assert record["agreeing_rows"] == record["rows"]
        assert record["busy_share"] is None and record["launches_per_iteration"] is None
        assert record["gpu_figures"] == NOT_ON_CPU
        assert record["iterations"] > 0
        if record["system"] != "hf":
            assert record["speedup_vs_hf"] > 0 and record["tokenize_seconds"] >= 0


def test_markdown_has_a_row_per_job_and_per_job_and_system(tiny_run):
    _, report, markdown = tiny_run
    lines = markdown.splitlines()
    labels = {r["label"] for r in report["results"]}
    assert labels == {"tiny fp32, 8 rows", "tiny fp32, 16 rows"}
    header = "| job | HF | native | native graphs off | floor | busy % | launches/iter "
    assert any(line.startswith(header) for line in lines)
    for label in labels:
        summary = [
            line for line in lines if line.startswith(f"| {label} | ") and line.count("|") == 10
        ]
        assert len(summary) == 1 and NOT_ON_CPU in summary[0] and "1.000 / 1.000" in summary[0]
        for system in SYSTEMS:
            assert sum(line.startswith(f"| {label} | {system} | ") for line in lines) == 1
    for name, job in report["jobs"].items():
        assert any(
            line.startswith(f"| {name} | {job['rows']:,} | {job['prompt_tokens']:,} |")
            for line in lines
        )


def test_default_plan_and_bad_names():
    plan = gpu_bench.plan_runs(size="default")
    both = ("etl-128", "etl-1024")
    assert plan == [
        ("135m", "bfloat16", both),
        ("1b", "bfloat16", both),
        ("3b", "bfloat16", both),
        ("135m", "float32", ("etl-128",)),
        ("3b", "float32", ("etl-128",)),
    ]
    assert gpu_bench.plan_runs(size="tiny") == [("tiny", "float32", both)]
    assert gpu_bench.plan_runs(
        size="default", models=["1b"], dtypes=["fp32"], jobs=["etl-1024"]
    ) == [("1b", "float32", ("etl-1024",))]
    with pytest.raises(ValueError, match="models=.*choose from tiny, 135m, 1b, 3b"):
        gpu_bench.plan_runs(size="default", models=["7b"])
    with pytest.raises(ValueError, match="jobs="):
        gpu_bench.plan_runs(size="default", jobs=["etl-9"])
    with pytest.raises(ValueError, match="dtypes="):
        gpu_bench.plan_runs(size="default", dtypes=["int8"])


def test_real_shapes_have_the_tokenizers_vocabulary(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    shapes = {name: model_shape(llama_config(name, tokenizer)) for name in ("135m", "1b", "3b")}
    assert shapes["135m"].linear_weights() == 106_168_320  # DESIGN.md: 106M, 212 MFLOP a token
    assert (shapes["1b"].num_layers, shapes["1b"].num_heads, shapes["1b"].num_kv_heads) == (
        16,
        32,
        8,
    )
    assert (shapes["3b"].hidden_size, shapes["3b"].head_dim, shapes["3b"].num_layers) == (
        3072,
        128,
        28,
    )
    assert {shape.vocab_size for shape in shapes.values()} == {len(tokenizer)}
    assert llama_config("135m", tokenizer).rope_parameters["rope_theta"] == 100_000.0
    assert llama_config("3b", tokenizer).tie_word_embeddings


def test_a_system_that_times_out_is_recorded_and_the_rest_continue(tmp_path):
    job = {"name": "etl-128", "prompts": [[{"role": "user", "content": "hi"}]], "token_ids": [[1, 2]],
           "rows": 1, "output_tokens": 2, "hf_batch_size": 1}  # fmt: skip
    result = gpu_bench.run_system(
        "native", tmp_path / "no-model", "float32", "cpu", [job], repeat=1, timeout=0.01, log=print
    )
    assert result["error"] == "timed out after 0 s"
    raw = {"native": result, "hf": {"skipped": "the --budget of 1 s was used up"}}
    records = build_records("tiny", "float32", [job], raw, {}, device="cpu")
    by = {r["system"]: r for r in records}
    assert by["native"]["status"] == "failed" and "timed out" in by["native"]["error"]
    assert by["hf"]["status"] == "skipped" and by["native-graphs-off"]["error"] == "not run"


def test_saved_tokenizer_folder_is_accepted(tmp_path, tiny_tokenizer_dir):
    files = save_tokenizer(tmp_path / "tok", tiny_tokenizer_dir)
    assert (tmp_path / "tok" / "tokenizer.json") in files
    assert tokenizer_dir(tmp_path / "tok") == tmp_path / "tok"
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer_config.json"):
        tokenizer_dir(tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        tokenizer_dir(tmp_path / "missing")


def test_cli_defaults_reach_the_bench(monkeypatch):
    seen = {}

    def fake(**options):
        seen.update(options)
        return {"results": [], "machine": {}, "jobs": {}, "configs": []}

    monkeypatch.setattr(gpu_bench, "run_gpu_bench", fake)
    monkeypatch.setattr("llm_operator_bench.gpu.report.markdown", lambda report: "")
    assert main(["bench", "gpu", "--models", "1b,3b", "--jobs", "etl-1024"]) == 0
    assert seen["repeat"] == 3 and seen["size"] == "default" and seen["dtypes"] is None
    assert seen["models"] == ["1b", "3b"] and seen["jobs"] == ["etl-1024"]
    assert main(["bench", "gpu", "--quick", "--repeat", "1"]) == 0
    assert seen["size"] == "tiny" and seen["repeat"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0 (make test-gpu)"
)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_run_on_the_gpu(tmp_path, tiny_tokenizer_dir):
    """The GPU figures exist: busy share, launches per iteration; fp32 still agrees."""
    code, report, markdown = run_tiny(tmp_path, tiny_tokenizer_dir, "cuda")
    assert code == 0, [r["error"] for r in report["results"] if r["error"]]
    assert report["machine"]["gpu"] and NOT_ON_CPU not in markdown
    for record in report["results"]:
        assert record["agreement_with_hf"] == 1.0, record
        if record["system"] != "hf":
            assert 0 < record["busy_share"] and record["launches_per_iteration"] > 0
            assert record["profile"]["kernel_seconds"] > 0
