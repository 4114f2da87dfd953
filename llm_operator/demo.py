"""The main job behind ``make demo``: classify the bundled reviews and tickets with SmolLM2."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

DEMO_MAX_TOKENS = 6
DEMO_STOP = ("\n",)


def run_demo(
    *,
    model: str,
    limit: int | None,
    output: Path,
    compare_static: bool = False,
    engine: str = "local",
    partitions: int = 2,
    compare_engines: bool = False,
    options: dict | None = None,
) -> int:
    """options: engine options (``llm_operator.options``) for every engine the demo runs."""
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.demo_data import build_demo_rows, parse_label

    rows = build_demo_rows(limit=limit)
    print(f"demo: {len(rows)} rows over {len({r['task'] for r in rows})} tasks, model {model}")
    started = time.perf_counter()
    options = dict(options or {})
    op = LLMOperator(model, **options)
    sampling = SamplingParams(max_tokens=DEMO_MAX_TOKENS, stop=DEMO_STOP)
    prompts = [row["messages"] for row in rows]
    plan = op.plan(prompts, sampling)
    print(plan.report())
    if engine == "local":
        op.backend()  # load the model now, so its time is reported apart
        print(f"model ready in {time.perf_counter() - started:.1f} s ({op.model.path})")
        results = op.generate(prompts, sampling)
    else:
        results, seconds = _run_engine(engine, model, prompts, options, partitions)
        print(
            f"{engine} (local mode, {partitions} partitions, model loads included): {seconds:.1f} s"
        )
    stats = op.last_stats if engine == "local" else None

    labels = [parse_label(r.text, row["labels"]) for r, row in zip(results, rows)]
    print("\nsample outputs:")
    shown: Counter = Counter()
    for row, result, label in zip(rows, results, labels):
        if shown[row["task"]] >= 2:
            continue
        shown[row["task"]] += 1
        snippet = row["input"][:70] + ("..." if len(row["input"]) > 70 else "")
        print(f"  [{row['task']}] {snippet!r} -> {result.text.strip()!r} (label: {label})")
    parsed = sum(label is not None for label in labels)
    graded = [(label, row["gold"]) for label, row in zip(labels, rows) if row.get("gold")]
    if graded:
        correct = sum(label == gold for label, gold in graded)
        print(
            f"\nagreement with the labels implied by ratings and categories: {correct}/{len(graded)}"
        )
    if stats is not None:
        print(
            f"\n{stats.rows} rows in {stats.seconds:.1f} s: {stats.rows_per_second:.2f} rows/s, "
            f"{stats.output_tokens} output tokens ({stats.output_tokens_per_second:.1f}/s); "
            f"{parsed}/{len(rows)} outputs name a label"
        )
        print(
            f"prompt tokens {stats.prompt_tokens}, prefilled {stats.prefill_tokens_computed} "
            f"(minimum {stats.unique_prompt_tokens}); saving ratio {stats.saving_ratio:.1%}; "
            f"{stats.groups} groups"
        )
    else:
        print(
            f"\n{len(rows)} rows in {seconds:.1f} s: {len(rows) / seconds:.2f} rows/s; "
            f"{parsed}/{len(rows)} outputs name a label; plan saving ratio "
            f"{plan.stats.saving_ratio:.1%} over the whole job (each partition plans its own rows)"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        for row, result, label in zip(rows, results, labels):
            record = {
                "id": row["id"],
                "task": row["task"],
                "input": row["input"],
                "output": result.text,
                "label": label,
                "gold": row.get("gold"),
                "finish_reason": result.finish_reason,
                "error": result.error,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {output}")
    if compare_static:
        _compare_static(op, op.backend(), prompts, results, sampling, op.config.max_batch_size)
    if compare_engines:
        _compare_engines(model, prompts, options, partitions)
    return 0


def _run_engine(engine: str, model: str, prompts, options: dict, partitions: int):
    """(results, seconds) of the demo's rows on one engine."""
    from llm_operator.integrations.engines import generate

    results, seconds, _ = generate(
        prompts,
        engine=engine,
        model=model,
        partitions=partitions,
        max_tokens=DEMO_MAX_TOKENS,
        stop=DEMO_STOP,
        **options,
    )
    return results, seconds


def _compare_engines(model: str, prompts, options: dict, partitions: int) -> None:
    """The same rows through LLMOperator directly, Spark local and Dask, side by side."""
    timings = {}
    texts = {}
    for engine in ("local", "spark", "dask"):
        results, seconds = _run_engine(engine, model, prompts, options, partitions)
        timings[engine] = seconds
        texts[engine] = [r.text for r in results]
    print(
        f"\nengines side by side ({len(prompts)} rows, {partitions} partitions; model loads included):"
    )
    print(f"  {'engine':<10}{'seconds':>10}{'rows/s':>10}{'same text as local':>22}")
    for engine, seconds in timings.items():
        same = sum(a == b for a, b in zip(texts[engine], texts["local"]))
        print(
            f"  {engine:<10}{seconds:>10.1f}{len(prompts) / seconds:>10.2f}{same:>16}/{len(prompts)}"
        )


def _compare_static(op, backend, prompts, results, sampling, batch_size: int) -> None:
    """Plain HF generate on fixed batches of the same size, same rows, side by side."""
    from llm_operator.bench.hf_static import run_hf_static

    token_ids = op.prepare(prompts, sampling).token_ids
    valid = [i for i, ids in enumerate(token_ids) if ids is not None]
    static = run_hf_static(
        backend.model,
        op.tokenizer,
        [token_ids[i] for i in valid],
        max_tokens=sampling.max_tokens,
        batch_size=batch_size,
        stop=sampling.stop,
    )
    ours = op.last_stats
    differ = [i for k, i in enumerate(valid) if list(results[i].token_ids) != static.token_ids[k]]
    same = len(valid) - len(differ)
    print(f"\nside by side (same rows, batch size {batch_size}):")
    print(f"  {'system':<22}{'prefill tokens':>16}{'seconds':>10}{'rows/s':>10}")
    print(
        f"  {'hf-static (generate)':<22}{static.padded_prompt_tokens:>16}{static.seconds:>10.1f}"
        f"{len(valid) / static.seconds:>10.2f}"
    )
    print(
        f"  {'llm-operator hf':<22}{ours.prefill_tokens_computed:>16}{ours.generate_seconds:>10.1f}"
        f"{len(valid) / ours.generate_seconds:>10.2f}"
    )
    print(
        f"  speed-up {static.seconds / ours.generate_seconds:.2f}x; "
        f"identical outputs {same}/{len(valid)}; static real prompt tokens {static.prompt_tokens}"
    )
    if differ:
        print(f"  rows whose tokens differ: {differ[:20]}")
