"""``llm-operator bench``: every system on every workload, side by side in one run.

The parent process builds the workloads and tokenizes them once (the same token ids go to
every system), then runs each system in a subprocess (``bench.worker``; vLLM through
``bench.vllm_systems``) and collects one record per (system, workload). Metrics are
computed here, from what the systems returned, the same way for all of them.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llm_operator.bench.systems import BASELINE, VLLM_REFERENCE, SystemSpec

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- workloads -------------------------------------------------------------------------
def prepare_workloads(operator, names: Sequence[str], *, size: str, seed: int) -> list[dict]:
    """Build, tokenize and plan each workload; rows that cannot run are a ValueError."""
    from llm_operator import SamplingParams
    from llm_operator.bench.workloads import make_workload

    prepared = []
    for name in names:
        workload = make_workload(name, operator.tokenizer, size=size, seed=seed)
        token_ids = operator.tokenize(workload.prompts)
        bad = [row for row, ids in enumerate(token_ids) if ids is None]
        if bad:
            longest = max(len(ids or ()) for ids in token_ids)
            raise ValueError(
                f"workload {name!r} (size {size!r}) has {len(bad)} rows this model cannot take "
                f"(its context is {operator.max_context} tokens; choose a smaller --size)"
                if longest <= operator.max_context
                else f"workload {name!r} (size {size!r}) has prompts longer than the model's "
                f"context of {operator.max_context} tokens; choose a smaller --size"
            )
        too_long = [
            row
            for row, ids in enumerate(token_ids)
            if len(ids) + workload.max_tokens[row] > operator.max_context
        ]
        if too_long:
            raise ValueError(
                f"workload {name!r} (size {size!r}): {len(too_long)} rows would outgrow the "
                f"model's context of {operator.max_context} tokens; choose a smaller --size"
            )
        plan = operator.plan(
            workload.prompts, [SamplingParams(max_tokens=m) for m in workload.max_tokens]
        )
        shuffled = list(range(len(token_ids)))
        random.Random(seed).shuffle(shuffled)
        prepared.append(
            {
                "name": name,
                "description": workload.description,
                "params": workload.params,
                "prompts": workload.prompts,
                "token_ids": token_ids,
                "max_tokens": list(workload.max_tokens),
                "input_order": list(range(len(token_ids))),
                "shuffled_order": shuffled,
                "summary": {
                    "rows": len(token_ids),
                    "prompt_tokens": plan.stats.prompt_tokens,
                    "min_prefill_tokens": plan.stats.unique_tokens,
                    "planned_prefill_tokens": plan.stats.prefill_tokens,
                    "groups": plan.stats.groups,
                    "max_tokens_total": sum(workload.max_tokens),
                    "longest_prompt": max(len(ids) for ids in token_ids),
                },
            }
        )
    return prepared


# -- running systems -------------------------------------------------------------------
def _order(workload: dict, spec: SystemSpec) -> list[int]:
    return workload["shuffled_order"] if spec.shuffled else workload["input_order"]


def run_worker_system(
    spec: SystemSpec,
    model_path: str,
    workloads: list[dict],
    *,
    repeat: int,
    options: dict[str, Any],
    timeout: float | None,
    log: Log,
    python: str | None = None,
) -> dict:
    """Run a "static" or "operator" system in a ``bench.worker`` subprocess (in ``python``,
    default this interpreter); its RESULT dict."""
    job = {
        "system": spec.name,
        "kind": spec.kind,
        "model": model_path,
        "options": {**spec.options, **options},
        "repeat": repeat,
        "warmup": True,
        "workloads": [
            {
                "name": w["name"],
                "prompts": w["prompts"],
                "token_ids": w["token_ids"],
                "max_tokens": w["max_tokens"],
                "order": _order(w, spec),
            }
            for w in workloads
        ],
    }
    with tempfile.TemporaryDirectory(prefix="llm-operator-bench-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        command = [
            python or sys.executable,
            "-m",
            "llm_operator.bench.worker",
            str(job_path),
            str(result_path),
        ]
        try:
            subprocess.run(command, timeout=timeout, check=False, env=_child_env())
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if not result_path.exists():
            return {"error": "the worker process died without a result (out of memory?)"}
        return json.loads(result_path.read_text())


def run_vllm_systems(
    specs: list[SystemSpec],
    model_path: str,
    workloads: list[dict],
    *,
    repeat: int,
    kv_cache_gib: float,
    block_size: int | None,
    eager: bool,
    python: str | None,
    timeout: float | None,
    log: Log,
) -> dict[str, dict]:
    """Run the vLLM systems, one engine per prefix-caching setting; RESULT dict per system."""
    from llm_operator.bench.vllm_systems import VLLMRunError, VLLMUnavailable, run_vllm_job

    results: dict[str, dict] = {}
    for caching in (True, False):
        group = [s for s in specs if s.options.get("prefix_caching", True) == caching]
        if not group:
            continue
        runs = [
            {
                "name": f"{spec.name}/{w['name']}",
                "prompts": w["token_ids"],
                "max_tokens": w["max_tokens"],
                "order": _order(w, spec),
            }
            for spec in group
            for w in workloads
        ]
        job = {
            "model": model_path,
            "dtype": "float32",
            "prefix_caching": caching,
            "prompts": [],
            "max_tokens": [],
            "runs": runs,
            "repeat": repeat,
            "kv_cache_gib": kv_cache_gib,
            "block_size": block_size,
            "enforce_eager": True if eager else None,
            "max_model_len": max(
                len(ids) + m for w in workloads for ids, m in zip(w["token_ids"], w["max_tokens"])
            ),
            "warmup": True,
        }
        try:
            result = run_vllm_job(job, python=python, timeout=timeout)
        except VLLMUnavailable as error:
            for spec in group:
                results[spec.name] = {"skipped": str(error)}
            continue
        except (VLLMRunError, subprocess.TimeoutExpired) as error:
            for spec in group:
                results[spec.name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        by_name = {run["name"]: run for run in result["runs"]}
        for spec in group:
            results[spec.name] = {
                "load_seconds": result.get("load_seconds"),
                "device": result.get("device", "cpu"),
                "vllm_version": result.get("vllm_version"),
                "kv_cache_tokens": result.get("kv_cache_tokens"),
                "block_size": result.get("block_size"),
                "runs": [
                    {
                        **by_name[f"{spec.name}/{w['name']}"],
                        "workload": w["name"],
                        "peak_device_bytes": None,
                    }
                    for w in workloads
                ],
            }
    return results


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


# -- metrics ---------------------------------------------------------------------------
def _normalize(ids: Sequence[int], eos_ids: set[int]) -> list[int]:
    """Generated ids without trailing EOS (systems differ in whether they keep it)."""
    ids = list(ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def build_records(
    specs: list[SystemSpec],
    raw: dict[str, dict],
    workloads: list[dict],
    eos_ids: set[int],
) -> list[dict]:
    """One record per (system, workload) with every metric, ratios filled in last."""
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    records = []
    for spec in specs:
        result = raw.get(spec.name, {"error": "not run"})
        runs = {run["workload"]: run for run in result.get("runs", [])}
        for w in workloads:
            summary = w["summary"]
            record: dict[str, Any] = {
                "system": spec.name,
                "workload": w["name"],
                "description": spec.description,
                "status": "ok",
                "error": None,
                "rows": summary["rows"],
                "prompt_tokens": summary["prompt_tokens"],
                "min_prefill_tokens": summary["min_prefill_tokens"],
            }
            run = runs.get(w["name"])
            if "skipped" in result:
                record.update(status="skipped", error=result["skipped"])
                records.append(record)
                continue
            if "error" in result or run is None:
                record.update(status="failed", error=result.get("error", "no result"))
                records.append(record)
                continue
            generated = [_normalize(ids, eos_ids) for ids in run["token_ids"]]
            outputs[(spec.name, w["name"])] = generated
            seconds = statistics.median(run["seconds"])
            output_tokens = sum(len(ids) for ids in generated)
            record.update(
                load_seconds=result.get("load_seconds"),
                seconds=seconds,
                seconds_all=run["seconds"],
                output_tokens=output_tokens,
                output_tokens_per_second=output_tokens / seconds if seconds else None,
                rows_per_second=summary["rows"] / seconds if seconds else None,
                prefill_tokens_computed=run["prefill_tokens_computed"],
                prefill_vs_min=run["prefill_tokens_computed"] / summary["min_prefill_tokens"],
                peak_rss_bytes=run.get("peak_rss_bytes"),
                peak_device_bytes=run.get("peak_device_bytes"),
                device=result.get("device"),
            )
            records.append(record)
    for record in records:
        if record["status"] != "ok":
            continue
        baseline = outputs.get((BASELINE, record["workload"]))
        mine = outputs[(record["system"], record["workload"])]
        record["agreement_with_hf_static"] = (
            sum(a == b for a, b in zip(mine, baseline)) / len(mine) if baseline else None
        )
        for key, reference in (("vs_hf_static", BASELINE), ("vs_vllm", VLLM_REFERENCE)):
            other = next(
                (
                    r
                    for r in records
                    if r["system"] == reference
                    and r["workload"] == record["workload"]
                    and r["status"] == "ok"
                ),
                None,
            )
            record[f"speedup_{key}"] = other["seconds"] / record["seconds"] if other else None
    return records


# -- machine ---------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from llm_operator.config import physical_memory_bytes

    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": physical_memory_bytes(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
