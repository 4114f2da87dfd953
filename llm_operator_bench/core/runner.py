"""``llm-operator bench``: every system on every workload, side by side in one run.

The parent process builds the workloads and tokenizes them once (the same token ids go to
every system), then runs each system in a subprocess (``bench.core.worker``; vLLM through
``bench.baselines.vllm_systems``); ``bench.core.records`` turns what they returned into one
record per (system, workload), the same way for all of them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llm_operator_bench.core.systems import SystemSpec, runs_on

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- workloads -------------------------------------------------------------------------
def prepare_workloads(operator, names: Sequence[str], *, size: str, seed: int) -> list[dict]:
    """Build, tokenize and plan each workload; rows that cannot run are a ValueError."""
    from llm_operator import SamplingParams
    from llm_operator_bench.core.workloads import make_workload

    prepared = []
    for name in names:
        workload = make_workload(name, operator.tokenizer, size=size, seed=seed)
        if not getattr(operator.tokenizer, "chat_template", None):
            workload = plain_text_workload(workload)
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
                "ignore_eos": workload.ignore_eos,
                "stop": list(workload.stop),
                "choices": workload.choices,
                "gold": workload.gold,
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
                    "ignore_eos": workload.ignore_eos,
                    "stop": list(workload.stop),
                    "labelled": workload.gold is not None,
                },
            }
        )
    return prepared


def plain_text_workload(workload):
    """The workload with its chat prompts rendered as plain text, for a model without a
    chat template (a base model such as Gemma 3 270M): each message a "role: content"
    paragraph, then "assistant:". The sharing structure (which rows share which leading
    messages) stays as it was; every system gets the same strings."""
    import dataclasses

    def render(prompt):
        if isinstance(prompt, str):
            return prompt
        turns = [f"{message['role']}: {message['content']}" for message in prompt]
        return "\n\n".join(turns) + "\n\nassistant:"

    return dataclasses.replace(
        workload,
        prompts=[render(prompt) for prompt in workload.prompts],
        description=workload.description + " (rendered as plain text: no chat template)",
    )


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
    env: dict[str, str] | None = None,
) -> dict:
    """Run a "static" or "operator" system in a ``bench.core.worker`` subprocess (in ``python``,
    default this interpreter; ``env``: variables added to its environment) on the workloads
    it runs (``systems.runs_on``); its RESULT dict. ``spec.dtype`` goes in as the "dtype"
    option; a choices system gets the rows' labels as "choices"."""
    dtype = {"dtype": spec.dtype} if spec.dtype is not None else {}
    job = {
        "system": spec.name,
        "kind": spec.kind,
        "model": model_path,
        "options": {**spec.options, **dtype, **options},
        "repeat": repeat,
        "warmup": True,
        "workloads": [
            {
                "name": w["name"],
                "prompts": w["prompts"],
                "token_ids": w["token_ids"],
                "max_tokens": w["max_tokens"],
                "ignore_eos": w["ignore_eos"],
                "stop": w["stop"],
                **({"choices": w["choices"]} if spec.choices else {}),
                "order": _order(w, spec),
            }
            for w in workloads
            if runs_on(spec, w)
        ],
    }
    with tempfile.TemporaryDirectory(prefix="llm-operator-bench-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        command = [
            python or sys.executable,
            "-m",
            "llm_operator_bench.core.worker",
            str(job_path),
            str(result_path),
        ]
        try:
            subprocess.run(
                command, timeout=timeout, check=False, env={**_child_env(), **(env or {})}
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if not result_path.exists():
            return {"error": "the worker process died without a result (out of memory?)"}
        return json.loads(result_path.read_text())


def vllm_engine_settings(spec: SystemSpec, block_size: int | None) -> tuple[bool, str, int | None]:
    """(prefix caching, dtype, KV block size) of a plain vLLM system: its own dtype (default
    float32) and block size, else ``block_size`` (``--vllm-block-size``; None: vLLM's)."""
    return (
        bool(spec.options.get("prefix_caching", True)),
        spec.dtype or "float32",
        spec.block_size if spec.block_size is not None else block_size,
    )


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
    """Run the vLLM systems, one engine per distinct ``vllm_engine_settings``; RESULT dict
    per system."""
    from llm_operator_bench.baselines.vllm_systems import (
        VLLMRunError,
        VLLMUnavailable,
        run_vllm_job,
    )

    results: dict[str, dict] = {}
    engines: dict[tuple[bool, str, int | None], list[SystemSpec]] = {}
    for spec in specs:
        engines.setdefault(vllm_engine_settings(spec, block_size), []).append(spec)
    for (caching, dtype, engine_block_size), group in engines.items():
        log(
            f"bench: vLLM engine (prefix caching {'on' if caching else 'off'}, {dtype}, "
            f"block {engine_block_size or 'default'}) for {', '.join(s.name for s in group)}"
        )
        runs = [
            {
                "name": f"{spec.name}/{w['name']}",
                "prompts": w["token_ids"],
                "max_tokens": w["max_tokens"],
                "ignore_eos": w["ignore_eos"],
                # free generation ends at the stop strings; a choices run needs none
                **({"choices": w["choices"]} if spec.choices else {"stop": w["stop"]}),
                "order": _order(w, spec),
            }
            for spec in group
            for w in workloads
            if runs_on(spec, w)
        ]
        job = {
            "model": model_path,
            "dtype": dtype,
            "prefix_caching": caching,
            "prompts": [],
            "max_tokens": [],
            "runs": runs,
            "repeat": repeat,
            "kv_cache_gib": kv_cache_gib,
            "block_size": engine_block_size,
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
        engine = {
            key: result.get(key)
            for key in (
                "load_seconds",
                "vllm_version",
                "kv_cache_tokens",
                "block_size",
                "dtype",
                "torch_threads",
                "in_process_engine",
                "engine_core_client",
            )
        }
        for spec in group:
            results[spec.name] = {
                **engine,
                "dtype": result.get("dtype") or dtype,
                "device": result.get("device", "cpu"),
                "runs": [
                    {
                        **by_name[f"{spec.name}/{w['name']}"],
                        "workload": w["name"],
                        "peak_device_bytes": None,
                    }
                    for w in workloads
                    if runs_on(spec, w)
                ],
            }
    return results


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


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

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    features = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")
    info = {
        "cpu": cpu,
        "cpu_features": [name for name in features if name in flags],
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
