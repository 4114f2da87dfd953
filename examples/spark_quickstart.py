"""Spark quickstart: classify the bundled demo rows with one LLM column.

    python examples/spark_quickstart.py --limit 40 --partitions 2 --output /tmp/labels.parquet

The job is three lines of Spark:

1. ``co_locate(df, "prompt")`` puts rows that share a prompt prefix (here: a task's
   system prompt, instructions and few-shot examples) into the same partition, sorted,
   so each partition's batch shares as much as possible;
2. ``df.withColumn("out", llm_infer("prompt", model=...))`` adds a struct column
   ``text, finish_reason, prompt_tokens, completion_tokens, error, logprob,
   choice_logprobs`` (the last two null unless ``logprobs=True``): one partition is
   one batch planned as a whole (shared prefixes prefilled once, decode-first order);
3. select the fields you need and write them out.

A Spark session that is already running (a notebook's, a test suite's) is reused and
left running; otherwise a local one (``local[2]``, no UI) is started and stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 6
STOP = ["\n"]
SHOW_ROWS = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias, HF model directory or .gguf file"
    )
    parser.add_argument("--limit", type=int, default=40, help="demo rows to classify")
    parser.add_argument("--partitions", type=int, default=2, help="Spark partitions (batches)")
    parser.add_argument("--output", default=None, help="write the results here as Parquet")
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    return args


def get_spark() -> tuple[SparkSession, bool]:
    """The running Spark session, or a new local one; and whether this call started it.

    Workers must import llm_operator, so they run this interpreter (PYSPARK_PYTHON).
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession

    try:
        SparkSession.active()  # this thread's session, else the default one
        already_running = True
    except PySparkRuntimeError:  # NO_ACTIVE_OR_DEFAULT_SESSION
        already_running = False
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("llm-operator-quickstart")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()  # reuses a running session (its settings win)
    )
    return spark, not already_running


def demo_frame(spark: SparkSession, limit: int) -> DataFrame:
    """The first ``limit`` bundled demo rows as a DataFrame: id, task, prompt (plain text)."""
    from llm_operator.cli.demo_data import build_demo_rows

    rows = [(row["id"], row["task"], row["prompt"]) for row in build_demo_rows(limit=limit)]
    return spark.createDataFrame(rows, schema="id string, task string, prompt string")


def label_frame(df: DataFrame, *, model: str, partitions: int) -> DataFrame:
    """``df`` co-located by prompt prefix, with the model's answer and finish reason."""
    from llm_operator.integrations.spark import co_locate, llm_infer

    df = co_locate(df, "prompt", num_partitions=partitions)
    df = df.withColumn("out", llm_infer("prompt", model=model, max_tokens=MAX_TOKENS, stop=STOP))
    return df.select("id", "task", "out.text", "out.finish_reason")  # struct fields by name


def main(argv: Sequence[str] | None = None) -> int:
    """Run the quickstart; returns the process exit code."""
    args = parse_args(argv)
    spark, started_here = get_spark()
    try:
        frame = demo_frame(spark, args.limit)
        result = label_frame(frame, model=args.model, partitions=args.partitions).persist()
        began = time.perf_counter()
        count = result.count()  # runs the model once; later actions read the cache
        seconds = time.perf_counter() - began
        for row in result.orderBy("id").limit(SHOW_ROWS).collect():
            print(f"{row.id:>6} {row.task:<18} {row.finish_reason!s:<7} {row.text!r}")
        print(
            f"{count} rows in {seconds:.1f} s: {count / seconds:.2f} rows/s "
            f"({args.partitions} partitions, model load included)"
        )
        if args.output:
            result.write.mode("overwrite").parquet(args.output)
            print(f"wrote {args.output}")
        result.unpersist()
    finally:
        if started_here:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
