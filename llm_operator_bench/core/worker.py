"""One benchmarked system in its own process:
``python -m llm_operator_bench.core.worker JOB RESULT``.

A fresh process per system keeps the figures apart: model load time, peak memory (the
process's peak resident set, reset before each run) and no state left by another system.

JOB (JSON)::

    {"system": "hf", "kind": "operator" | "static", "model": "/model/dir",
     "options": {...},            # LLMOperator keywords (operator) or {"batch_size": 16} (static)
     "repeat": 1, "warmup": true,
     "workloads": [{"name": ..., "prompts": [...], "token_ids": [[...]], "max_tokens": [...],
                    "ignore_eos": false, "order": [row indices in submission order],
                    "stop": ["\n"],                 # optional: every row's stop strings
                    "choices": [[labels] per row]}]}  # optional (operator): constrained rows

RESULT (JSON): ``{"load_seconds", "device", "dtype" (the weights', e.g. "float32"),
"torch_threads", "runs": [{"workload", "seconds": [per repeat], "token_ids" (input order,
first repeat), "prompt_tokens", "prefill_tokens_computed", "output_tokens",
"peak_rss_bytes", "peak_device_bytes", "decode_profile" (native backend only, when it
lists its steps: ``bench.core.decode_steps``; first repeat), "decode_profiles" (every
repeat's)}]}``, or ``{"error", "traceback"}`` with exit status 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from llm_operator_bench.core.decode_steps import backend_decode_profile


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux; a no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int | None:
    """The process's peak resident set since the last reset (VmHWM), or None if unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> _Timer:
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._started


def _device_peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _device_peak(device) -> int | None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    return None


def _in_order(order: list[int], outputs: list[Any]) -> list[Any]:
    """Outputs produced in submission ``order`` back to input order."""
    result: list[Any] = [None] * len(order)
    for position, row in enumerate(order):
        result[row] = outputs[position]
    return result


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def backend_dtype(backend: Any) -> str | None:
    """The dtype a backend computes in ("float32", "bfloat16", ...), or None if unknown."""
    llm = getattr(backend, "llm", None)
    if llm is not None:  # backend="vllm": what the engine resolved, not the requested "auto"
        try:
            return _dtype_name(llm.llm_engine.vllm_config.model_config.dtype)
        except AttributeError:
            pass
    model = getattr(backend, "model", None)
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        first = next(iter(parameters()), None)
        if first is not None:
            return _dtype_name(first.dtype)
    return _dtype_name(getattr(backend, "dtype", None))


def _sampling(workload: dict[str, Any], row: int) -> Any:
    """A row's SamplingParams: its max_tokens, the workload's ignore_eos, and either its
    choices (when the job gives them) or the workload's stop strings."""
    from llm_operator import SamplingParams

    options: dict[str, Any] = {
        "max_tokens": workload["max_tokens"][row],
        "ignore_eos": bool(workload.get("ignore_eos", False)),
    }
    choices = workload.get("choices")
    if choices is not None and choices[row] is not None:
        options["choices"] = tuple(choices[row])
    elif workload.get("stop"):
        options["stop"] = tuple(workload["stop"])
    return SamplingParams(**options)


class OperatorSystem:
    """Our LLMOperator (any backend and ablation), fed the original prompts."""

    def __init__(self, model: str, options: dict[str, Any]) -> None:
        from llm_operator import LLMOperator

        options.setdefault("quantization", "none")  # float weights unless the system says
        self.operator = LLMOperator(model, **options)
        with _Timer() as timer:
            backend = self.operator.backend()
            if callable(getattr(backend, "engine", None)):
                backend.engine()  # vLLM starts here, not in a timed run
        self.load_seconds = timer.seconds
        self.device = getattr(backend, "device", None)
        self.dtype = backend_dtype(backend)

    def run(self, workload: dict[str, Any]) -> dict[str, Any]:
        llm = getattr(self.operator.backend(), "llm", None)
        if llm is not None:  # backend="vllm": no run starts with another run's cached prefixes
            llm.reset_prefix_cache()
        order = workload["order"]
        prompts = [workload["prompts"][row] for row in order]
        sampling = [_sampling(workload, row) for row in order]
        results = self.operator.generate(prompts, sampling)
        failed = [r.error for r in results if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} rows failed, first: {failed[0]}")
        stats = self.operator.last_stats
        outcome = {
            "token_ids": _in_order(order, [list(r.token_ids) for r in results]),
            "prefill_tokens_computed": stats.prefill_tokens_computed,
            "output_tokens": stats.output_tokens,
        }
        if stats.engine_paths:  # how the native engine ran its steps
            outcome["engine_paths"] = stats.engine_paths
        model = getattr(self.operator.backend(), "model", None)
        if callable(getattr(model, "weight_bytes", None)):
            outcome["weight_bytes"] = model.weight_bytes()
        decode = backend_decode_profile(self.operator.backend())
        if decode is not None:
            outcome["decode_profile"] = decode
        return outcome


class StaticSystem:
    """Hugging Face ``generate`` on fixed-size batches in submission order."""

    def __init__(self, model: str, options: dict[str, Any]) -> None:
        from transformers.utils import logging as hf_logging

        from llm_operator.models import (
            load_causal_lm,
            load_tokenizer,
            resolve_device,
            resolve_dtype,
            resolve_model,
        )

        hf_logging.disable_progress_bar()  # the worker logs its own lines
        path = resolve_model(model).path
        self.device = resolve_device(options.get("device", "auto"))
        dtype = resolve_dtype(options.get("dtype", "auto"), self.device)
        self.dtype = _dtype_name(dtype)
        self.batch_size = int(options.get("batch_size", 16))
        self.tokenizer = load_tokenizer(path)
        with _Timer() as timer:
            self.model = load_causal_lm(path, device=self.device, dtype=dtype)
        self.load_seconds = timer.seconds

    def run(self, workload: dict[str, Any]) -> dict[str, Any]:
        from llm_operator_bench.baselines.hf_static import run_hf_static

        order = workload["order"]
        static = run_hf_static(
            self.model,
            self.tokenizer,
            [workload["token_ids"][row] for row in order],
            max_tokens=[workload["max_tokens"][row] for row in order],
            batch_size=self.batch_size,
            stop=tuple(workload.get("stop") or ()),
            ignore_eos=bool(workload.get("ignore_eos", False)),
        )
        return {
            "token_ids": _in_order(order, static.token_ids),
            "prefill_tokens_computed": static.padded_prompt_tokens,
            "output_tokens": static.output_tokens,
        }


SYSTEM_KINDS = {"operator": OperatorSystem, "static": StaticSystem}


def run_job(job: dict[str, Any], log=lambda message: None) -> dict[str, Any]:
    """Load the system once, then time every workload ``repeat`` times (after a warm-up)."""
    system = SYSTEM_KINDS[job["kind"]](job["model"], dict(job.get("options") or {}))
    device = system.device
    log(f"{job['system']}: model loaded in {system.load_seconds:.1f} s")
    runs = []
    for workload in job["workloads"]:
        if job.get(
            "warmup", True
        ):  # one short request: lazy initialisation stays out of the timing
            first = workload["order"][0]
            choices = workload.get("choices")
            system.run(
                {
                    "prompts": [workload["prompts"][first]],
                    "token_ids": [workload["token_ids"][first]],
                    "max_tokens": [2],
                    "order": [0],
                    "stop": workload.get("stop") or [],
                    **({"choices": [choices[first]]} if choices else {}),
                }
            )
        seconds, first_run, decode_profiles = [], None, []
        for repeat in range(int(job.get("repeat", 1))):
            reset_peak_rss()
            if device is not None:
                _device_peak_reset(device)
            with _Timer() as timer:
                outcome = system.run(workload)
            seconds.append(timer.seconds)
            decode_profiles.append(outcome.get("decode_profile"))
            log(
                f"{job['system']} / {workload['name']}: run {repeat + 1} took {timer.seconds:.2f} s"
            )
            if first_run is None:
                first_run = outcome
                first_run["peak_rss_bytes"] = peak_rss_bytes()
                first_run["peak_device_bytes"] = (
                    _device_peak(device) if device is not None else None
                )
        runs.append(
            {
                "workload": workload["name"],
                "seconds": seconds,
                "prompt_tokens": sum(len(ids) for ids in workload["token_ids"]),
                **first_run,
                "decode_profiles": decode_profiles,
            }
        )
    import torch

    return {
        "load_seconds": system.load_seconds,
        "device": str(device),
        "dtype": system.dtype,
        "torch_threads": torch.get_num_threads(),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    job_path, result_path = argv if argv is not None else sys.argv[1:3]
    job = json.loads(Path(job_path).read_text())
    try:
        result = run_job(job, log=lambda message: print(message, file=sys.stderr, flush=True))
    except Exception as error:  # reported to the parent, which marks the system failed
        Path(result_path).write_text(
            json.dumps(
                {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            )
        )
        return 1
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
