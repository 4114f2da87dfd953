"""Co-location by default, measured on whole frames: ``llm-operator bench frames``.

Spark (local mode, 2 task slots) and Dask (a LocalCluster of 2 single-threaded worker
processes) run the same frames through ``llm_infer_df`` and Dask's ``llm_infer`` twice:
with the default (rows sharing a prefix co-located first, unless a sample shows it
cannot help) and with ``co_locate=False`` (the frame's partitions as they are). A tiny
random model keeps the model's share small, so the shuffle's cost shows. Three shapes:

    shuffled     groups of rows that share a long instruction, scattered over partitions
    co-located   the same groups, each already whole in one partition
    no-sharing   prompts that share nothing

and the same on SmolLM2 with the demo's bundled reviews and tickets (few-shot tasks,
chat messages), shuffled. Each run writes its output (Spark: Parquet; Dask: computed),
and the partitions' statistics log (``stats_log``) gives the prefill computed.

    llm-operator bench frames --rows 10000,100000 --partitions 4,16

Results go to ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = ("shuffled", "co-located", "no-sharing")
GROUP_ROWS = 16  # rows per group of a sharing shape
TOPICS = ("battery", "shipping", "refund", "login", "screen", "printer", "tent", "blender",
          "router", "kettle", "camera", "mattress", "jacket", "charger", "headphones", "drill")  # fmt: skip
MAX_TOKENS = 2


def prompt_text(row: int, rows: int, shape: str) -> str:
    """Row ``row``'s prompt in a frame of ``rows`` rows of ``shape``: a group's shared
    instruction (about 100 tokens), then a short part of its own."""
    groups = max(1, rows // GROUP_ROWS)
    if shape == "no-sharing":
        return f"{row * 7919 % 1000003} {TOPICS[row % 16]} review: it broke after {row} days."
    if shape == "shuffled":  # a group's rows spread evenly over every partition
        group = (row * 2654435761) % groups
    else:  # contiguous rows: range partitions hold whole groups
        group = row * groups // rows
    topic = TOPICS[group % len(TOPICS)]
    return (
        f"Task {group}: you label messages about the {topic}. Read the message, then answer "
        f"with one word for the problem, one for the mood and one for the urgency of the "
        f"{topic} case number {group}. Examples: the {topic} stopped after a week, angry, "
        f"high; the {topic} arrived late but works, calm, low; the {topic} is noisy, "
        f"annoyed, medium; support never answered about the {topic}, angry, high. "
        f"Message {row}: the {topic} broke on day {row % 97}."
    )


def build_model(path: Path) -> Path:
    """A tiny random Llama with a tokenizer trained on these prompts' words."""
    from llm_operator_bench.testing import tiny

    if (path / "model.safetensors").exists():
        return path
    corpus = [prompt_text(row, 2000, shape) for row in range(2000) for shape in SHAPES]
    tokenizer_dir = tiny.build_tiny_tokenizer(path / "tokenizer", corpus, vocab_size=400)
    return tiny.build_tiny_model(path, "llama", tokenizer_dir, 0)


class _Decisions(logging.Handler):
    """The co-location lines the job logs (logger ``llm_operator.integrations``): whether
    it moved rows or skipped, and the seconds its sample and plan took."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("llm_operator.integrations")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "co-location" in message:
            self.lines.append(message)

    def __enter__(self) -> _Decisions:
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *_: Any) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)

    def figures(self) -> dict[str, Any]:
        import re

        if not self.lines:
            return {"co_location": "off", "co_location_seconds": 0.0}
        line = self.lines[-1]
        seconds = re.search(r"(\d+\.\d+) s\)$", line)
        return {
            "co_location": "skipped" if "co-location skipped" in line else "moved",
            "co_location_seconds": float(seconds.group(1)) if seconds else None,
        }


def _prefill(log: Path) -> int:
    if not log.exists():
        return 0
    return sum(json.loads(line)["prefill_tokens"] for line in log.read_text().splitlines())


def _table(prompts_of, rows: int):
    import pandas as pd

    ids = range(rows)
    return pd.DataFrame(
        {"id": pd.array(list(ids), dtype="int64"),
         "prompt": pd.array([prompts_of(row) for row in ids], dtype=object)}
    )  # fmt: skip


def spark_run(spark, model: str, prompts_of, rows: int, partitions: int, options: dict,
              work: Path) -> dict[str, Any]:  # fmt: skip
    """One frame through ``llm_infer_df``: seconds, rows/s, prefill computed. The frame is
    cached first (a table in memory), in ``partitions`` ranges of ``id``."""
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import llm_infer_df

    log = work / f"spark-{time.monotonic_ns()}.jsonl"
    df = spark.createDataFrame(_table(prompts_of, rows))
    df = df.repartitionByRange(partitions, "id").cache()
    df.count()
    path = str(work / "spark-output.parquet")
    started = time.perf_counter()  # co-location's count and sample included
    with _Decisions() as decisions:
        out = llm_infer_df(df, "prompt", model=model, stats_log=str(log), **options)
        out.select("id", "out.text", "out.finish_reason").write.mode("overwrite").parquet(path)
    seconds = time.perf_counter() - started
    df.unpersist()
    written = spark.read.parquet(path)
    check = written.agg(
        F.count("*").alias("rows"),
        F.countDistinct("id").alias("ids"),
        F.sum((F.col("finish_reason") == "error").cast("long")).alias("errors"),
    ).first()
    result = _result(rows, seconds, log, check["rows"], check["ids"], check["errors"])
    return {**result, **decisions.figures()}


def dask_run(client, model: str, prompts_of, rows: int, partitions: int, options: dict,
             work: Path) -> dict[str, Any]:  # fmt: skip
    """One frame through Dask's ``llm_infer`` on the client's cluster (the frame persisted
    on the workers first, in ``partitions`` ranges of rows)."""
    import dask.dataframe as dd
    from distributed import wait

    from llm_operator.integrations.dask import llm_infer

    log = work / f"dask-{time.monotonic_ns()}.jsonl"
    ddf = dd.from_pandas(_table(prompts_of, rows), npartitions=partitions).persist()
    wait(ddf)
    started = time.perf_counter()  # co-location's sample pass included
    with _Decisions() as decisions:
        out = llm_infer(ddf, "prompt", output="out", model=model, stats_log=str(log), **options)
        result = out[["id", "out_finish_reason"]].compute()
    seconds = time.perf_counter() - started
    errors = int((result["out_finish_reason"] == "error").sum())
    figures = _result(rows, seconds, log, len(result), result["id"].nunique(), errors)
    return {**figures, **decisions.figures()}


def _result(rows, seconds, log, got, ids, errors) -> dict[str, Any]:
    assert got == rows and ids == rows, f"{rows} rows in, {got} out ({ids} distinct ids)"
    return {
        "seconds": round(seconds, 3),
        "rows_per_second": round(rows / seconds, 1),
        "prefill_tokens": _prefill(log),
        "error_rows": int(errors),
    }


class _Prompts:
    """A picklable ``row -> prompt`` for one frame (workers build the rows)."""

    def __init__(self, rows: int, shape: str) -> None:
        self.rows, self.shape = rows, shape

    def __call__(self, row: int) -> str:
        return prompt_text(int(row), self.rows, self.shape)


def run_frames(
    *,
    rows: list[int],
    partitions: list[int],
    engines: list[str],
    shapes: list[str],
    smollm2: bool,
    out: Path,
    name: str,
    repeat: int = 1,
) -> dict[str, Any]:
    """Every (engine, rows, partitions, shape) with and without co-location, then SmolLM2;
    writes ``out/name.json`` and ``.md``."""
    import platform

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="llm-operator-frames-"))
    model = str(build_model(work / "tiny"))
    report: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                              "repeat": repeat, "runs": []}  # fmt: skip
    modes = {"default": {}, "co_locate=False": {"co_locate": False}}
    for engine in engines:
        runner, handle, close = _engine(engine)
        try:
            # warm-up: every worker builds its engine once
            runner(handle, model, _Prompts(200, "shuffled"), 200, 2, {"max_tokens": 1}, work)
            for count in rows:
                for parts in partitions:
                    for shape in shapes:
                        for attempt in range(repeat):  # the two modes alternate
                            for mode, extra in modes.items():
                                options = {"max_tokens": MAX_TOKENS, **extra}
                                prompts = _Prompts(count, shape)
                                result = runner(handle, model, prompts, count, parts, options, work)
                                run = {"engine": engine, "model": "tiny", "rows": count,
                                       "partitions": parts, "shape": shape, "mode": mode,
                                       "attempt": attempt, **result}  # fmt: skip
                                report["runs"].append(run)
                                print(json.dumps(run), flush=True)
            if smollm2:
                report["runs"] += _smollm2_runs(engine, runner, handle, work, modes, repeat)
        finally:
            close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(report))
    return report


def _smollm2_runs(engine, runner, handle, work, modes, repeat: int) -> list[dict[str, Any]]:
    """The demo's reviews and tickets (few-shot tasks) as one chat prompt JSON per row,
    ``repeat`` times with the modes alternating, after one warm-up."""
    from llm_operator.cli.demo_data import build_demo_rows

    rows = build_demo_rows()  # system + user message: one text, as a user message
    texts = ["\n\n".join(m["content"] for m in row["messages"]) for row in rows]
    prompts_of = _Listed(texts)
    # warm-up: every worker loads SmolLM2 and checks its kernels once, outside the timing
    runner(handle, "smollm2-135m-instruct", prompts_of, 8, 4, {"max_tokens": 1}, work)
    results = []
    for attempt in range(repeat):
        for mode, extra in modes.items():
            options = {"max_tokens": 4, **extra}
            result = runner(handle, "smollm2-135m-instruct", prompts_of, len(texts), 4, options,
                            work)  # fmt: skip
            run = {"engine": engine, "model": "smollm2-135m-instruct", "rows": len(texts),
                   "partitions": 4, "shape": "demo tasks, shuffled", "mode": mode,
                   "attempt": attempt, **result}  # fmt: skip
            print(json.dumps(run), flush=True)
            results.append(run)
    return results


class _Listed:
    """``row -> prompt`` over a list, in a shuffled order (groups spread over partitions)."""

    def __init__(self, texts: list[str]) -> None:
        import random

        self.texts = list(texts)
        random.Random(0).shuffle(self.texts)

    def __call__(self, row: int) -> str:
        return self.texts[int(row)]


def _engine(engine: str):
    """(runner, handle, close) for ``engine``."""
    if engine == "spark":
        from llm_operator.integrations.spark_session import local_session

        spark = local_session(2, "llm-operator-bench-frames")
        return spark_run, spark, spark.stop
    if engine == "dask":
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True)
        client = Client(cluster)

        def close() -> None:
            client.close()
            cluster.close()

        return dask_run, client, close
    raise ValueError(f"engine must be spark or dask, got {engine!r}")


def markdown(report: dict[str, Any]) -> str:
    """One line per frame: both modes side by side."""
    lines = [
        "| engine | model | rows | partitions | shape | default s | rows/s | prefill | "
        "co_locate=False s | rows/s | prefill | speed-up | prefill ratio | co-location |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keyed: dict[tuple, dict[str, list[dict]]] = {}
    for run in report["runs"]:
        key = (run["engine"], run["model"], run["rows"], run["partitions"], run["shape"])
        keyed.setdefault(key, {}).setdefault(run["mode"], []).append(run)
    for key, modes in keyed.items():
        if "default" not in modes or "co_locate=False" not in modes:
            continue
        on, off = _median(modes["default"]), _median(modes["co_locate=False"])
        speed = off["seconds"] / on["seconds"] if on["seconds"] else 0.0
        ratio = on["prefill_tokens"] / off["prefill_tokens"] if off["prefill_tokens"] else 0.0
        lines.append(
            f"| {' | '.join(str(k) for k in key[:2])} | {key[2]:,} | {key[3]} | {key[4]} | "
            f"{on['seconds']:.1f} | {on['rows_per_second']:,.0f} | {on['prefill_tokens']:,} | "
            f"{off['seconds']:.1f} | {off['rows_per_second']:,.0f} | {off['prefill_tokens']:,} | "
            f"{speed:.2f}x | {ratio:.2f} | {on.get('co_location', '')}, "
            f"{on.get('co_location_seconds') or 0:.2f} s |"
        )
    return "\n".join(lines) + "\n"


def _median(runs: list[dict]) -> dict:
    """The run of median seconds (the lower middle of an even count), its figures whole."""
    ordered = sorted(runs, key=lambda run: run["seconds"])
    return ordered[(len(ordered) - 1) // 2]
