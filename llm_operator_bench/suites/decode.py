"""Decode steps against the machine's floor: ``llm-operator bench decode``.

Rows decode together over one shared document (the prefix), every row with its own short
question; EOS is ignored so every row decodes to the end. For each dtype, prefix length
and row count the table gives:

- the floor of one decode step: the larger of (every weight once + every K/V byte the
  step reads, the shared prefix once) / the memory bandwidth, and the step's FLOP
  (``flops.py``: linears, head, attention) / the matmul rate; both measured at the start
  of the run (``measure_memory_bandwidth``, ``rate.measure_matmul_rate``);
- native: the median over its decode-only iterations of that batch size
  (``last_profile.steps``), the median of ``--repeat`` runs, and the split of a step by
  kind of work (``profile_ops=True``, a separate run so the timing stays clean);
- vLLM (its best configuration: in-process engine core, prefix caching, 32-token blocks
  unless ``--vllm-block-size``): from two decode lengths of the same rows, (time of
  ``warm + decode`` tokens - time of ``warm`` tokens) / ``decode``, the prefix cache reset
  before each run; medians of ``--repeat``.

Each system runs in its own process (``bench.core.worker``, ``bench.baselines.vllm_runner``).
Results go to ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_operator_bench.core.flops import ModelShape, model_shape

BANDWIDTH_BYTES = 512 << 20
WARM_TOKENS = 8  # tokens of the short vLLM run (prefill + the first decode steps)
DEFAULT_ROWS = (1, 4, 16, 64)
DEFAULT_PREFIXES = (1000,)
OWN_TOKENS = 24  # about: each row's question and chat-template tail after the prefix


def _log(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def measure_memory_bandwidth(size_bytes: int = BANDWIDTH_BYTES, repeats: int = 7) -> float:
    """Bytes per second ``torch`` reads on this machine: the median of ``repeats`` sums of a
    ``size_bytes`` float32 buffer (after one untimed pass), on this process's threads."""
    import torch

    buffer = torch.ones(max(1, size_bytes // 4), dtype=torch.float32)
    buffer.sum()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(seconds)


def step_floor(
    shape: ModelShape,
    *,
    element_bytes: int,
    rows: int,
    prefix_tokens: int,
    own_tokens: float,
    bandwidth: float,
    rate_flops: float,
) -> dict[str, float]:
    """One decode step of ``rows`` rows over a shared ``prefix_tokens`` prefix, each with
    ``own_tokens`` tokens of its own in the cache: bytes (weights once, the head included,
    and K/V read once: the prefix once for all rows) and FLOP; their times at
    ``bandwidth`` (bytes/s) and ``rate_flops`` (FLOP/s); the floor is the larger."""
    hidden, vocab = shape.hidden_size, shape.vocab_size
    weights = shape.linear_weights() + vocab * hidden
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    kv_tokens = prefix_tokens + rows * own_tokens
    bytes_read = (weights + kv_per_token * kv_tokens) * element_bytes
    context = prefix_tokens + own_tokens
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context
    flop = rows * (2 * weights + attention)
    memory_seconds, compute_seconds = bytes_read / bandwidth, flop / rate_flops
    return {
        "bytes": bytes_read,
        "flop": flop,
        "memory_ms": memory_seconds * 1e3,
        "compute_ms": compute_seconds * 1e3,
        "floor_ms": max(memory_seconds, compute_seconds) * 1e3,
    }


def build_rows(operator, prefix_tokens: int, rows: int, seed: int) -> tuple[list, list[list[int]]]:
    """``rows`` chat prompts over one shared document of about ``prefix_tokens`` tokens,
    each asking its own question; (prompts, their token ids as the operator tokenizes)."""
    from llm_operator_bench.core import text

    rng = random.Random(seed)

    def count(texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in operator.tokenizer(list(texts))["input_ids"]]

    document = text.text_with_tokens(rng, text.TOPICS[0], prefix_tokens, count)
    prompts = [
        [
            {"role": "system", "content": "Answer questions about the document."},
            {
                "role": "user",
                "content": f"Document:\n{document}\n\nQuestion {row + 1}: "
                f"{text.sentence(rng, text.TOPICS[1])[0]}",
            },  # fmt: skip
        ]
        for row in range(rows)
    ]
    return prompts, operator.tokenize(prompts)


def _median_split(profiles: list[dict], rows: int) -> dict[str, float] | None:
    splits = [
        b["ops_ms"]
        for p in profiles
        for b in (p or {}).get("by_batch", [])
        if b["rows"] == rows and b.get("ops_ms")
    ]
    if not splits:
        return None
    return {kind: statistics.median(s[kind] for s in splits) for kind in splits[0]}


def _native_steps(result: dict, names: dict[str, tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """(prefix, rows) -> {"ms": median over repeats of the per-run median step, "runs"}."""
    found: dict[tuple[int, int], dict] = {}
    for run in result.get("runs", []):
        key = names[run["workload"]]
        per_repeat = []
        for profile in run.get("decode_profiles") or [run.get("decode_profile")]:
            for b in (profile or {}).get("by_batch", []):
                if b["rows"] == key[1]:
                    per_repeat.append(b["median_ms"])
        if per_repeat:
            found[key] = {"ms": statistics.median(per_repeat), "runs": per_repeat}
    return found


def run_decode_bench(
    *,
    model: str,
    rows: Sequence[int] = DEFAULT_ROWS,
    prefixes: Sequence[int] = DEFAULT_PREFIXES,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    systems: Sequence[str] = ("native", "vllm"),
    decode_tokens: int = 64,
    repeat: int = 3,
    seed: int = 0,
    vllm_block_size: int | None = 32,
    vllm_python: str | None = None,
    vllm_eager: bool = False,
    kv_cache_gib: float = 4.0,
    timeout: float | None = None,
    out: Path,
    name: str = "bench-decode",
) -> dict[str, Any]:
    """Run the table (see the module docstring); write ``out/name.json`` and ``.md``."""
    import torch

    from llm_operator import LLMOperator
    from llm_operator_bench.core.rate import measure_matmul_rate
    from llm_operator_bench.core.runner import machine_info, run_worker_system
    from llm_operator_bench.core.systems import SystemSpec

    for value, label in ((rows, "rows"), (prefixes, "prefix tokens")):
        if not value or any(int(v) < 1 for v in value):
            raise ValueError(f"{label} must be positive integers, got {list(value)}")
    unknown = set(systems) - {"native", "vllm"}
    if unknown:
        raise ValueError(f"decode systems are native and vllm, got {sorted(unknown)}")
    if decode_tokens < 2 or repeat < 1:
        raise ValueError(f"need decode_tokens >= 2 and repeat >= 1, got {decode_tokens}, {repeat}")
    operator = LLMOperator(model, backend="native")
    shape = model_shape(operator.model_config)
    machine = machine_info()
    _log(f"bench decode: {machine.get('cpu') or machine.get('device')}; measuring the machine")
    bandwidth = measure_memory_bandwidth()
    rates = measure_matmul_rate(shape, dtypes=tuple(dtypes))
    _log(
        f"bench decode: memory {bandwidth / 1e9:.1f} GB/s; matmul "
        + ", ".join(f"{d} {rates[d].get('gflops', 0):.0f} GFLOP/s" for d in dtypes)
    )
    workloads, names = [], {}
    for prefix in prefixes:
        prompts, token_ids = build_rows(operator, int(prefix), max(rows), seed)
        for count in rows:
            workload_name = f"prefix{prefix}-rows{count}"
            names[workload_name] = (int(prefix), int(count))
            workloads.append(
                {
                    "name": workload_name,
                    "prompts": prompts[:count],
                    "token_ids": token_ids[:count],
                    "max_tokens": [WARM_TOKENS + decode_tokens] * count,
                    "ignore_eos": True,
                    "stop": [],
                    "choices": None,
                    "input_order": list(range(count)),
                    "shuffled_order": list(range(count)),
                }
            )
    measured: dict[str, dict] = {}
    for dtype in dtypes:
        if "native" in systems:
            spec = SystemSpec("native", "operator", "native", {"backend": "native"}, dtype=dtype)
            for profile_ops in (False, True):
                _log(f"bench decode: native {dtype}{' (op split)' if profile_ops else ''}")
                result = run_worker_system(
                    spec, str(operator.model.path), workloads,
                    repeat=1 if profile_ops else repeat,
                    options={"progress": False, "profile_ops": profile_ops}, timeout=timeout,
                    log=_log,
                )  # fmt: skip
                measured[f"native-{dtype}{'-ops' if profile_ops else ''}"] = result
        if "vllm" in systems:
            _log(f"bench decode: vLLM {dtype} (block {vllm_block_size or 'default'})")
            measured[f"vllm-{dtype}"] = _run_vllm(
                str(operator.model.path), workloads, dtype=dtype, decode_tokens=decode_tokens,
                repeat=repeat, block_size=vllm_block_size, python=vllm_python,
                kv_cache_gib=kv_cache_gib, timeout=timeout, eager=vllm_eager,
            )  # fmt: skip
    table = []
    for dtype in dtypes:
        element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        rate = rates[dtype].get("gflops")
        native = _native_steps(measured.get(f"native-{dtype}", {}), names)
        split_result = measured.get(f"native-{dtype}-ops", {})
        vllm = measured.get(f"vllm-{dtype}", {})
        for prefix in prefixes:
            for count in rows:
                floor = step_floor(
                    shape, element_bytes=element, rows=count, prefix_tokens=int(prefix),
                    own_tokens=OWN_TOKENS + (WARM_TOKENS + decode_tokens) / 2,
                    bandwidth=bandwidth, rate_flops=(rate or 1.0) * 1e9,
                )  # fmt: skip
                entry: dict[str, Any] = {"dtype": dtype, "prefix": int(prefix), "rows": count,
                                         **floor}  # fmt: skip
                step = native.get((int(prefix), count))
                if step:
                    entry["native_ms"], entry["native_runs_ms"] = step["ms"], step["runs"]
                for run in split_result.get("runs", []):
                    if names[run["workload"]] == (int(prefix), count):
                        entry["native_split_ms"] = _median_split(
                            run.get("decode_profiles") or [run.get("decode_profile")], count
                        )
                step = vllm.get("steps", {}).get(f"prefix{prefix}-rows{count}")
                if step:
                    entry["vllm_ms"], entry["vllm_runs_ms"] = step["ms"], step["runs"]
                table.append(entry)
    report = {
        "machine": machine,
        "bandwidth_gbs": bandwidth / 1e9,
        "matmul_rate": {d: rates[d].get("gflops") for d in dtypes},
        "decode_tokens": decode_tokens,
        "repeat": repeat,
        "vllm_block_size": vllm_block_size,
        "errors": {
            k: v.get("error") or v.get("skipped")
            for k, v in measured.items()
            if v.get("error") or v.get("skipped")
        },  # fmt: skip
        "vllm_engine": {
            d: {
                k: measured.get(f"vllm-{d}", {}).get(k)
                for k in ("vllm_version", "engine_core_client", "torch_threads")
            }
            for d in dtypes
            if "vllm" in systems
        },  # fmt: skip
        "table": table,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    markdown = decode_markdown(report)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    return report


def _run_vllm(
    model_path: str,
    workloads: list[dict],
    *,
    dtype: str,
    decode_tokens: int,
    repeat: int,
    block_size: int | None,
    python: str | None,
    kv_cache_gib: float,
    timeout: float | None,
    eager: bool = False,
) -> dict[str, Any]:
    """vLLM's decode step per workload from two decode lengths (see the module docstring)."""
    from llm_operator_bench.baselines.vllm_systems import (
        VLLMRunError,
        VLLMUnavailable,
        run_vllm_job,
    )

    runs = []
    for w in workloads:
        for label, tokens in (("short", WARM_TOKENS), ("long", WARM_TOKENS + decode_tokens)):
            runs.append({
                "name": f"{w['name']}/{label}", "prompts": w["token_ids"],
                "max_tokens": [tokens] * len(w["token_ids"]), "ignore_eos": True,
                "order": w["input_order"],
            })  # fmt: skip
    job = {
        "model": model_path, "dtype": dtype, "prefix_caching": True, "prompts": [],
        "max_tokens": [], "runs": runs, "repeat": repeat, "kv_cache_gib": kv_cache_gib,
        "block_size": block_size, "enforce_eager": True if eager else None, "warmup": True,
        "max_model_len": max(len(ids) for w in workloads for ids in w["token_ids"])
        + WARM_TOKENS + decode_tokens,
    }  # fmt: skip
    try:
        result = run_vllm_job(job, python=python, timeout=timeout)
    except VLLMUnavailable as error:
        return {"skipped": str(error)}
    except (VLLMRunError, OSError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    by_name = {run["name"]: run for run in result["runs"]}
    steps = {}
    for w in workloads:
        short, long = by_name[f"{w['name']}/short"], by_name[f"{w['name']}/long"]
        per_repeat = [
            (b - a) / decode_tokens * 1e3 for a, b in zip(short["seconds"], long["seconds"])
        ]
        median = statistics.median(per_repeat)
        # A difference at or below zero means the runs' noise exceeds the decode steps' time
        # (a tiny model, a busy machine): no step time can be read from it.
        steps[w["name"]] = {"ms": median if median > 0 else None, "runs": per_repeat}
    return {**{k: v for k, v in result.items() if k != "runs"}, "steps": steps}


def decode_markdown(report: dict[str, Any]) -> str:
    """The decode-step table (and native's split) as markdown."""
    machine = report["machine"]
    rates = ", ".join(f"{d} {r:.0f} GFLOP/s" for d, r in report["matmul_rate"].items() if r)
    lines = [
        f"Machine: {machine.get('cpu') or machine.get('device')}; memory "
        f"{report['bandwidth_gbs']:.1f} GB/s (torch sum of 512 MiB); matmul {rates} (torch "
        f"linear at M=1024 on the model's shapes). Medians of {report['repeat']} runs; vLLM "
        f"in-process, prefix caching, block {report['vllm_block_size'] or 'default'}, from "
        f"two decode lengths ({WARM_TOKENS} and {WARM_TOKENS + report['decode_tokens']} "
        "tokens).",
        "",
        "| dtype | prefix | rows | floor ms (memory / compute) | native ms | native / floor "
        "| vLLM ms | vLLM / floor | native / vLLM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def figure(value, pattern="{:.1f}"):
        return "-" if value is None else pattern.format(value)

    for e in report["table"]:
        native, vllm, floor = e.get("native_ms"), e.get("vllm_ms"), e["floor_ms"]
        lines.append(
            f"| {e['dtype']} | {e['prefix']} | {e['rows']} | {floor:.1f} ({e['memory_ms']:.1f} / "
            f"{e['compute_ms']:.1f}) | {figure(native)} | "
            f"{figure(native and native / floor, '{:.2f}x')} | {figure(vllm)} | "
            f"{figure(vllm and vllm / floor, '{:.2f}x')} | "
            f"{figure(native and vllm and native / vllm, '{:.2f}')} |"
        )
    splits = [e for e in report["table"] if e.get("native_split_ms")]
    if splits:
        kinds = list(splits[0]["native_split_ms"])
        lines += [
            "",
            "Native decode step by kind of work, ms (median over the decode iterations of one "
            "profiled run; host: Python, scheduling and metadata between the ops):",
            "",
            "| dtype | prefix | rows | " + " | ".join(kinds) + " |",
            "|---|---:|---:|" + "---:|" * len(kinds),
        ]
        for e in splits:
            split = e["native_split_ms"]
            lines.append(
                f"| {e['dtype']} | {e['prefix']} | {e['rows']} | "
                + " | ".join(f"{split[k]:.2f}" for k in kinds)
                + " |"
            )
    if report.get("errors"):
        lines += [
            "",
            "Not measured: " + "; ".join(f"{k}: {v}" for k, v in report["errors"].items()),
        ]
    return "\n".join(lines) + "\n"
