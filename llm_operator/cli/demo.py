"""The main job behind ``make demo``: classify the bundled reviews and tickets with SmolLM2.

Each row's output is constrained to its task's labels; every engine runs all rows in one
call (local: a ``SamplingParams`` per row; Spark and Dask: each row's labels in a column,
``choices_col="labels"``). ``compare_free`` also generates freely (up to a newline) and
compares both with the label a review's rating or category implies (``gold_label``).
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

DEMO_MAX_TOKENS = 6
DEMO_STOP = ("\n",)


class Classified(NamedTuple):
    """One pass over the demo's rows."""

    results: list  # GenerationResult per row, in row order
    labels: list  # the label each output names (demo_data.parse_label), or None
    seconds: float
    stats: Any  # the operator's RunStats on the local engine; None on spark and dask


def run_demo(args, options: dict) -> int:
    """``llm-operator demo``: ``args`` its arguments (model, limit, output, engine,
    partitions, compare_static, compare_engines, compare_free); ``options``: engine options
    (``llm_operator.options``) for every engine the demo runs."""
    from llm_operator import LLMOperator
    from llm_operator.cli.demo_data import build_demo_rows

    model, engine, partitions = args.model, args.engine, args.partitions
    rows = build_demo_rows(limit=args.limit)
    print(f"demo: {len(rows)} rows over {len({r['task'] for r in rows})} tasks, model {model}")
    started = time.perf_counter()
    op = LLMOperator(model, **options)
    prompts = [row["messages"] for row in rows]
    plan = op.plan(prompts, [_sampling(row, choices=True) for row in rows])
    print(plan.report())
    if engine == "local":
        op.backend()  # load the model now, so its time is reported apart
        print(f"model ready in {time.perf_counter() - started:.1f} s ({op.model.path})")
    run = dict(engine=engine, op=op, model=model, options=options, partitions=partitions)
    chosen = classify(rows, **run)
    free = classify(rows, **run, choices=False) if args.compare_free else None

    _print_samples(rows, chosen, free)
    _print_label_table(rows, chosen, free)
    print()
    if free is not None:
        _print_run("free generation", engine, partitions, rows, free, plan)
    _print_run("with choices" if free is not None else None, engine, partitions, rows, chosen, plan)
    _write_records(args.output, rows, chosen, free)
    print(f"wrote {args.output}")
    if args.compare_static:
        _compare_static(op, rows, free if engine == "local" else None)
    if args.compare_engines:
        _compare_engines(rows, run)
    return 0


def _sampling(row: dict, *, choices: bool):
    """A row's SamplingParams: its task's labels as choices, or free up to a newline."""
    from llm_operator import SamplingParams

    if choices:
        return SamplingParams(max_tokens=DEMO_MAX_TOKENS, choices=tuple(row["labels"]))
    return SamplingParams(max_tokens=DEMO_MAX_TOKENS, stop=DEMO_STOP)


def classify(
    rows: list[dict],
    *,
    engine: str,
    op,
    model: str,
    options: dict,
    partitions: int,
    choices: bool = True,
) -> Classified:
    """The demo's rows through ``engine``, in one call: "local" runs ``op`` with a
    SamplingParams per row; "spark" and "dask" run ``cli.engines.generate`` with each
    row's labels as its constraint (``choices_col``)."""
    from llm_operator.cli.demo_data import parse_label

    prompts = [row["messages"] for row in rows]
    if engine == "local":
        results = op.generate(prompts, [_sampling(row, choices=choices) for row in rows])
        stats = op.last_stats
        seconds = stats.seconds
    else:
        from llm_operator.cli.engines import generate

        sampling: dict[str, Any] = {"stop": DEMO_STOP}
        if choices:  # each row's task labels, from a column: one job over every task
            sampling = {"choices_col": "labels", "constraints": [row["labels"] for row in rows]}
        where = dict(engine=engine, model=model, partitions=partitions, max_tokens=DEMO_MAX_TOKENS)
        results, seconds, stats, _ = generate(prompts, **where, **sampling, **options)
    labels = [parse_label(r.text, row["labels"]) for r, row in zip(results, rows)]
    return Classified(results, labels, seconds, stats)


def _print_samples(rows: list[dict], chosen: Classified, free: Classified | None) -> None:
    print("\nsample outputs:")
    shown: Counter = Counter()
    for index, row in enumerate(rows):
        if shown[row["task"]] >= 2:
            continue
        shown[row["task"]] += 1
        snippet = row["input"][:70] + ("..." if len(row["input"]) > 70 else "")
        answer = repr(chosen.results[index].text)
        if free is not None:
            answer = f"free {free.results[index].text.strip()!r}, with choices {answer}"
        print(f"  [{row['task']}] {snippet!r} -> {answer}")


def _count(labels: list, gold: list) -> str:
    """ "agreeing/graded" over the rows with a gold label, "-" without any."""
    graded = [(label, want) for label, want in zip(labels, gold) if want is not None]
    if not graded:
        return "-"
    return f"{sum(label == want for label, want in graded)}/{len(graded)}"


def _print_label_table(rows: list[dict], chosen: Classified, free: Classified | None) -> None:
    """Per task: agreement with the implied labels (reviews only; tickets have none), and
    with compare_free the free outputs that name a label and agree with the choices."""
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    width = max(len(t) for t in [*tasks, "all"]) + 2
    if free is None:
        print("\nlabels by task (each output constrained to its task's labels):")
        header = ["rows", "agree with implied label"]
    else:
        print("\nlabels by task: free generation (up to a newline) and with choices:")
        header = ["rows", "free: name a label", "free: agree", "choices: agree", "same label"]

    def line(first: str, cells: list[str]) -> None:
        cells = [f"{cell:>{len(name) + 3}}" for cell, name in zip(cells, header)]
        print("  " + first.ljust(width) + "".join(cells))

    line("task", header)
    for task in [*tasks, "all"]:
        members = [i for i, row in enumerate(rows) if task in ("all", row["task"])]
        n, gold = len(members), [rows[i]["gold"] for i in members]
        agree = _count([chosen.labels[i] for i in members], gold)
        cells = [str(n), agree]
        if free is not None:
            free_labels = [free.labels[i] for i in members]
            named = sum(label is not None for label in free_labels)
            same = sum(free.labels[i] == chosen.labels[i] for i in members)
            cells = [str(n), f"{named}/{n}", _count(free_labels, gold), agree, f"{same}/{n}"]
        line(task, cells)
    print("  (implied labels: a review's star rating and product category; tickets have none)")


def _print_run(
    name: str | None, engine: str, partitions: int, rows: list[dict], run: Classified, plan
) -> None:
    named = sum(label is not None for label in run.labels)
    head = f"{name}: " if name else ""
    stats = run.stats
    if stats is not None:
        forced = f", {stats.forced_tokens} forced (jump-forward)" if stats.forced_tokens else ""
        print(
            f"{head}{stats.rows} rows in {stats.seconds:.1f} s: {stats.rows_per_second:.2f} "
            f"rows/s, {stats.output_tokens} output tokens{forced}; "
            f"{named}/{len(rows)} outputs name a label"
        )
        print(
            f"  prompt tokens {stats.prompt_tokens}, prefilled {stats.prefill_tokens_computed} "
            f"(minimum {stats.unique_prompt_tokens}); saving ratio {stats.saving_ratio:.1%}; "
            f"{stats.groups} groups"
        )
        return
    print(
        f"{head}{len(rows)} rows on {engine} (local mode, {partitions} partitions, one job over "
        f"every task, model loads included) in {run.seconds:.1f} s: "
        f"{len(rows) / run.seconds:.2f} rows/s; "
        f"{named}/{len(rows)} outputs name a label; plan saving ratio "
        f"{plan.stats.saving_ratio:.1%} over the whole job (each partition plans its own rows)"
    )


def _write_records(
    output: Path, rows: list[dict], chosen: Classified, free: Classified | None
) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        for index, row in enumerate(rows):
            result = chosen.results[index]
            record = {
                "id": row["id"],
                "task": row["task"],
                "input": row["input"],
                "output": result.text,
                "label": chosen.labels[index],
                "gold": row.get("gold"),
                "finish_reason": result.finish_reason,
                "error": result.error,
            }
            if free is not None:
                record["free_output"] = free.results[index].text
                record["free_label"] = free.labels[index]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _compare_engines(rows: list[dict], run: dict) -> None:
    """The same rows (with choices) through LLMOperator directly, Spark local and Dask;
    ``run``: ``classify``'s arguments but the engine."""
    from llm_operator.cli.engines import ENGINES

    runs = {engine: classify(rows, **{**run, "engine": engine}) for engine in ENGINES}
    print(
        f"\nengines side by side ({len(rows)} rows, {run['partitions']} partitions; spark and "
        "dask include model loads):"
    )
    print(f"  {'engine':<10}{'seconds':>10}{'rows/s':>10}{'same text as local':>22}")
    for engine, done in runs.items():
        same = sum(a.text == b.text for a, b in zip(done.results, runs["local"].results))
        print(
            f"  {engine:<10}{done.seconds:>10.1f}{len(rows) / done.seconds:>10.2f}"
            f"{same:>16}/{len(rows)}"
        )


def _compare_static(op, rows: list[dict], free: Classified | None) -> None:
    """Plain HF generate on fixed batches of the same size against our free generation
    (``free``, when it ran on the local engine; else run here), same rows, side by side."""
    from llm_operator.config import DEFAULT_MAX_BATCH_SIZE

    if free is None:
        free = classify(
            rows, engine="local", op=op, model="", options={}, partitions=1, choices=False
        )
    prompts = [row["messages"] for row in rows]
    sampling = _sampling(rows[0], choices=False) if rows else None
    # the batch size the backend runs (its config with the defaults filled in)
    config = getattr(op.backend(), "engine_config", op.config)
    batch_size = config.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    token_ids = op.prepare(prompts, sampling).token_ids
    valid = [i for i, ids in enumerate(token_ids) if ids is not None]
    prompt_ids = [token_ids[i] for i in valid]
    static = _static_generate(_hf_model(op), op.tokenizer, prompt_ids, batch_size)
    static_ids, static_prefilled, static_seconds = static
    ours = free.stats
    differ = [i for k, i in enumerate(valid) if list(free.results[i].token_ids) != static_ids[k]]
    print(f"\nside by side, free generation (same rows, batch size {batch_size}):")
    print(f"  {'system':<22}{'prefill tokens':>16}{'seconds':>10}{'rows/s':>10}")
    for system, prefilled, seconds in (
        ("hf-static (generate)", static_prefilled, static_seconds),
        ("llm-operator " + op.backend_name, ours.prefill_tokens_computed, ours.generate_seconds),
    ):
        print(f"  {system:<22}{prefilled:>16}{seconds:>10.1f}{len(valid) / seconds:>10.2f}")
    print(
        f"  speed-up {static_seconds / ours.generate_seconds:.2f}x; identical outputs "
        f"{len(valid) - len(differ)}/{len(valid)}; static real prompt tokens "
        f"{sum(map(len, prompt_ids))}"
    )
    if differ:
        print(f"  rows whose tokens differ: {differ[:20]}")


def _hf_model(op):
    """The operator's model as Hugging Face's causal LM, on its device and dtype: the hf
    backend's own, else loaded (the native engine's forward has no ``generate``)."""
    backend = op.backend()
    if op.backend_name == "hf":
        return backend.model
    from llm_operator.models import load_causal_lm

    return load_causal_lm(op.model_info.path, device=backend.device, dtype=backend.dtype)


def _static_generate(model, tokenizer, prompts: list, batch_size: int) -> tuple[list, int, float]:
    """What a user writes in a pandas UDF: greedy ``model.generate`` over ``prompts``
    (token ids), ``batch_size`` at a time in input order, left-padded, each batch run to
    completion (the benchmark's ``hf-static`` baseline, for the demo's rows). Returns (the
    tokens generated per prompt, cut after the first EOS; the prompt positions computed,
    padding included; seconds)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    generation_config = copy.deepcopy(model.generation_config)
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    padded = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(prompts), batch_size):
            batch = prompts[begin : begin + batch_size]
            width = max(len(p) for p in batch)
            padded += width * len(batch)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            generated = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                generation_config=generation_config,
                max_new_tokens=DEMO_MAX_TOKENS,
                do_sample=False,
                pad_token_id=pad,
                stop_strings=list(DEMO_STOP),
                tokenizer=tokenizer,
            )
            for row in generated[:, width:].tolist():
                row = row[:DEMO_MAX_TOKENS]
                row = row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))]
                while row and row[-1] == pad and pad not in eos_ids:
                    row.pop()  # generate pads rows that ended on a stop string
                outputs.append(row)
    return outputs, padded, time.perf_counter() - started
