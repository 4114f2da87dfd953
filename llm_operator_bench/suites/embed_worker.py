"""One system of ``llm-operator bench embed`` in its own process.

``python -m llm_operator_bench.suites.embed_worker JOB RESULT`` reads JOB (json):

    {"system": "native" | "native-noshare" | "hf" | "vllm", "model": path,
     "pooling": "last" | "mean" | "cls", "dtype": "float32", "vectors_dir": path,
     "workloads": [{"name", "texts": [...], "token_ids": [[...], ...]}], "repeat": runs,
     "vllm": {vLLM engine options (vllm only)}}

and writes RESULT (json): {"system", "load_seconds", "torch_threads", "engine",
"workloads": [{"name", "rows", "seconds" (the median of the runs), "runs", "rows_per_s",
"prompt_tokens", "tokens_computed", "peak_rss_bytes", "error_rows", "vectors"}]} or
{"error": ...}.

The operator systems embed the texts through ``LLMOperator.embed`` (vectors L2-normalized
by the operator); ``vllm`` calls ``vllm.LLM.embed`` on the rows' token ids in input order
(its pooling runner, raw vectors, normalized here). Before the timed runs each system
embeds two short rows (the model loaded, kernels compiled, vLLM warmed); each workload
then runs ``repeat`` times (default 1), vLLM's prefix cache reset before each run. Each
workload's vectors go to
``<vectors_dir>/<system>-<workload>.npy`` (float32 [rows, hidden]).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

WARMUP = ["A short row to warm the engine up.", "Another short row, a little longer than that."]


def _rss() -> tuple:
    from llm_operator_bench.core.worker import peak_rss_bytes, reset_peak_rss

    return reset_peak_rss, peak_rss_bytes


def _operator_system(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from llm_operator import LLMOperator

    reset_peak_rss, peak_rss_bytes = _rss()
    system = job["system"]
    options: dict[str, Any] = {"progress": False, "dtype": job.get("dtype", "float32")}
    options.update(job.get("options") or {})
    if system == "native":
        options.update(backend="native")
    elif system == "native-noshare":
        options.update(backend="native", share_prefixes=False)
    elif system == "hf":
        options.update(backend="hf")
    else:
        raise ValueError(f"unknown system {system!r}")
    started = time.perf_counter()
    op = LLMOperator(job["model"], **options)
    op.embed(WARMUP, pooling=job["pooling"])
    load_seconds = time.perf_counter() - started
    embedder = op.embedder()
    paths = getattr(embedder, "paths", None)
    records = []
    for workload in job["workloads"]:
        reset_peak_rss()
        runs = []
        for _ in range(_repeat(job)):
            started = time.perf_counter()
            results = op.embed(workload["texts"], pooling=job["pooling"])
            runs.append(time.perf_counter() - started)
        peak = peak_rss_bytes()
        stats = op.last_stats
        vectors = np.asarray(
            [r.embedding if r.embedding is not None else [np.nan] for r in results],
            dtype=np.float32,
        )
        records.append(
            _record(
                job,
                workload,
                runs,
                vectors,
                peak,
                error_rows=stats.error_rows,
                prompt_tokens=stats.prompt_tokens,
                tokens_computed=stats.prefill_tokens_computed,
                embed_seconds=stats.generate_seconds,
            )  # fmt: skip
        )
        profile = getattr(getattr(embedder, "backend", None), "last_profile", None)
        if options.get("profile_ops") and profile:
            records[-1]["profile"] = _jsonable(profile)
    return {
        "load_seconds": load_seconds,
        "engine": paths.describe() if paths is not None else embedder.name,
        "records": records,
    }


def _vllm_system(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from llm_operator.config import EngineConfig
    from llm_operator.engine.vllm.driver import start_engine
    from llm_operator.engine.vllm.embed import VLLMEmbedder, pooling_kwargs

    reset_peak_rss, peak_rss_bytes = _rss()
    settings = dict(job.get("vllm") or {})
    kv_cache_gib = float(settings.pop("kv_cache_gib", 4.0))
    config = EngineConfig(
        dtype=job.get("dtype", "float32"), kv_cache_memory=int(kv_cache_gib * 2**30)
    )
    kwargs = pooling_kwargs(job["model"], config, job["pooling"])
    kwargs.update(settings)
    started = time.perf_counter()
    engine = start_engine(kwargs)
    embedder = VLLMEmbedder(job["model"], config)
    longest = max(len(ids) for w in job["workloads"] for ids in w["token_ids"])
    if longest > engine.max_model_len:
        raise ValueError(
            f"rows of {longest} tokens, vLLM's max_model_len is {engine.max_model_len}"
        )
    warm = [ids[:16] for ids in job["workloads"][0]["token_ids"][:2]]
    embedder.embed_token_ids(warm, engine)
    load_seconds = time.perf_counter() - started
    records = []
    for workload in job["workloads"]:
        reset_peak_rss()
        runs = []
        for _ in range(_repeat(job)):
            engine.reset_prefix_cache()  # each run computes what it shares itself
            started = time.perf_counter()
            outputs = embedder.embed_token_ids(workload["token_ids"], engine)
            vectors = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
            runs.append(time.perf_counter() - started)
        peak = peak_rss_bytes()
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1)
        prompt = sum(len(ids) for ids in workload["token_ids"])
        cached = sum(int(o.num_cached_tokens or 0) for o in outputs)
        records.append(
            _record(
                job,
                workload,
                runs,
                vectors,
                peak,
                error_rows=0,
                prompt_tokens=prompt,
                tokens_computed=prompt - cached,
            )  # fmt: skip
        )
    cache = engine.llm.llm_engine.vllm_config.cache_config
    import vllm

    description = (
        f"vllm {vllm.__version__} {engine.device} {engine.dtype}, block {engine.block_size}, "
        f"prefix caching {'on' if cache.enable_prefix_caching else 'off'}, "
        f"{'eager' if kwargs.get('enforce_eager') else 'compiled'}, "
        f"in-process core: {engine.engine_core_client}"
    )
    engine.close()
    return {"load_seconds": load_seconds, "engine": description, "records": records}


def _repeat(job: dict[str, Any]) -> int:
    repeat = int(job.get("repeat", 1))
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    return repeat


def _record(job, workload, runs, vectors, peak, **fields) -> dict[str, Any]:
    """A workload's record: ``seconds`` is the median of ``runs`` (each run's seconds)."""
    import statistics

    import numpy as np

    path = Path(job["vectors_dir"]) / f"{job['system']}-{workload['name']}.npy"
    np.save(path, vectors)
    rows = len(workload["token_ids"])
    seconds = statistics.median(runs)
    return {
        "name": workload["name"],
        "rows": rows,
        "seconds": seconds,
        "runs": list(runs),
        "rows_per_s": rows / seconds if seconds > 0 else None,
        "peak_rss_bytes": peak,
        "vectors": str(path),
        **fields,
    }


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    Path(job["vectors_dir"]).mkdir(parents=True, exist_ok=True)
    if job["system"] == "vllm":
        result = _vllm_system(job)
    else:
        result = _operator_system(job)
    return {"system": job["system"], "torch_threads": torch.get_num_threads(), **result}


def main(argv: list[str] | None = None) -> int:
    job_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    job = json.loads(Path(job_path).read_text())
    try:
        result = run_job(job)
    except Exception as error:  # reported to the parent, which records the failure
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    Path(result_path).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
