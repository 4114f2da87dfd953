"""``llm-operator bench gpu``: the native engine against HF ``generate`` and the hardware, in
one command with no network and no downloaded weights.

The parent process builds the random-weight models and the jobs (``bench.gpu.models``),
tokenizes and plans each job once, measures the device's copy bandwidth and, per model and
dtype, its matmul rate (``bench.core.rate``), then runs each system in its own process per
(model, dtype) (``bench.gpu.worker``): its first job's first run is a fresh process's,
later jobs' first runs pay only their new shapes. Systems: ``hf`` (plain HF ``generate``,
left-padded batches, sdpa, greedy), ``native`` (``LLMOperator(backend="native")`` with its
defaults) and ``native-graphs-off`` (the same with ``cuda_graphs="off"``). Every row decodes
exactly its output tokens (EOS ignored). Results go to ``<out>/<name>.json`` and ``.md``
after every (model, dtype), so a run cut short keeps what finished (``bench.gpu.report``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_operator_bench.core.flops import model_shape
from llm_operator_bench.core.rate import measure_matmul_rate, rate_for
from llm_operator_bench.core.runner import Log, _child_env, _stderr, machine_info, now
from llm_operator_bench.gpu.floor import job_floor, measure_copy_bandwidth
from llm_operator_bench.gpu.models import JOB_NAMES, SHAPES, build_job, build_model, tokenizer_dir

SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("static", {}),
    "native": ("operator", {"backend": "native"}),
    "native-graphs-off": ("operator", {"backend": "native", "cuda_graphs": "off"}),
}
"""name: (gpu_worker kind, options). Run in this order; ``hf`` is the agreement reference."""
RUN_ORDER = ("native", "hf", "native-graphs-off")
DEFAULT_MODELS = ("135m", "1b", "3b")
FP32_MODELS = ("135m", "3b")  # the default dtypes: bf16 everywhere, fp32 on these (etl-128)
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32",
               "float32": "float32", "fp16": "float16", "float16": "float16"}  # fmt: skip
DEFAULT_BUDGET = 480.0  # seconds of the whole default-size run (an H200 lends 15 minutes)
DEFAULT_TIMEOUT = {"default": 300.0, "tiny": 120.0}
MIN_SECONDS_TO_START = 20.0  # a system needs at least this much of the budget left to start


def plan_runs(
    *,
    size: str,
    models: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    jobs: Sequence[str] | None = None,
) -> list[tuple[str, str, tuple[str, ...]]]:
    """(model, dtype, jobs) in run order. Defaults: at size "default" models 135m, 1b, 3b in
    bf16 on both jobs, then 135m and 3b in fp32 on etl-128; at "tiny" the tiny model in fp32
    on both jobs. Given ``dtypes`` or ``jobs`` apply to every model."""
    for name, values, known in (("models", models, SHAPES), ("jobs", jobs, JOB_NAMES)):
        unknown = [v for v in values or () if v not in known]
        if unknown or (values is not None and not values):
            raise ValueError(f"{name}={list(values or [])!r}: choose from {', '.join(known)}")
    bad = [d for d in dtypes or () if d.lower() not in DTYPE_NAMES]
    if bad or (dtypes is not None and not dtypes):
        raise ValueError(f"dtypes={list(dtypes or [])!r}: choose from {', '.join(DTYPE_NAMES)}")
    chosen_dtypes = [DTYPE_NAMES[d.lower()] for d in dtypes] if dtypes else None
    models = list(models or (("tiny",) if size == "tiny" else DEFAULT_MODELS))
    plan: list[tuple[str, str, tuple[str, ...]]] = []
    for half in (True, False):  # half-precision runs first, then fp32 (the report's order)
        for model in models:
            default = ["float32"] if size == "tiny" else ["bfloat16"]
            if size != "tiny" and model in FP32_MODELS:
                default.append("float32")
            for dtype in dict.fromkeys(chosen_dtypes or default):
                if (dtype != "float32") != half:
                    continue
                names = jobs or (
                    JOB_NAMES if dtype != "float32" or size == "tiny" else JOB_NAMES[:1]
                )
                plan.append((model, dtype, tuple(dict.fromkeys(names))))
    return plan


def prepare_jobs(names: Sequence[str], model_dir: Path, *, size: str, seed: int) -> dict[str, dict]:
    """Each job built, tokenized (chat template applied) and planned, through an LLMOperator
    on ``model_dir`` (its tokenizer only: no weights load); ValueError for a row that cannot
    run."""
    from llm_operator import LLMOperator, SamplingParams

    operator = LLMOperator(str(model_dir))
    prepared = {}
    for name in names:
        job = build_job(name, operator.tokenizer, size=size, seed=seed)
        token_ids = operator.tokenize(job["prompts"])
        too_long = [
            row
            for row, ids in enumerate(token_ids)
            if ids is None or len(ids) + job["output_tokens"] > operator.max_context
        ]
        if too_long:
            raise ValueError(f"job {name!r}: rows {too_long[:5]} do not fit the model's context")
        plan = operator.plan(job["prompts"], SamplingParams(max_tokens=job["output_tokens"]))
        prepared[name] = {
            **job,
            "token_ids": token_ids,
            "prompt_tokens": sum(len(ids) for ids in token_ids),
            "min_prefill_tokens": plan.stats.unique_tokens,
            "groups": plan.stats.groups,
            "longest_prompt": max(len(ids) for ids in token_ids),
        }
    return prepared


def run_system(
    system: str, model_dir: Path, dtype: str, device: str, jobs: Sequence[dict], *,
    repeat: int, timeout: float, log: Log,
) -> dict[str, Any]:  # fmt: skip
    """``system`` on ``jobs`` in a ``gpu_worker`` process; its RESULT, with "error" when it
    failed, died or ran past ``timeout`` seconds (what finished before stays)."""
    kind, options = SYSTEMS[system]
    job = {
        "system": system,
        "kind": kind,
        "model": str(model_dir),
        "options": {**options, "device": device, "dtype": dtype},
        "repeat": repeat,
        "profile": kind == "operator",
        "jobs": [
            {
                "name": j["name"],
                "prompts": j["prompts"],
                "token_ids": j["token_ids"],
                "max_tokens": [j["output_tokens"]] * j["rows"],
                "batch_size": j["hf_batch_size"],
            }
            for j in jobs
        ],
    }
    with tempfile.TemporaryDirectory(prefix="llm-operator-gpu-bench-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        command = [
            sys.executable,
            "-m",
            "llm_operator_bench.gpu.worker",
            str(job_path),
            str(result_path),
        ]
        error = None
        try:
            completed = subprocess.run(command, timeout=timeout, check=False, env=_child_env())
            if completed.returncode != 0 and completed.returncode != 1:
                error = f"the worker process died (exit status {completed.returncode})"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if error is not None:
        result["error"] = error
    elif not result:
        result["error"] = "the worker process left no result"
    if "error" in result:
        log(f"bench gpu: {system} failed: {result['error']}")
    return result


def run_gpu_bench(
    *,
    size: str = "default",
    models: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    jobs: Sequence[str] | None = None,
    repeat: int = 3,
    device: str | None = None,
    tokenizer: str | Path | None = None,
    out: Path = Path("bench-results"),
    name: str = "bench-gpu",
    timeout: float | None = None,
    budget: float | None = None,
    cache_dir: Path | None = None,
    seed: int = 0,
    log: Log = _stderr,
) -> dict[str, Any]:
    """Run every (model, dtype, job, system) of ``plan_runs`` and return the report
    (``gpu_report.build_report``), also written to ``<out>/<name>.json`` and ``.md``.

    ``timeout``: seconds per system process (default 300; 120 at "tiny"). ``budget``:
    seconds for the whole run (default 480 at "default", none at "tiny"); a system that
    would start with under MIN_SECONDS_TO_START left is skipped and recorded so.
    """
    import torch
    from transformers import AutoConfig

    from llm_operator.models import default_cache_dir, resolve_device
    from llm_operator_bench.gpu.report import build_records, build_report, write_report

    started = time.perf_counter()
    if size not in DEFAULT_TIMEOUT:
        raise ValueError(f"size={size!r} is not one of {', '.join(DEFAULT_TIMEOUT)}")
    if repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be >= 1")
    plan = plan_runs(size=size, models=models, dtypes=dtypes, jobs=jobs)
    device = str(resolve_device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    timeout = timeout or DEFAULT_TIMEOUT[size]
    budget = budget if budget is not None else (DEFAULT_BUDGET if size == "default" else None)
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "gpu-bench"
    folder = tokenizer_dir(tokenizer)
    # the jobs are tokenized and planned through the tiny model (its tokenizer is theirs)
    names = list(dict.fromkeys(job for _, _, names in plan for job in names))
    tiny = build_model("tiny", folder, cache, device="cpu", seed=seed)
    prepared = prepare_jobs(names, tiny, size=size, seed=seed)
    bandwidth = measure_copy_bandwidth(device)
    log(f"bench gpu: {device} copies at {bandwidth / 1e9:,.0f} GB/s (read + written)")
    machine = {**machine_info(), "device": device, "copy_bandwidth": bandwidth}
    settings = {"size": size, "repeat": repeat, "timeout": timeout, "budget": budget,
                "seed": seed, "tokenizer": str(folder), "started": now()}  # fmt: skip
    configs: list[dict[str, Any]] = []
    report = build_report(machine, settings, prepared, configs, seconds=0.0)
    write_report(report, Path(out), name)  # the jobs' token counts, before any system runs
    model_dirs: dict[str, Path] = {"tiny": tiny}

    def left() -> float | None:
        return None if budget is None else budget - (time.perf_counter() - started)

    for model, dtype, job_names in plan:
        config_jobs = [prepared[n] for n in job_names]
        config: dict[str, Any] = {"model": model, "dtype": dtype, "floors": {}, "matmul_rate": {}}
        raw: dict[str, dict] = {}
        try:
            if (budget_left := left()) is not None and budget_left < MIN_SECONDS_TO_START:
                raise TimeoutError(f"the --budget of {budget:.0f} s was used up")
            if model not in model_dirs:
                log(f"bench gpu: the {model} model (random weights, cached in {cache})")
                model_dirs[model] = build_model(model, folder, cache, device=device, seed=seed)
            shape = model_shape(AutoConfig.from_pretrained(model_dirs[model]))
            rates = measure_matmul_rate(shape, dtypes=[dtype], device=device)
            rate = rate_for(rates, dtype)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            config.update(
                model_dir=str(model_dirs[model]), shape=shape._asdict(), matmul_rate=rates
            )
            if rate:
                config["floors"] = {
                    j["name"]: job_floor(
                        shape, j, dtype=dtype, rate_gflops=rate, bandwidth=bandwidth
                    )
                    for j in config_jobs
                }
        except TimeoutError as error:
            raw = {system: {"skipped": str(error)} for system in RUN_ORDER}
        except Exception as error:  # a model that cannot be built: its systems fail, the rest run
            log(f"bench gpu: the {model} model failed: {type(error).__name__}: {error}")
            raw = {
                system: {"error": f"the model: {type(error).__name__}: {error}"}
                for system in RUN_ORDER
            }
        for system in RUN_ORDER:
            if system in raw:
                continue
            seconds_left = left()
            if seconds_left is not None and seconds_left < MIN_SECONDS_TO_START:
                raw[system] = {"skipped": f"the --budget of {budget:.0f} s was used up"}
                continue
            log(f"bench gpu: {system} on {model} {dtype} ({', '.join(job_names)})")
            raw[system] = run_system(
                system, model_dirs[model], dtype, device, config_jobs, repeat=repeat,
                timeout=timeout if seconds_left is None else min(timeout, seconds_left), log=log,
            )  # fmt: skip
        config["records"] = build_records(
            model, dtype, config_jobs, raw, config["floors"], device=device
        )
        configs.append(config)
        report = build_report(
            machine, settings, prepared, configs, seconds=time.perf_counter() - started
        )
        write_report(report, Path(out), name)
    return report
