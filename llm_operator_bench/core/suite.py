"""``run_benchmark``: the whole side-by-side run, written to ``<out>/<name>.json|.md|.png``."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from llm_operator_bench.baselines.vllm_systems import VLLMUnavailable, find_vllm_python
from llm_operator_bench.core.flops import ModelShape, model_shape
from llm_operator_bench.core.rate import describe_rates, measure_matmul_rate
from llm_operator_bench.core.records import build_records
from llm_operator_bench.core.report import markdown_table, write_chart
from llm_operator_bench.core.runner import (
    Log,
    _stderr,
    machine_info,
    now,
    prepare_workloads,
    run_vllm_systems,
    run_worker_system,
)
from llm_operator_bench.core.systems import BASELINE, SystemSpec, parse_systems, runs_on


def parse_workloads(text: str | None) -> list[str]:
    """Comma-separated workload names; "all": every workload; None: ``DEFAULT_WORKLOADS``."""
    from llm_operator_bench.core.workloads import DEFAULT_WORKLOADS, WORKLOAD_NAMES

    if text is None:
        return list(DEFAULT_WORKLOADS)
    if text.strip() == "all":
        return list(WORKLOAD_NAMES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown or not names:
        raise ValueError(
            f"unknown workload(s) {unknown or text!r}; choose from {', '.join(WORKLOAD_NAMES)} "
            "or 'all'"
        )
    return list(dict.fromkeys(names))


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
    """Every id that ends a generation: the generation config's EOS ids and the tokenizer's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def machine_rate(operator, log: Log) -> tuple[ModelShape | None, dict[str, Any] | None]:
    """The model's shape and the matmul rate on it (``rate.measure_matmul_rate``), measured
    here before any system runs; (None, None) for a config without Llama-family sizes."""
    try:
        shape = model_shape(operator.model_config)
    except ValueError as error:
        log(f"bench: no FLOP figures: {error}")
        return None, None
    rates = measure_matmul_rate(shape)
    log(
        f"bench: matmul rates on the model's shapes at M={rates['tokens']}, "
        f"{rates['threads']} threads, {rates['device']}: {describe_rates(rates)}"
    )
    return shape, rates


def run_benchmark(
    *,
    model: str,
    systems: str | None = None,
    workloads: str | None = None,
    size: str = "default",
    repeat: int = 1,
    seed: int = 0,
    out_dir: Path = Path("bench-results"),
    name: str | None = None,
    static_batch_size: int = 16,
    kv_cache_gib: float = 4.0,
    vllm_block_size: int | None = None,
    vllm_eager: bool = False,
    vllm_python: str | None = None,
    llamacpp_python: str | None = None,
    llamacpp_parallel: int = 16,
    timeout: float | None = None,
    log=_stderr,
) -> dict[str, Any]:
    """Run every chosen system on every chosen workload; write and return the report."""
    from llm_operator import LLMOperator

    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    if static_batch_size < 1:
        raise ValueError(f"--static-batch-size must be >= 1, got {static_batch_size}")
    specs = parse_systems(systems)
    names = parse_workloads(workloads)
    name = name or f"bench-{size}"
    if "/" in name or not name.strip():
        raise ValueError(f"--name must be a plain file name, got {name!r}")
    started = time.perf_counter()
    operator = LLMOperator(model)  # tokenizer only: the systems load the model themselves
    model_path = str(operator.model.path)
    log(f"bench: model {model} ({model_path}); preparing {len(names)} workloads ({size})")
    prepared = prepare_workloads(operator, names, size=size, seed=seed)
    for w in prepared:
        s = w["summary"]
        log(
            f"  {w['name']}: {s['rows']} rows, {s['prompt_tokens']:,} prompt tokens, "
            f"minimum prefill {s['min_prefill_tokens']:,}, max tokens {s['max_tokens_total']:,}"
            + (" (EOS ignored)" if s["ignore_eos"] else "")
            + (" (labelled)" if s["labelled"] else "")
        )
    specs = _systems_with_work(specs, prepared, log)
    shape, rates = machine_rate(operator, log)  # before any system runs
    raw: dict[str, dict] = {}
    worker_specs = [spec for spec in specs if spec.kind not in ("vllm", "llamacpp")]
    vllm_specs = [spec for spec in specs if spec.kind == "vllm"]
    for index, spec in enumerate(worker_specs, 1):
        log(f"bench: [{index}/{len(specs)}] {spec.name}: {spec.description}")
        options = {"batch_size": static_batch_size} if spec.kind == "static" else {}
        python = None
        if spec.python == "vllm":
            try:
                python = find_vllm_python(vllm_python)
            except VLLMUnavailable as error:
                raw[spec.name] = {"skipped": str(error)}
                log(f"bench: {spec.name} not measured: {error}")
                continue
            spec_block_size = spec.block_size if spec.block_size is not None else vllm_block_size
            options = _vllm_backend_options(kv_cache_gib, spec_block_size, vllm_eager)
        gguf = operator.model_info.gguf  # a quantized system runs the GGUF file itself
        quantized = spec.options.get("quantization", "none") != "none" and gguf is not None
        raw[spec.name] = run_worker_system(
            spec,
            str(gguf) if quantized else model_path,
            prepared,
            repeat=repeat,
            options=options,
            timeout=timeout,
            log=log,
            python=python,
        )
        if "error" in raw[spec.name]:
            log(f"bench: {spec.name} failed: {raw[spec.name]['error']}")
    if vllm_specs:
        log(f"bench: {', '.join(s.name for s in vllm_specs)} through vLLM (a subprocess)")
        raw.update(
            run_vllm_systems(
                vllm_specs,
                model_path,
                prepared,
                repeat=repeat,
                kv_cache_gib=kv_cache_gib,
                block_size=vllm_block_size,
                eager=vllm_eager,
                python=vllm_python,
                timeout=timeout,
                log=log,
            )
        )
        for spec in vllm_specs:
            problem = raw[spec.name].get("error") or raw[spec.name].get("skipped")
            if problem:
                log(f"bench: {spec.name} not measured: {problem}")
    for spec in (spec for spec in specs if spec.kind == "llamacpp"):
        log(f"bench: {spec.name}: {spec.description}")
        raw[spec.name] = _run_llamacpp(
            spec, model, model_path, prepared, repeat, llamacpp_python, llamacpp_parallel, log
        )
    records = build_records(
        specs,
        raw,
        prepared,
        eos_token_ids(model_path, operator.tokenizer),
        shape=shape,
        rates=rates,
        decode=lambda ids: operator.tokenizer.decode(ids, skip_special_tokens=True),
    )
    _warn_thread_mismatch(raw, rates, log)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chart = out_dir / f"{name}.png"
    title = f"llm-operator bench {name}: {model}, size {size}, median of {repeat}"
    report: dict[str, Any] = {
        "name": name,
        "created": now(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": model,
        "model_path": model_path,
        "size": size,
        "seed": seed,
        "repeat": repeat,
        "static_batch_size": static_batch_size,
        "kv_cache_gib": kv_cache_gib,
        "vllm_eager": vllm_eager,
        "baseline": BASELINE,
        "machine": {**machine_info(), "matmul_rate": rates},
        "model_shape": shape._asdict() if shape is not None else None,
        "vllm": {
            **{
                key: next((raw[s.name].get(key) for s in vllm_specs if key in raw[s.name]), None)
                for key in ("vllm_version", "kv_cache_tokens", "block_size", "load_seconds")
            },
            "engines": {s.name: _engine_summary(raw[s.name]) for s in vllm_specs},
        },
        "systems": [_system_entry(s) for s in specs],
        "workloads": [
            {
                "name": w["name"],
                "description": w["description"],
                "params": w["params"],
                **w["summary"],
            }
            for w in prepared
        ],
        "results": records,
        "chart": None,
        "seconds": None,
    }
    if write_chart(records, prepared, chart, title):
        report["chart"] = str(chart)
    else:
        log("bench: no chart (matplotlib missing: pip install 'llm-operator[bench]')")
    report["seconds"] = time.perf_counter() - started
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out_dir / f"{name}.md").write_text(
        markdown_table(records, prepared, machine=report["machine"], title=title)
    )
    log(f"bench: wrote {out_dir / (name + '.json')} in {report['seconds']:.0f} s")
    return report


def _systems_with_work(specs: list[SystemSpec], prepared: list[dict], log: Log) -> list[SystemSpec]:
    """The systems that run at least one of the workloads (a choices system needs labels)."""
    idle = [spec.name for spec in specs if not any(runs_on(spec, w) for w in prepared)]
    if idle:
        log(f"bench: {', '.join(idle)} left out: they run only workloads with labels (classify)")
    working = [spec for spec in specs if spec.name not in idle]
    if not working:
        raise ValueError(
            f"system(s) {', '.join(idle)} run only workloads with labels: add --workloads classify"
        )
    return working


def _system_entry(spec: SystemSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "kind": spec.kind,
        "description": spec.description,
        "options": spec.options,
        "dtype": spec.dtype,
        "block_size": spec.block_size,
        "choices": spec.choices,
    }


def _engine_summary(result: dict[str, Any]) -> dict[str, Any]:
    """What one plain vLLM system's engine ran with (or why it did not run)."""
    keys = ("dtype", "block_size", "kv_cache_tokens", "load_seconds", "torch_threads")
    keys += ("in_process_engine", "engine_core_client", "error", "skipped")
    return {key: result[key] for key in keys if key in result}


def _warn_thread_mismatch(raw: dict[str, dict], rates: dict[str, Any] | None, log: Log) -> None:
    """Say when a system ran on another torch thread count than the rate was measured with."""
    if not rates:
        return
    for system, result in raw.items():
        threads = result.get("torch_threads")
        if threads is not None and threads != rates["threads"]:
            log(
                f"bench: {system} ran on {threads} torch threads, the matmul rate was measured "
                f"on {rates['threads']}: its % rate compares unlike figures"
            )


def _vllm_backend_options(
    kv_cache_gib: float, block_size: int | None, eager: bool
) -> dict[str, Any]:
    """LLMOperator options for backend="vllm" under the plain vLLM systems' settings: the
    same KV cache bytes and, when given, block size and eager start. The engine starts
    once, outside the timed runs, sized for the model's context (or what the cache holds)."""
    vllm_options: dict[str, Any] = {}
    if block_size is not None:
        vllm_options["block_size"] = block_size
    if eager:
        vllm_options["enforce_eager"] = True
    return {
        "kv_cache_memory": int(kv_cache_gib * (1 << 30)),
        "vllm_options": vllm_options,
    }


def _run_llamacpp(spec, model, model_path, prepared, repeat, python, parallel, log) -> dict:
    """A llama.cpp system's RESULT dict, or {"skipped": why} where it cannot run here."""
    from llm_operator.models.registry import known_aliases
    from llm_operator_bench.baselines.llama_cpp import LlamaCppUnavailable, run_llamacpp_system

    if spec.options["gguf"] == "own" and model not in known_aliases():
        return {"skipped": f"model {model!r} is not a GGUF alias: it has no GGUF of its own"}
    try:
        return run_llamacpp_system(
            spec, model_path, prepared, repeat=repeat, parallel=parallel, python=python,
            alias=model, log=log,
        )  # fmt: skip
    except LlamaCppUnavailable as error:
        log(f"bench: {spec.name} not measured: {error}")
        return {"skipped": str(error)}
    except (RuntimeError, OSError) as error:
        log(f"bench: {spec.name} failed: {error}")
        return {"error": f"{type(error).__name__}: {error}"}
