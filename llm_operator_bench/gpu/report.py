"""The records and tables of ``bench gpu``: one record per (model, dtype, job, system).

A record's figures: ``seconds`` (median of the warm runs), ``first_seconds`` and
``first_run_extra_seconds`` (first run - warm median; ``fresh_process`` says whether that
first run was the process's first), ``speedup_vs_hf``, ``floor_seconds`` and ``x_floor``
(seconds / floor), ``busy_share`` (GPU time with work running in the profiled run / the warm
median), ``launches_per_iteration`` (kernel and graph launches of the profiled run / the
native engine's iterations in it) and ``agreement_with_hf`` (rows whose greedy token ids
equal HF ``generate``'s / rows). On the CPU the GPU figures are None ("n/a (CPU)").
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_operator_bench.core.report import _figure, _percent
from llm_operator_bench.gpu.models import SHAPE_LABELS

DISPLAY_ORDER = ("hf", "native", "native-graphs-off")
NOT_ON_CPU = "n/a (CPU)"
_SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def job_label(model: str, dtype: str, rows: int) -> str:
    """E.g. "135M bf16, 128 rows" (a row of the summary table)."""
    return f"{SHAPE_LABELS.get(model, model)} {_SHORT_DTYPES.get(dtype, dtype)}, {rows:,} rows"


def _record(system: str, result: dict, job: dict, floor: dict | None, on_gpu: bool) -> dict:
    entry = (result.get("jobs") or {}).get(job["name"]) or {}
    record: dict[str, Any] = {"system": system, "status": "ok", "error": None}
    if "skipped" in result:
        return {**record, "status": "skipped", "error": result["skipped"]}
    if not entry.get("done"):
        record.update(status="failed", error=result.get("error") or "unfinished")
    if "first_seconds" not in entry:
        return record
    warm = entry.get("warm_seconds") or []
    seconds = statistics.median(warm) if warm else None
    profile = entry.get("profile")
    floor_seconds = floor["floor_seconds"] if floor else None
    record.update(
        seconds=seconds,
        warm_seconds=warm,
        first_seconds=entry["first_seconds"],
        first_run_extra_seconds=entry["first_seconds"] - seconds if seconds else None,
        fresh_process=entry.get("fresh_process"),
        load_seconds=result.get("load_seconds"),
        tokenize_seconds=entry.get("tokenize_seconds"),
        prefill_tokens_computed=entry.get("prefill_tokens_computed"),
        output_tokens=entry.get("output_tokens"),
        iterations=entry.get("iterations"),
        floor_seconds=floor_seconds,
        x_floor=seconds / floor_seconds if seconds and floor_seconds else None,
        attention=result.get("attention"),
        busy_share=None,
        launches_per_iteration=None,
        gpu_figures=None if on_gpu else NOT_ON_CPU,
    )
    if profile:
        iterations = profile.get("iterations") or 0
        record.update(
            busy_share=profile["kernel_seconds"] / seconds if seconds else None,
            launches_per_iteration=profile["launches"] / iterations if iterations else None,
            profile=profile,
        )
    record["_token_ids"] = entry.get("token_ids")
    return record


def build_records(
    model: str,
    dtype: str,
    jobs: Sequence[dict],
    raw: dict[str, dict],
    floors: dict[str, dict],
    *,
    device: str,
) -> list[dict]:
    """One record per (job, system) of this model and dtype, from the systems' RESULTs
    (``gpu_worker``); ratios to HF filled in last (module doc)."""
    records = []
    for job in jobs:
        base = {
            "model": model,
            "dtype": dtype,
            "job": job["name"],
            "label": job_label(model, dtype, job["rows"]),
            "rows": job["rows"],
        }
        mine = [
            {**base, **_record(s, raw.get(s, {"error": "not run"}), job, floors.get(job["name"]),
                               device.startswith("cuda"))}
            for s in DISPLAY_ORDER
        ]  # fmt: skip
        hf = next((r for r in mine if r["system"] == "hf"), None)
        reference = hf.get("_token_ids") if hf is not None else None
        for record in mine:
            ids = record.pop("_token_ids", None)
            if reference is None or ids is None:
                record["agreement_with_hf"] = None
                continue
            same = [a == b for a, b in zip(ids, reference)]
            record["agreement_with_hf"] = sum(same) / len(same) if same else None
            record["agreeing_rows"] = sum(same)
            record["first_differing_row"] = next((i for i, s in enumerate(same) if not s), None)
            if record.get("seconds") and hf.get("seconds"):
                record["speedup_vs_hf"] = hf["seconds"] / record["seconds"]
        records += mine
    return records


def build_report(
    machine: dict, settings: dict, jobs: dict[str, dict], configs: list[dict], *, seconds: float
) -> dict[str, Any]:
    """The JSON report: machine, settings, jobs (their token counts), per (model, dtype) the
    shape, matmul rate and floors, and every record (``results``)."""
    summaries = {
        name: {
            key: job[key]
            for key in (
                "rows",
                "output_tokens",
                "hf_batch_size",
                "prompt_tokens",
                "min_prefill_tokens",
                "groups",
                "longest_prompt",
                "description",
                "params",
            )
        }  # fmt: skip
        for name, job in jobs.items()
    }
    for summary in summaries.values():
        summary["output_tokens_total"] = summary["rows"] * summary["output_tokens"]
    return {
        "machine": machine,
        "settings": settings,
        "jobs": summaries,
        "configs": [{k: v for k, v in c.items() if k != "records"} for c in configs],
        "results": [r for c in configs for r in c["records"]],
        "seconds": seconds,
    }


def _cell(record: dict | None, key: str, format_value) -> str:
    if record is None or record.get(key) is None:
        if (
            record is not None
            and record.get("gpu_figures")
            and key in ("busy_share", "launches_per_iteration")
        ):
            return NOT_ON_CPU
        return "-" if record is None or record["status"] == "ok" else record["status"]
    return format_value(record[key])


def _time_cell(record: dict | None) -> str:
    if record is None or record.get("seconds") is None:
        return "-" if record is None else record["status"]
    speedup = record.get("speedup_vs_hf")
    text = _figure(record["seconds"])
    if record["system"] != "hf" and speedup:
        text += f" ({speedup:.2f}x)"
    return text if record["status"] == "ok" else f"{text} ({record['status']})"


def _pair(records: list[dict | None], key: str, format_value) -> str:
    cells = [_cell(r, key, format_value) for r in records]
    return cells[0] if len(set(cells)) == 1 and cells[0] == NOT_ON_CPU else " / ".join(cells)


def markdown(report: dict[str, Any]) -> str:
    """The summary table (a row per job), every system's figures, the jobs."""
    machine, results = report["machine"], report["results"]
    lines = [
        "# bench gpu",
        "",
        f"Device {machine.get('gpu') or machine.get('cpu')} ({machine['device']}), "
        f"{machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}. Copy bandwidth {machine['copy_bandwidth'] / 1e9:,.0f} "
        "GB/s (read + written).",
        "",
    ]
    for config in report["configs"]:
        rate = (config["matmul_rate"].get(config["dtype"]) or {}).get("gflops")
        label = f"{SHAPE_LABELS.get(config['model'], config['model'])} {config['dtype']}"
        lines.append(f"- matmul rate, {label}: {_figure(rate)} GFLOP/s (torch linear, M=1024)")
    settings = report.get("settings") or {}
    lines += [
        "",
        f"Seconds of `generate`, median of {settings.get('repeat')} warm runs; native: (x faster "
        "than HF). floor: the job's FLOP at the matmul rate plus one read of the weights per "
        "decode step at the copy bandwidth. busy %: GPU time with work running (profiled run) / "
        "the warm median. launches/iter: kernel and graph launches / engine iterations. "
        "first-run extra: first run - warm median (a fresh process for the first job of each "
        "model and dtype). agreement: rows with HF's greedy token ids. Those four: native / "
        "native graphs off.",
        "",
        "| job | HF | native | native graphs off | floor | busy % | launches/iter "
        "| first-run extra | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        by = {r["system"]: r for r in results if r["label"] == label}
        native = [by.get("native"), by.get("native-graphs-off")]
        floor = next((r["floor_seconds"] for r in by.values() if r.get("floor_seconds")), None)
        lines.append(
            f"| {label} | {_time_cell(by.get('hf'))} | {_time_cell(native[0])} "
            f"| {_time_cell(native[1])} | {_figure(floor)} "
            f"| {_pair(native, 'busy_share', _percent)} "
            f"| {_pair(native, 'launches_per_iteration', _figure)} "
            f"| {_pair(native, 'first_run_extra_seconds', lambda v: f'{v:+.2f} s')} "
            f"| {_pair(native, 'agreement_with_hf', lambda v: f'{v:.3f}')} |"
        )
    lines += [
        "",
        "| job | system | warm s | first run s | first-run extra s | fresh process | x HF "
        "| x floor | busy % | launches/iter | iterations | prefill tokens | agreement | status |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r['error'] or '')[:80]}"
        lines.append(
            f"| {r['label']} | {r['system']} | {_cell(r, 'seconds', _figure)} "
            f"| {_cell(r, 'first_seconds', _figure)} | {_cell(r, 'first_run_extra_seconds', _figure)} "
            f"| {_cell(r, 'fresh_process', lambda v: 'yes' if v else 'no')} "
            f"| {_cell(r, 'speedup_vs_hf', lambda v: f'{v:.2f}x')} | {_cell(r, 'x_floor', _figure)} "
            f"| {_cell(r, 'busy_share', _percent)} | {_cell(r, 'launches_per_iteration', _figure)} "
            f"| {_cell(r, 'iterations', str)} | {_cell(r, 'prefill_tokens_computed', lambda v: f'{v:,}')} "
            f"| {_cell(r, 'agreement_with_hf', lambda v: f'{v:.3f}')} | {status.replace('|', '/')} |"
        )
    lines += [
        "",
        "| job | rows | prompt tokens | minimum prefill tokens | output tokens | groups | HF batch |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, job in report["jobs"].items():
        lines.append(
            f"| {name} | {job['rows']:,} | {job['prompt_tokens']:,} | {job['min_prefill_tokens']:,} "
            f"| {job['output_tokens_total']:,} | {job['groups']} | {job['hf_batch_size']} |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path, name: str) -> tuple[Path, Path]:
    """``<out>/<name>.json`` and ``.md``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    markdown_path.write_text(markdown(report))
    return json_path, markdown_path
