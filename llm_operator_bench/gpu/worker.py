"""One system of ``bench gpu`` in a fresh process: ``python -m llm_operator_bench.gpu.worker
JOB RESULT``.

JOB (JSON)::

    {"system": "native", "kind": "operator" | "static", "model": "/model/dir",
     "options": {...},     # LLMOperator keywords (operator) or device/dtype/batch_size (static)
     "repeat": 3, "profile": true,
     "jobs": [{"name", "prompts", "token_ids", "max_tokens": [per row], "batch_size"}]}

Per job, in order: the first run (the first of the process for the first job: what a fresh
executor pays, compiles included), ``repeat`` warm runs, then on CUDA with "profile" one run
under ``torch.profiler`` (``profile_run``). The RESULT file (JSON) is rewritten after every
run, so a run that times out keeps what finished: ``{"load_seconds", "device", "dtype",
"attention", "jobs": {name: {"first_seconds", "warm_seconds", "token_ids" (the first run's,
input order), "prefill_tokens_computed", "output_tokens", "iterations", "tokenize_seconds",
"profile"}}}``, plus ``{"error", "traceback"}`` when it failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_operator_bench.core.worker import OperatorSystem, StaticSystem

LAUNCH_EVENTS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
        "cuGraphLaunch",
    }
)
"""Host-side API calls that each start GPU work (a graph launch counts once)."""
TOP_KERNELS = 12


def _iterations(system: Any, rows: int, batch_size: int, max_tokens: int) -> int:
    """The native engine's iterations in its last run (``last_profile.iterations``); for HF
    ``generate``, its forward calls: batches x new tokens."""
    if isinstance(system, OperatorSystem):
        profile = getattr(system.operator.backend(), "last_profile", None)
        return int(getattr(profile, "iterations", 0) or 0)
    return -(-rows // batch_size) * max_tokens


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by (start_us, end_us) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def profile_run(run: Callable[[], Any]) -> dict[str, Any]:
    """One ``run()`` under ``torch.profiler`` (CPU and CUDA activity): ``wall_seconds``,
    ``kernel_seconds`` (GPU time with any kernel, copy or memset running: the union of their
    intervals), ``launches`` (host calls in LAUNCH_EVENTS), ``launches_by_name`` and the
    ``top_kernels`` by GPU time (name, seconds, count)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    intervals: list[tuple[float, float]] = []
    launches: dict[str, int] = {}
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if "CUDA" in str(getattr(event, "device_type", "")):
            start, end = event.time_range.start, event.time_range.end
            intervals.append((start, end))
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += (end - start) / 1e6
            entry[1] += 1
        elif event.name in LAUNCH_EVENTS:
            launches[event.name] = launches.get(event.name, 0) + 1
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {
        "wall_seconds": wall,
        "kernel_seconds": _union_seconds(intervals),
        "launches": sum(launches.values()),
        "launches_by_name": launches,
        "top_kernels": [[name[:120], seconds, int(count)] for name, (seconds, count) in top],
    }


def _load(job: dict[str, Any]) -> OperatorSystem | StaticSystem:
    options = dict(job.get("options") or {})
    if job["kind"] == "operator":
        return OperatorSystem(job["model"], options)
    if job["kind"] == "static":
        return StaticSystem(job["model"], options)
    raise ValueError(f"kind={job['kind']!r} is not 'operator' or 'static'")


def _timed(system: OperatorSystem | StaticSystem, workload: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    outcome = system.run(workload)
    return time.perf_counter() - started, outcome


def run_one(
    system: OperatorSystem | StaticSystem,
    spec: dict[str, Any],
    entry: dict[str, Any],
    *,
    repeat: int,
    profile: bool,
    write: Callable[[], None],
) -> None:
    """One job's first, ``repeat`` warm and (``profile``, on CUDA) profiled runs, recorded
    in ``entry``; ``write()`` after each."""
    rows = len(spec["token_ids"])
    workload = {
        "name": spec["name"],
        "prompts": spec["prompts"],
        "token_ids": spec["token_ids"],
        "max_tokens": spec["max_tokens"],
        "ignore_eos": True,
        "stop": [],
        "order": list(range(rows)),
    }
    steps = (system, rows, int(spec["batch_size"]), max(spec["max_tokens"]))
    if isinstance(system, StaticSystem):
        system.batch_size = int(spec["batch_size"])
    if isinstance(system, OperatorSystem):
        started = time.perf_counter()
        system.operator.tokenize(spec["prompts"])
        entry["tokenize_seconds"] = time.perf_counter() - started
    seconds, outcome = _timed(system, workload)
    entry.update(
        first_seconds=seconds,
        token_ids=outcome["token_ids"],
        prefill_tokens_computed=outcome["prefill_tokens_computed"],
        output_tokens=outcome["output_tokens"],
        iterations=_iterations(*steps),
    )
    write()
    for _ in range(repeat):
        entry["warm_seconds"].append(_timed(system, workload)[0])
        write()
    if profile and system.device is not None and system.device.type == "cuda":
        entry["profile"] = profile_run(lambda: system.run(workload))
        entry["profile"]["iterations"] = _iterations(*steps)
    entry["done"] = True
    write()


def run_job(job: dict[str, Any], write: Callable[[dict], None], log: Callable[[str], None]) -> dict:
    """Load the system, then run each job (``run_one``); ``write`` gets the result so far
    after every run (module doc)."""
    system = _load(job)
    config = getattr(getattr(system, "model", None), "config", None)
    result: dict[str, Any] = {
        "load_seconds": system.load_seconds,
        "device": str(system.device),
        "dtype": system.dtype,
        "attention": getattr(config, "_attn_implementation", None),
        "pid": os.getpid(),
        "jobs": {},
    }
    write(result)
    log(f"{job['system']}: loaded in {system.load_seconds:.1f} s")
    for spec in job["jobs"]:
        entry: dict[str, Any] = {"warm_seconds": [], "fresh_process": not result["jobs"]}
        result["jobs"][spec["name"]] = entry
        run_one(
            system,
            spec,
            entry,
            repeat=int(job.get("repeat", 3)),
            profile=bool(job.get("profile")),
            write=lambda: write(result),
        )
        log(
            f"{job['system']} / {spec['name']}: first run {entry['first_seconds']:.2f} s, "
            f"warm {', '.join(f'{s:.2f}' for s in entry['warm_seconds'])} s"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    job_path, result_path = argv if argv is not None else sys.argv[1:3]
    job = json.loads(Path(job_path).read_text())
    target = Path(result_path)
    latest: dict[str, Any] = {}

    def write(result: dict) -> None:
        latest.clear()
        latest.update(result)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(result))
        partial.replace(target)

    try:
        run_job(job, write, log=lambda message: print(message, file=sys.stderr, flush=True))
    except Exception as error:  # reported to the parent, which records the system as failed
        write(
            {
                **latest,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
