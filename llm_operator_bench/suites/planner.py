"""How fast the prefix planner plans an ETL-shaped batch (no model involved).

    python -m llm_operator_bench.suites.planner --prompts 100000

The synthetic workload: about 50 task prefixes (system prompt, instructions, few-shot
examples; 60-80% of the prompt), each with a few second-level documents (4-16%), then a
random per-row part (the rest, 6-40%); token ids are random ints below 50,000. Rows are in
random task order, as a dataframe partition would be.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from llm_operator.planner import build_plan

_VOCABULARY = 50_000
_TASKS = 50
_DOCUMENTS_PER_TASK = (2, 6)  # [low, high)


def make_workload(
    num_prompts: int, prompt_tokens: int = 500, *, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Deterministic (prompts, max_tokens) shaped like an ETL job; prompts near prompt_tokens long."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if prompt_tokens < 20:
        raise ValueError(f"prompt_tokens must be >= 20, got {prompt_tokens}")
    rng = np.random.default_rng(seed)

    def random_tokens(count: int) -> list[int]:
        return rng.integers(0, _VOCABULARY, size=count).tolist()

    tasks = [
        random_tokens(int(rng.integers(prompt_tokens * 6 // 10, prompt_tokens * 8 // 10 + 1)))
        for _ in range(_TASKS)
    ]
    documents = [
        [
            random_tokens(int(rng.integers(prompt_tokens // 25, prompt_tokens * 4 // 25 + 1)))
            for _ in range(int(rng.integers(*_DOCUMENTS_PER_TASK)))
        ]
        for _ in range(_TASKS)
    ]
    task_of_row = rng.integers(0, _TASKS, size=num_prompts)
    document_draw = rng.integers(0, 1 << 30, size=num_prompts)
    low, high = max(1, prompt_tokens * 6 // 100), prompt_tokens * 40 // 100
    jitter = rng.integers(-prompt_tokens // 25, prompt_tokens // 25 + 1, size=num_prompts)
    prompts: list[list[int]] = []
    for row in range(num_prompts):
        task = int(task_of_row[row])
        task_documents = documents[task]
        document = task_documents[int(document_draw[row]) % len(task_documents)]
        head = len(tasks[task]) + len(document)
        suffix_length = int(np.clip(prompt_tokens - head + jitter[row], low, high))
        prompts.append(tasks[task] + document + random_tokens(suffix_length))
    max_tokens = rng.integers(8, 129, size=num_prompts).tolist()
    return prompts, max_tokens


def run_planner_benchmark(num_prompts: int, prompt_tokens: int = 500, *, seed: int = 0) -> dict:
    """Plan a synthetic ETL batch once; return sizes, timings and the plan's sharing figures.

    Keys: prompts, tokens, seconds (planning only), prompts_per_second, tokens_per_second,
    groups, segments, saving_ratio, and workload_seconds (building the synthetic prompts).
    """
    started = time.perf_counter()
    prompts, max_tokens = make_workload(num_prompts, prompt_tokens, seed=seed)
    workload_seconds = time.perf_counter() - started
    started = time.perf_counter()
    plan = build_plan(prompts, max_tokens)
    seconds = time.perf_counter() - started
    tokens = plan.stats.prompt_tokens
    return {
        "prompts": num_prompts,
        "tokens": tokens,
        "seconds": seconds,
        "prompts_per_second": num_prompts / seconds if seconds else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "groups": plan.stats.groups,
        "segments": plan.stats.segments,
        "saving_ratio": plan.stats.saving_ratio,
        "workload_seconds": workload_seconds,
    }


def run_planner_suite(
    sizes: list[int], prompt_tokens: int = 500, *, seed: int = 0, out: Path | None = None
) -> dict:
    """``llm-operator bench planner``: the planner alone at each batch size, one after another.

    Prints a line per size and writes ``out`` (JSON with the machine) when given.
    """
    import gc
    import os
    import platform

    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"--prompts must be positive batch sizes, got {sizes}")
    results = []
    for size in sizes:
        result = run_planner_benchmark(size, prompt_tokens, seed=seed)
        gc.collect()
        results.append(result)
        print(
            f"planner: {size:>9,} prompts, {result['tokens']:>12,} tokens: "
            f"{result['seconds']:7.2f} s, {result['prompts_per_second']:>10,.0f} prompts/s, "
            f"{result['tokens_per_second'] / 1e6:6.1f} M tokens/s, {result['groups']} groups, "
            f"saving {result['saving_ratio']:.1%}",
            flush=True,
        )
    report = {
        "prompt_tokens": prompt_tokens,
        "seed": seed,
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"planner: wrote {out}")
    return report


def main(argv: list[str] | None = None) -> None:
    """Command line: print the benchmark result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10_000, help="prompts in the batch")
    parser.add_argument("--prompt-tokens", type=int, default=500, help="tokens per prompt")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    result = run_planner_benchmark(arguments.prompts, arguments.prompt_tokens, seed=arguments.seed)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
