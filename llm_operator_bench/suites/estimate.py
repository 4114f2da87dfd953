"""``llm-operator bench estimate``: the estimate against the measured run, side by side.

For each system (native, native-bf16, vllm-plan, vllm-plan-bf16) one process, as the
other benchmarks do; in it, for each workload (the bench workloads and a real table, 200
MovieLens ratings asked a free question through the chat template):

  1. ``LLMOperator.estimate`` (the first workload calibrates, the others read the cache);
  2. a warm-up row, as ``bench`` does, then the KV pool released (a fresh process's run);
  3. the run itself, timed: ``generate`` on the same prompts (``--repeat`` runs, each
     after releasing the KV pool; the median counts).

The report gives predicted and measured seconds, their ratio, the estimate's own time
against the run's, and the predicted and measured output and prefill tokens.

    python -m llm_operator_bench.suites.estimate --worker JOB RESULT   (the per-system process)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEMS = {
    "native": ({"backend": "native"}, "float32", None),
    "native-bf16": ({"backend": "native"}, "bfloat16", None),
    "vllm-plan": ({"backend": "vllm"}, "float32", "vllm"),
    "vllm-plan-bf16": ({"backend": "vllm"}, "bfloat16", "vllm"),
}
MOVIELENS_TEMPLATE = (
    "Title: {title}\nGenres: {genres}\nrating: {rating}\nWho would enjoy this movie?"
)


def movielens_workload(tokenizer: Any, rows: int) -> dict[str, Any]:
    """200 MovieLens ratings (``fields.movielens_table``) asked a free question, each row
    a user message (the chat template applies), at most 24 output tokens."""
    from llm_operator_bench.suites.fields import movielens_table

    frame, _ = movielens_table(rows=rows)
    prompts = [
        [{"role": "user", "content": MOVIELENS_TEMPLATE.format(**record)}]
        for record in frame.to_dict("records")
    ]
    return {"name": "movielens", "prompts": prompts, "max_tokens": [24] * len(prompts)}


def bench_workloads(model: str, names: list[str], size: str, movielens_rows: int) -> list[dict]:
    from llm_operator.models import load_tokenizer, resolve_model
    from llm_operator_bench.core.workloads import make_workload

    tokenizer = load_tokenizer(resolve_model(model).path)
    jobs = []
    for name in names:
        if name == "movielens":
            jobs.append(movielens_workload(tokenizer, movielens_rows))
            continue
        w = make_workload(name, tokenizer, size=size)
        jobs.append(
            {
                "name": name,
                "prompts": w.prompts,
                "max_tokens": list(w.max_tokens),
                "ignore_eos": w.ignore_eos,
                "stop": list(w.stop),
            }
        )
    return jobs


def run_estimate_bench(
    *,
    model: str,
    systems: list[str],
    workloads: list[str],
    size: str,
    movielens_rows: int,
    vllm_python: Path,
    kv_cache_gib: float,
    timeout: float,
    out: Path,
    name: str,
    repeat: int = 1,
) -> dict[str, Any]:
    from llm_operator_bench.core.runner import machine_info

    jobs = bench_workloads(model, workloads, size, movielens_rows)
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": machine_info(),
        "model": model,
        "size": size,
        "repeat": repeat,
        "results": [],
        "errors": {},
    }
    for system in systems:
        if system not in SYSTEMS:
            raise ValueError(f"system {system!r} is unknown; choose from {', '.join(SYSTEMS)}")
        options, dtype, venv = SYSTEMS[system]
        python = sys.executable
        if venv == "vllm":
            if not Path(vllm_python).exists():
                report["errors"][system] = f"no vLLM venv at {vllm_python}"
                continue
            python = str(vllm_python)
            options = {**options, "kv_cache_memory": f"{kv_cache_gib}GiB"}
        job = {
            "model": model,
            "options": {**options, "dtype": dtype},
            "workloads": jobs,
            "repeat": max(1, int(repeat)),
        }
        with tempfile.TemporaryDirectory() as folder:
            job_path, result_path = Path(folder, "job.json"), Path(folder, "result.json")
            job_path.write_text(json.dumps(job))
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            print(f"{system}: {len(jobs)} workloads", flush=True)
            try:
                subprocess.run(
                    [python, "-m", "llm_operator_bench.suites.estimate", "--worker",
                     str(job_path), str(result_path)],
                    check=True, timeout=timeout, env=env,
                )  # fmt: skip
                result = json.loads(result_path.read_text())
            except (subprocess.SubprocessError, OSError, ValueError) as error:
                report["errors"][system] = str(error)
                continue
        for run in result["runs"]:
            report["results"].append({"system": system, **run})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    lines = [
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores; "
        f"model {report.get('model')}; workloads at size {report.get('size')}; measured: the "
        f"median of {report.get('repeat', 1)} run(s).",
        "",
        "| system | workload | rows | predicted s | range | measured s | predicted / measured "
        "| estimate s (% of run) | calibration s | sample rows | output tokens pred / meas "
        "| prefill pred / meas |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['system']} | {r['workload']} | {r['rows']} | {r['predicted']:.1f} "
            f"| {r['low']:.1f}-{r['high']:.1f} | {r['measured']:.1f} "
            f"| {r['predicted'] / r['measured']:.2f} "
            f"| {r['estimate_seconds']:.2f} ({r['estimate_seconds'] / r['measured']:.1%}) "
            f"| {r['calibration_seconds']:.1f} | {r['sample_rows']} "
            f"| {r['output_tokens_predicted']:,} / {r['output_tokens_measured']:,} "
            f"| {r['prefill_predicted']:,} / {r['prefill_measured']:,} |"
        )
    for system, error in report.get("errors", {}).items():
        lines.append(f"\n{system}: not measured ({error})")
    return "\n".join(lines) + "\n"


# -- the per-system process ---------------------------------------------------------------


def _release_pool(op) -> None:
    backend = op.backend()
    release = getattr(backend, "release_kv_pool", None)
    if callable(release):
        release()
    llm = getattr(backend, "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()


def worker(job_path: Path, result_path: Path) -> None:
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.estimate.estimate import start_backend

    job = json.loads(Path(job_path).read_text())
    op = LLMOperator(job["model"], **job["options"])
    load_seconds = start_backend(op)
    runs = []
    for index, w in enumerate(job["workloads"]):
        stop = tuple(w.get("stop") or ())
        params = [
            SamplingParams(
                max_tokens=m,
                ignore_eos=bool(w.get("ignore_eos")),
                **({"stop": stop} if stop else {}),
            )
            for m in w["max_tokens"]
        ]
        _release_pool(op)
        estimate = op.estimate(w["prompts"], params, recalibrate=index == 0)
        calibration = estimate.calibration
        calibration_seconds = 0.0 if calibration["cached"] else calibration["seconds"]
        op.generate(w["prompts"][:1], [SamplingParams(max_tokens=2)])  # warm-up, as bench does
        runs_seconds = []
        for _ in range(int(job.get("repeat", 1))):  # the median of the runs counts
            _release_pool(op)
            timed = time.perf_counter()
            results = op.generate(w["prompts"], params)
            runs_seconds.append(time.perf_counter() - timed)
        measured = statistics.median(runs_seconds)
        stats = op.last_stats
        runs.append(
            {
                "workload": w["name"],
                "rows": len(results),
                "predicted": estimate.seconds,
                "low": estimate.low_seconds,
                "high": estimate.high_seconds,
                "measured": measured,
                "measured_runs": runs_seconds,
                "estimate_seconds": estimate.estimate_seconds - calibration_seconds,
                "calibration_seconds": calibration_seconds,
                "sample_rows": estimate.sample_rows,
                "sample_check": estimate.sample_check,
                "output_tokens_predicted": estimate.output_tokens,
                "output_tokens_measured": stats.output_tokens,
                "prefill_predicted": estimate.prefill_tokens,
                "prefill_measured": stats.prefill_tokens_computed,
                "iterations_predicted": estimate.iterations,
                "dtype": estimate.dtype,
                "calibration": calibration,
                "load_seconds": load_seconds,
            }
        )
        print(
            f"{w['name']}: predicted {estimate.seconds:.2f} s, measured {measured:.2f} s "
            f"({estimate.seconds / measured:.2f}); estimate {estimate.estimate_seconds:.2f} s",
            flush=True,
        )
    Path(result_path).write_text(json.dumps({"runs": runs}, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m llm_operator_bench.suites.estimate --worker JOB RESULT")
