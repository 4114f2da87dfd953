"""The GPU's proxies that any CPU can measure: ``llm-operator bench host``.

On a GPU the host must keep up: a 1B model's decode step over 1,024 rows takes a few
milliseconds there, and every kernel launch costs microseconds of host time. Two
figures show progress on that without a GPU:

- **host milliseconds per iteration** at ``--rows`` (1,024) decoding rows: the native
  engine's own ``last_profile.host`` (scheduling, building the step's inputs, handing the
  sampled tokens to the run and the scheduler; the model, the head and sampling on the
  device excluded), median over the decode-only steps of that many rows, medians of
  ``--repeat`` runs. The model is a tiny random Llama (hidden 64, 2 layers) with
  SmolLM2's tokenizer (49,152 tokens), so the host work is real and the model cheap;
  ``schedule_ms`` and ``sample_ms`` are the run's whole ``schedule`` and ``sample``
  seconds over its iterations (the split the engine reported before ``host`` existed).
- **ops dispatched per layer per decode step** on the path CUDA takes (the Triton
  attention and elementwise kernels, ``kernels="triton"`` under the Triton
  interpreter, graphs off so the eager launches are counted): ATen ops by a
  ``TorchDispatchMode`` and Triton launches, over one decode step of 16 rows, per layer.
  With CUDA graphs on, a decode step is one graph launch: this is what one replays.

Results go to ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

COUNT_ROWS = 16  # decode rows of the op-count step
SHARED = "You are a careful data labeller. Read the review and answer with one label. " * 4


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tiny_model_with_smollm2_tokenizer(cache: Path) -> Path:
    """A tiny random Llama (``bench.testing.tiny``) over SmolLM2's tokenizer, built once in
    ``cache``."""
    model_dir = cache / "tiny-llama-smollm2-tokenizer"
    if (model_dir / "config.json").is_file():
        return model_dir
    from transformers import AutoTokenizer

    from llm_operator.models.registry import resolve_model
    from llm_operator_bench.testing.tiny import build_tiny_model

    tokenizer_dir = cache / "smollm2-tokenizer"
    smollm2 = resolve_model("smollm2-135m-instruct").path
    AutoTokenizer.from_pretrained(smollm2, local_files_only=True).save_pretrained(tokenizer_dir)
    return build_tiny_model(model_dir, "llama", tokenizer_dir, seed=1)


def prompts(rows: int) -> list[str]:
    """``rows`` prompts in 8 groups sharing a long prefix, each with its own short tail."""
    return [f"{SHARED} Task {i % 8}. Review {i}: item {i * 7} arrived late." for i in range(rows)]


def measure_host(model_dir: Path, *, rows: int, max_tokens: int, repeat: int) -> dict[str, Any]:
    """The native engine's host milliseconds per decode step at ``rows`` rows."""
    from llm_operator import LLMOperator, SamplingParams

    op = LLMOperator(
        str(model_dir), backend="native", max_batch_size=rows, prefill_batch_tokens=16384
    )
    batch = prompts(rows)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    op.generate(batch[:64], params)  # warm: kernels loaded, GEMMs chosen
    runs = []
    for _ in range(repeat):
        op.generate(batch, params)
        profile = op.backend().last_profile
        host = [h for h, step in zip(profile.host, profile.steps) if step[0] == step[1] == rows]
        if not host:
            raise RuntimeError(
                f"no decode step ran {rows} rows (max_running {profile.max_running})"
            )
        runs.append(
            {
                "host_ms": 1e3 * statistics.median(host),
                "schedule_ms": 1e3 * profile.schedule / profile.iterations,
                "sample_ms": 1e3 * profile.sample / profile.iterations,
                "decode_steps": len(host),
                "iterations": profile.iterations,
            }
        )
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "runs": runs,
        "host_ms": statistics.median(r["host_ms"] for r in runs),
        "schedule_ms": statistics.median(r["schedule_ms"] for r in runs),
        "sample_ms": statistics.median(r["sample_ms"] for r in runs),
    }


def count_ops(model_dir: Path) -> dict[str, Any]:
    """Ops per layer of one decode step on the CUDA path (run in a child process: the
    Triton interpreter must be set before triton is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = (
        "from llm_operator_bench.suites.host import _count_ops_here; "
        f"_count_ops_here({str(model_dir)!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"the op count failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _count_ops_here(model_dir: str) -> None:
    """In a process with the Triton interpreter: count one decode step's ops, print JSON."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.models.llama import LlamaModel

    aten: Counter = Counter()
    launches: Counter = Counter()
    counting = {"on": False}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counting["on"]:
                aten[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if not counting["on"]:
            return run(self, *args, **kwargs)
        launches[getattr(self.fn, "__name__", "kernel")] += 1
        counting["on"] = False  # the interpreter's own tensor work is not a GPU launch
        try:
            return run(self, *args, **kwargs)
        finally:
            counting["on"] = True

    InterpretedFunction.run = counted_run
    forward = LlamaModel.forward
    steps: list[dict[str, Any]] = []

    def counted_forward(self, input_ids, positions, attention, *args):
        decode = input_ids.shape[0] == COUNT_ROWS
        aten.clear()
        launches.clear()
        counting["on"] = decode
        with Count():
            hidden = forward(self, input_ids, positions, attention, *args)
        counting["on"] = False
        if decode:
            steps.append({"aten": dict(aten), "triton": dict(launches)})
        return hidden

    LlamaModel.forward = counted_forward
    op = LLMOperator(
        model_dir, backend="native", kernels="triton", cuda_graphs="off", dtype="float32"
    )
    op.generate(prompts(COUNT_ROWS), SamplingParams(max_tokens=3, ignore_eos=True))
    backend = op.backend()
    layers = backend.model.config.num_layers
    last = steps[-1]
    aten_total, triton_total = sum(last["aten"].values()), sum(last["triton"].values())
    print(
        json.dumps(
            {
                "rows": COUNT_ROWS,
                "layers": layers,
                "elementwise_ops": type(backend.ops).__name__,
                "aten_per_layer": aten_total / layers,
                "triton_per_layer": triton_total / layers,
                "per_layer": (aten_total + triton_total) / layers,
                "per_step": aten_total + triton_total,
                "aten": last["aten"],
                "triton": last["triton"],
            }
        )
    )


def run_host_bench(
    *, rows: int, max_tokens: int, repeat: int, out: Path, name: str, cache: Path | None = None
) -> dict[str, Any]:
    """Both proxies, with the machine's CPU named; writes ``out/name.json`` and ``.md``."""
    import platform

    import torch

    from llm_operator.estimate.calibration import cpu_name
    from llm_operator.models.registry import default_cache_dir

    cache = cache or default_cache_dir() / "bench"
    model_dir = tiny_model_with_smollm2_tokenizer(cache)
    _log(f"host ms per decode step at {rows} rows ({repeat} runs) ...")
    host = measure_host(model_dir, rows=rows, max_tokens=max_tokens, repeat=repeat)
    _log("ops per layer of a decode step on the CUDA path (Triton interpreter) ...")
    ops = count_ops(model_dir)
    report = {
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host,
        "ops": ops,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    host, ops = report["host"], report["ops"]
    lines = [
        f"CPU: {report['cpu']} ({report['threads']} threads), torch {report['torch']}",
        "",
        "| proxy | value |",
        "|---|---:|",
        f"| host ms per decode step, {host['rows']} rows (median) | {host['host_ms']:.2f} |",
        f"| schedule ms per iteration (run mean) | {host['schedule_ms']:.2f} |",
        f"| sample ms per iteration (run mean) | {host['sample_ms']:.2f} |",
        f"| ops per layer per decode step, CUDA path ({ops['elementwise_ops']}) | "
        f"{ops['per_layer']:.1f} ({ops['aten_per_layer']:.1f} ATen + "
        f"{ops['triton_per_layer']:.1f} Triton) |",
        "",
    ]
    return "\n".join(lines)
