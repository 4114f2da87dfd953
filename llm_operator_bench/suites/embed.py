"""Embeddings side by side: ``llm-operator bench embed``.

Workloads (deterministic synthetic English, token counts in the model's tokenizer):

- ``contextual-chunks``: D documents of about 1,000 tokens (at most half the model's
  context), each with CHUNKS chunks of about CHUNK_TOKENS tokens on its topic; each row is
  the document, a blank line, then one chunk (contextual retrieval's shape: the chunk
  after its document). Rows of a
  document share its tokens; a causal model's vectors are exact with that K/V shared.
- ``query-instruction``: one instruction prefix (``INSTRUCTION``) and a short query per row.

Systems, each in its own process (``suites.embed_worker``):

- ``native``: ``LLMOperator(backend="native")``, shared prefixes computed once;
- ``native-noshare``: the same with ``share_prefixes=False`` (every row whole);
- ``hf``: ``backend="hf"``, ``transformers.AutoModel`` on length-sorted padded batches
  with nothing shared (what a pandas UDF over AutoModel does);
- ``vllm``: ``vllm.LLM.embed`` (pooling runner, prefix caching on for ``last`` pooling,
  fp32, in-process engine core, 32-token blocks, compiled unless ``--vllm-eager``) on the
  rows' token ids in input order, in the vLLM venv.

Per system and workload: embed seconds (the model loaded and warmed first, apart), rows/s,
prompt tokens, tokens computed (the operator's prefill count; vLLM's prompt tokens less
its prefix-cache hits), the process's peak RSS during the workload, and the cosine of each
row's vector with hf's (min and median). Results: ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SYSTEMS = ("native", "native-noshare", "hf", "vllm")
WORKLOADS = ("contextual-chunks", "query-instruction")
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
CHUNKS = 16
CHUNK_TOKENS = 60
SIZES: dict[str, dict[str, int]] = {
    # documents (of ~doc_tokens, capped by the model's context), queries
    # on 2 CPU cores hf embeds about 130 SmolLM2-135M tokens/s at a 1,000-token context
    "quick": {"documents": 1, "doc_tokens": 1000, "queries": 32},
    "default": {"documents": 2, "doc_tokens": 1000, "queries": 128},
}
REFERENCE = "hf"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_workloads(
    tokenizer, *, size: str, context: int, seed: int = 0, names: Sequence[str] = WORKLOADS
) -> list[dict[str, Any]]:
    """The workloads' texts and token ids (``tokenizer``: the operator's tokenize), each
    row within ``context`` tokens."""
    from llm_operator_bench.core import text

    sizes = SIZES[size]

    def count(texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(list(texts), add_special=False)]

    workloads = []
    if "contextual-chunks" in names:
        rng = random.Random(seed)
        doc_tokens = min(sizes["doc_tokens"], context // 2)  # a small model's context
        chunk_tokens = min(CHUNK_TOKENS, context // 16)
        texts = []
        for document in range(sizes["documents"]):
            topic = text.TOPICS[document % len(text.TOPICS)]
            body = text.text_with_tokens(rng, topic, doc_tokens, count)
            chunks = _distinct(
                lambda topic=topic: text.text_with_tokens(rng, topic, chunk_tokens, count), CHUNKS
            )
            texts += [f"{body}\n\n{chunk}" for chunk in chunks]
        workloads.append(("contextual-chunks", texts))
    if "query-instruction" in names:
        rng = random.Random(seed + 1)
        topics = iter(range(10**9))
        texts = _distinct(
            lambda: (
                INSTRUCTION
                + text.sentence(rng, text.TOPICS[next(topics) % len(text.TOPICS)]).rstrip(".")
                + "?"
            ),
            sizes["queries"],
        )
        workloads.append(("query-instruction", texts))
    built = []
    for name, texts in workloads:
        token_ids = [list(ids) for ids in tokenizer(texts)]
        too_long = max(len(ids) for ids in token_ids)
        if too_long > context:
            raise ValueError(f"{name}: a row of {too_long} tokens, past the context {context}")
        built.append({"name": name, "texts": texts, "token_ids": token_ids})
    return built


def _distinct(draw, count: int) -> list[str]:
    """``count`` different texts from ``draw`` (no two rows the same: none is merged)."""
    seen: dict[str, None] = {}
    for _ in range(count * 50):
        seen.setdefault(draw())
        if len(seen) == count:
            return list(seen)
    raise ValueError(f"could not draw {count} different texts")


def _run_worker(
    python: str, job: dict[str, Any], *, timeout: float | None, env=None, cwd=None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llm-operator-embed-") as folder:
        job_path, result_path = Path(folder, "job.json"), Path(folder, "result.json")
        job_path.write_text(json.dumps(job))
        command = [python, "-m", "llm_operator_bench.suites.embed_worker", str(job_path),
                   str(result_path)]  # fmt: skip
        try:
            completed = subprocess.run(
                command, env=env, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            tail = "\n".join(completed.stdout.splitlines()[-20:])
            return {"error": f"exited with status {completed.returncode}, no result:\n{tail}"}
    if "error" in result:
        result["log_tail"] = "\n".join(completed.stdout.splitlines()[-20:])
    return result


def _run_system(
    system: str,
    job: dict[str, Any],
    *,
    vllm_python: str | None,
    timeout: float | None,
    folder: Path,
) -> dict[str, Any]:
    if system != "vllm":
        from llm_operator_bench.core.runner import _child_env

        return _run_worker(sys.executable, job, timeout=timeout, env=_child_env())
    from llm_operator_bench.baselines.vllm_systems import (
        VLLMUnavailable,
        _working_directory,
        find_vllm_python,
        vllm_environment,
    )

    try:
        python = find_vllm_python(vllm_python)
    except VLLMUnavailable as error:
        return {"skipped": str(error)}
    env = vllm_environment({"kv_cache_gib": job["vllm"].get("kv_cache_gib")})
    return _run_worker(python, job, timeout=timeout, env=env, cwd=_working_directory(folder))


def _agreement(vectors, reference) -> dict[str, float] | None:
    import numpy as np

    if vectors.shape != reference.shape:
        return None
    cosines = np.sum(vectors.astype(np.float64) * reference.astype(np.float64), axis=1)
    cosines /= np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    return {"min": float(np.min(cosines)), "median": float(np.median(cosines))}


def run_embed_bench(
    *,
    model: str,
    systems: Sequence[str] = SYSTEMS,
    workloads: Sequence[str] = WORKLOADS,
    size: str = "default",
    pooling: str = "last",
    dtype: str = "float32",
    seed: int = 0,
    vllm_python: str | None = None,
    vllm_eager: bool = False,
    vllm_block_size: int | None = 32,
    kv_cache_gib: float = 4.0,
    timeout: float | None = None,
    profile_ops: bool = False,
    repeat: int = 1,
    measure_rate: bool = True,
    out: Path,
    name: str = "bench-embed",
) -> dict[str, Any]:
    """Run every system on every workload (module docstring); write ``out/name.json``
    and ``.md``; the report."""
    import numpy as np

    from llm_operator import LLMOperator
    from llm_operator_bench.core.runner import machine_info, now
    from llm_operator_bench.core.suite import machine_rate

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"embed systems are {', '.join(SYSTEMS)}, got {sorted(unknown)}")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"embed workloads are {', '.join(WORKLOADS)}, got {sorted(unknown)}")
    if size not in SIZES:
        raise ValueError(f"embed sizes are {', '.join(SIZES)}, got {size!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    operator = LLMOperator(model, progress=False)
    model_path = str(operator.model.path)
    built = build_workloads(
        _tokenizer(operator),
        size=size,
        context=operator.max_context,
        seed=seed,
        names=workloads,
    )
    machine = machine_info()
    _log(f"bench embed: {machine.get('cpu')}; {model}; size {size}; pooling {pooling}")
    shape, rates = machine_rate(operator, _log) if measure_rate else (None, None)
    out.mkdir(parents=True, exist_ok=True)
    started_at = now()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="llm-operator-embed-vectors-") as vectors_dir:
        folder = Path(vectors_dir)
        for system in systems:
            job = {
                "system": system, "model": model_path, "pooling": pooling, "dtype": dtype,
                "vectors_dir": str(folder), "workloads": built, "repeat": repeat,
                "options": {"profile_ops": True} if profile_ops and system == "native" else {},
                "vllm": {"kv_cache_gib": kv_cache_gib, "block_size": vllm_block_size,
                         "enforce_eager": bool(vllm_eager)},
            }  # fmt: skip
            if job["vllm"]["block_size"] is None:
                del job["vllm"]["block_size"]
            _log(f"bench embed: {system}")
            result = _run_system(
                system, job, vllm_python=vllm_python, timeout=timeout, folder=folder
            )
            for record in result.get("records", []):
                record["vectors_array"] = np.load(record.pop("vectors"))
            results[system] = result
            if "error" in result or "skipped" in result:
                _log(f"bench embed: {system}: {result.get('error') or result.get('skipped')}")
    records = []
    reference = {
        r["name"]: r["vectors_array"] for r in results.get(REFERENCE, {}).get("records", [])
    }
    for system, result in results.items():
        for record in result.get("records", []):
            vectors = record.pop("vectors_array")
            ref = reference.get(record["name"])
            record["agreement_with_hf"] = None if ref is None else _agreement(vectors, ref)
            computed = record.get("tokens_computed")
            if shape is not None and computed is not None and record["seconds"] > 0:
                linear = 2.0 * shape.linear_weights() * computed
                record["linear_gflops"] = linear / record["seconds"] / 1e9
            records.append({"system": system, **record})
    report = {
        "suite": "embed",
        "started": started_at,
        "machine": machine,
        "model": model,
        "model_path": model_path,
        "size": size,
        "pooling": pooling,
        "dtype": dtype,
        "repeat": repeat,
        "rates": rates,
        "workloads": [
            {
                "name": w["name"],
                "rows": len(w["token_ids"]),
                "prompt_tokens": sum(len(ids) for ids in w["token_ids"]),
                "mean_row_tokens": statistics.mean(len(ids) for ids in w["token_ids"]),
            }
            for w in built
        ],
        "systems": {
            system: {
                k: result.get(k)
                for k in ("load_seconds", "engine", "torch_threads", "error", "skipped")
                if result.get(k) is not None
            }
            for system, result in results.items()
        },
        "records": records,
    }
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    markdown = embed_markdown(report)
    (out / f"{name}.md").write_text(markdown)
    return report


def _tokenizer(operator):
    """The operator's tokenizer as ``texts -> token ids`` (special tokens as the operator
    adds them unless ``add_special=False``)."""

    def tokenize(texts: Sequence[str], add_special: bool = True) -> list[list[int]]:
        if add_special:
            return [list(ids) for ids in operator.tokenize(list(texts))]
        return operator.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    return tokenize


def embed_markdown(report: dict[str, Any]) -> str:
    """The report's table (and the systems' engines) as markdown."""
    from llm_operator_bench.core.rate import describe_rates

    machine = report["machine"]
    lines = [
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_count')} CPUs, "
        f"{', '.join(machine.get('cpu_features') or []) or 'no listed vector features'}); "
        f"model {report['model']}, {report['dtype']}, {report['pooling']} pooling; size "
        f"{report['size']}. Seconds: the embed call alone (model loaded and warmed first)"
        + (
            f", the median of {report['repeat']} runs."
            if report.get("repeat", 1) > 1
            else ", one run."
        ),
        "",
        f"Matmul rate on the model's shapes in this run: {describe_rates(report.get('rates'))}. "
        "Linear GFLOP/s: the tokens a system computed x 2 x the model's linear weights, "
        "per second (attention and the rest left out).",
        "",
        "| workload | rows | prompt tokens |",
        "|---|---:|---:|",
    ]
    for w in report["workloads"]:
        lines.append(f"| {w['name']} | {w['rows']} | {w['prompt_tokens']:,} |")
    lines += [
        "",
        "| workload | system | seconds | runs | rows/s | tokens computed | linear GFLOP/s "
        "| peak RSS MiB | cosine vs hf (min / median) | hf s / this s |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    by_key = {(r["system"], r["name"]): r for r in report["records"]}
    for w in report["workloads"]:
        hf = by_key.get((REFERENCE, w["name"]))
        for record in (r for r in report["records"] if r["name"] == w["name"]):
            agreement = record.get("agreement_with_hf")
            cosine = "-" if not agreement else f"{agreement['min']:.7f} / {agreement['median']:.7f}"
            peak = record.get("peak_rss_bytes")
            computed = record.get("tokens_computed")
            ratio = "-" if hf is None else f"{hf['seconds'] / record['seconds']:.2f}x"
            runs = ", ".join(f"{r:.2f}" for r in record.get("runs") or [record["seconds"]])
            linear = record.get("linear_gflops")
            lines.append(
                f"| {w['name']} | {record['system']} | {record['seconds']:.2f} | {runs} | "
                f"{record['rows_per_s']:.1f} | {'-' if computed is None else f'{computed:,}'} | "
                f"{'-' if linear is None else f'{linear:.0f}'} | "
                f"{'-' if peak is None else f'{peak / 2**20:.0f}'} | {cosine} | "
                f"{ratio} |"
            )
    lines += ["", "Systems:", ""]
    for system, info in report["systems"].items():
        if "error" in info or "skipped" in info:
            lines.append(f"- {system}: not measured: {info.get('error') or info.get('skipped')}")
        else:
            lines.append(
                f"- {system}: {info.get('engine')}; load and warm-up {info['load_seconds']:.1f} s; "
                f"{info.get('torch_threads')} torch threads"
            )
    return "\n".join(lines) + "\n"
