"""Every entry point on every place users deploy: rows in, rows out, equal to a local run.

    python -m llm_operator_bench.suites.deploy_matrix [--model DIR_OR_ALIAS] [--out FILE.json]
        [--envs spark-local,spark-cluster,spark-connect,dask-cluster]

Each environment runs in its own process (one process holds one SparkContext):
``spark-local`` (classic ``local[2]``), ``spark-cluster`` (``local-cluster[2,1,1024]``:
a standalone master and two executor JVMs), ``spark-connect`` (a Spark Connect server
started from the installed PySpark's ``sbin``, the client in this process talking gRPC
to it), ``dask-cluster`` (a ``distributed.LocalCluster`` of two worker processes). In
each, every entry point runs over the same table (shared prefixes, a null prompt, a
duplicated row) and its outputs are compared row by row with ``LLMOperator`` run in the
parent process on the same prompts (for ``reorder_fields``, rendered in the order the
local planner chooses). Prints a Markdown table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_TOKENS = 8
GROUPS = (
    "You label support tickets for the billing team. Classify the ticket: ",
    "Summarize the customer review below in one short sentence. Review: ",
    "Extract the product name and the main complaint from this review: ",
)
TAILS = (
    "The battery lasts two full days.",
    "Shipping took 12 days and the box arrived crushed.",
    "Great value for the price, would buy again.",
    "The app crashes every time I open the settings page.",
    "Refund received, thank you for the quick help!",
)
CHOICES = ["billing", "shipping", "product"]
SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": CHOICES}},
    "required": ["label"],
}
TEMPLATE = "Review the product.\nTitle: {title}\nCategory: {category}\nIs it good?"
ENVS = ("spark-local", "spark-cluster", "spark-connect", "dask-cluster")


def table_rows() -> list[dict[str, Any]]:
    """30 rows: groups interleaved by id, one null prompt, one row repeating another."""
    rows = []
    for i in range(30):
        prompt = f"{GROUPS[i % 3]}{TAILS[(i // 3) % 5]}"
        rows.append(
            {
                "id": i,
                "prompt": None if i == 7 else prompt,
                "title": TAILS[i % 5][:20],
                "category": ("books", "audio", "garden")[i % 3],
            }
        )
    rows[12]["prompt"] = rows[2]["prompt"]
    return rows


# (entry point, the options it runs with, whether its prompts come from the template)
CASES: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("withColumn(llm_infer)", {}, "prompt"),
    ("llm_infer_df", {}, "prompt"),
    ("llm_infer_df dedupe", {"dedupe": True}, "prompt"),
    ("llm_infer_df reorder_fields", {"reorder_fields": True}, "template"),
    ("co_locate + llm_infer", {}, "prompt"),
    ("choices", {"choices": CHOICES}, "prompt"),
    ("json_schema (typed value)", {"json_schema": SCHEMA}, "prompt"),
    ("CLI run", {}, "prompt"),
)


# -- the reference: the operator in this process ---------------------------------------
def reference(model: str) -> dict[str, dict[int, list]]:
    """Case -> id -> [text, whether the row has an error], from LLMOperator on the same
    prompts (an error row's text is empty; a constrained row cut by max_tokens keeps its
    text and has an error)."""
    import pyarrow as pa

    from llm_operator.cli.engines import generate
    from llm_operator.prompts.field_order import ArrowStatistics, plan_fields
    from llm_operator.prompts.table import render_arrow, table_options

    rows = table_rows()
    table = pa.Table.from_pylist(rows)
    given = table_options({"template": TEMPLATE, "reorder_fields": True})
    rendered = render_arrow(table, plan_fields(given, ArrowStatistics(table, given)).chosen)
    out = {}
    for name, options, source in CASES:
        options = {k: v for k, v in options.items() if k not in ("dedupe", "reorder_fields")}
        prompts = rendered if source == "template" else [r["prompt"] for r in rows]
        results = generate(
            prompts, engine="local", model=model, max_tokens=MAX_TOKENS, progress=False, **options
        ).results
        out[name] = {r["id"]: [x.text, x.error is not None] for r, x in zip(rows, results)}
    return out


# -- Spark ------------------------------------------------------------------------------
def spark_cases(spark, model: str, master: str | None, work: Path) -> dict[str, Any]:
    import pandas as pd
    from pyspark.sql import functions as F

    from llm_operator.cli import main as cli_main
    from llm_operator.integrations.spark import co_locate, llm_infer, llm_infer_df

    rows = table_rows()
    df = spark.createDataFrame(pd.DataFrame(rows)).repartition(3)
    common = {"model": model, "max_tokens": MAX_TOKENS}
    runs: dict[str, Callable[[], Any]] = {
        "withColumn(llm_infer)": lambda: df.withColumn("out", llm_infer("prompt", **common)),
        "llm_infer_df": lambda: llm_infer_df(df, "prompt", **common),
        "llm_infer_df dedupe": lambda: llm_infer_df(df, "prompt", dedupe=True, **common),
        "llm_infer_df reorder_fields": lambda: llm_infer_df(
            df.drop("prompt"), template=TEMPLATE, reorder_fields=True, **common
        ),
        "co_locate + llm_infer": lambda: co_locate(df, "prompt").withColumn(
            "out", llm_infer("prompt", **common)
        ),
        "choices": lambda: df.withColumn("out", llm_infer("prompt", choices=CHOICES, **common)),
        "json_schema (typed value)": lambda: df.withColumn(
            "out", llm_infer("prompt", json_schema=SCHEMA, **common)
        ),
    }
    results: dict[str, Any] = {}
    for name, build in runs.items():
        started = time.perf_counter()
        try:
            frame = build().select("id", F.col("out.text").alias("text"), "out.error")
            got = {r["id"]: [r["text"] or "", r["error"] is not None] for r in frame.collect()}
            results[name] = {"rows_out": len(got), "texts": got}
        except Exception as error:  # reported in the table, with its first line
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    results["CLI run"] = _cli(
        cli_main,
        rows,
        model,
        work,
        ["--engine", "spark", *(["--master", master] if master else [])],
    )
    return results


def _cli(cli_main, rows, model: str, work: Path, engine_args: list[str]) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source, out = work / "table.parquet", work / "cli-out.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), source)
    started = time.perf_counter()
    argv = ["run", str(source), "--prompt-col", "prompt", "--output", str(out), "--model", model]
    code = cli_main([*argv, "--max-tokens", str(MAX_TOKENS), "--no-progress", *engine_args])
    seconds = round(time.perf_counter() - started, 2)
    if code != 0:
        return {"error": f"exit {code}", "seconds": seconds}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {r["id"]: [r["out"] or "", r["out_error"] is not None] for r in lines}
    return {"rows_out": len(texts), "texts": texts, "seconds": seconds}


def _spark_home(work: Path) -> Path:
    """A SPARK_HOME whose bin/, jars/, conf/ and sbin/ are pyspark's (local-cluster's
    executors and the Connect server's logs go under it, not under site-packages)."""
    import pyspark

    package = Path(pyspark.__file__).parent
    home = work / "spark-home"
    home.mkdir(exist_ok=True)
    for name in ("bin", "jars", "conf", "python", "sbin"):
        if (package / name).exists() and not (home / name).exists():
            (home / name).symlink_to(package / name)
    return home


def child_spark(env: str, model: str, work: Path) -> dict[str, Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from llm_operator.integrations.spark_session import quiet_pandas_warning

    quiet_pandas_warning()
    home = _spark_home(work)
    os.environ["SPARK_HOME"] = str(home)
    if env == "spark-connect":
        port = _free_port()
        env_vars = {**os.environ, "SPARK_LOG_DIR": str(work / "logs"), "SPARK_PID_DIR": str(work)}
        start = [
            str(home / "sbin" / "start-connect-server.sh"),
            "--master",
            "local[2]",
            "--conf",
            f"spark.connect.grpc.binding.port={port}",
            "--conf",
            f"spark.executorEnv.PYSPARK_PYTHON={sys.executable}",
        ]
        subprocess.run(start, env=env_vars, check=True, capture_output=True)
        try:
            remote = f"sc://127.0.0.1:{port}"
            spark = _connect(SparkSession, remote)
            try:
                return spark_cases(spark, model, remote, work)
            finally:
                spark.stop()  # the client's gRPC threads, before the server goes
        finally:
            subprocess.run(
                [str(home / "sbin" / "stop-connect-server.sh")], env=env_vars, capture_output=True
            )
    master = "local[2]" if env == "spark-local" else "local-cluster[2,1,1024]"
    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        return spark_cases(spark, model, master, work)
    finally:
        spark.stop()


def _connect(session_class, remote: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            spark = session_class.builder.remote(remote).getOrCreate()
            spark.range(1).collect()
            return spark
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Dask -------------------------------------------------------------------------------
def child_dask(model: str, work: Path) -> dict[str, Any]:
    import dask
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, LocalCluster

    from llm_operator.cli import main as cli_main
    from llm_operator.integrations.dask import co_locate, llm_infer

    rows = table_rows()
    frame = pd.DataFrame(rows)
    common = {"model": model, "max_tokens": MAX_TOKENS}
    results: dict[str, Any] = {}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster),
        dask.config.set({"dataframe.convert-string": False}),
    ):
        ddf = dd.from_pandas(frame, npartitions=3)
        runs: dict[str, Callable[[], Any]] = {
            "withColumn(llm_infer)": lambda: llm_infer(ddf, "prompt", **common),
            "llm_infer_df": lambda: llm_infer(ddf, "prompt", **common),
            "llm_infer_df dedupe": lambda: llm_infer(ddf, "prompt", dedupe=True, **common),
            "llm_infer_df reorder_fields": lambda: llm_infer(
                ddf.drop(columns=["prompt"]), template=TEMPLATE, reorder_fields=True, **common
            ),
            "co_locate + llm_infer": lambda: llm_infer(
                co_locate(ddf, "prompt"), "prompt", **common
            ),
            "choices": lambda: llm_infer(ddf, "prompt", choices=CHOICES, **common),
            "json_schema (typed value)": lambda: llm_infer(
                ddf, "prompt", json_schema=SCHEMA, **common
            ),
        }
        for name, build in runs.items():
            started = time.perf_counter()
            try:
                computed = build().compute()
                got = {
                    int(i): [t if isinstance(t, str) else "", isinstance(e, str)]
                    for i, t, e in zip(computed["id"], computed["out"], computed["out_error"])
                }
                results[name] = {"rows_out": len(got), "texts": got}
            except Exception as error:
                results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            results[name]["seconds"] = round(time.perf_counter() - started, 2)
        address = cluster.scheduler_address
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        results["CLI run"] = _cli(
            cli_main,
            rows,
            model,
            work,
            ["--engine", "dask", "--scheduler", cluster.scheduler_address],
        )
    del address
    return results


# -- the parent: run each environment, compare, print ---------------------------------
def compare(expected: dict[int, list], got: dict[str, Any]) -> dict[str, Any]:
    if "error" in got:
        return {"rows_out": 0, "equal": 0, "error": got["error"], "seconds": got["seconds"]}
    texts = {int(k): v for k, v in got["texts"].items()}
    equal = sum(texts.get(i, "<missing>") == text for i, text in expected.items())
    return {"rows_out": got["rows_out"], "equal": equal, "seconds": got["seconds"]}


def run_matrix(model: str, envs: list[str], keep: Path | None = None) -> dict[str, Any]:
    expected = reference(model)
    report: dict[str, Any] = {"model": model, "rows_in": len(table_rows()), "envs": {}}
    for env in envs:
        work = Path(tempfile.mkdtemp(prefix=f"llm-operator-{env}-"))
        out = work / "result.json"
        started = time.perf_counter()
        process = subprocess.run(
            [
                sys.executable,
                "-m",
                __spec__.name,
                "--child",
                env,
                "--model",
                model,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        if process.returncode != 0 or not out.exists():
            tail = (process.stderr or process.stdout).strip().splitlines()[-5:]
            report["envs"][env] = {"failed": "\n".join(tail)}
        else:
            got = json.loads(out.read_text())
            report["envs"][env] = {name: compare(expected[name], got[name]) for name, _, _ in CASES}
        report["envs"][env]["__seconds"] = round(time.perf_counter() - started, 1)
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return report


def markdown(report: dict[str, Any]) -> str:
    envs = list(report["envs"])
    rows_in = report["rows_in"]
    lines = [
        f"rows in: {rows_in} per entry point (one null prompt: an error row everywhere); "
        "each cell: rows out, rows equal to the local run",
        "",
        "| entry point | " + " | ".join(envs) + " |",
        "|---|" + "---|" * len(envs),
    ]
    for name, _, _ in CASES:
        cells = []
        for env in envs:
            result = report["envs"][env]
            if "failed" in result:
                cells.append("failed")
                continue
            cell = result[name]
            if "error" in cell:
                cells.append(f"error: {cell['error'][:60]}")
            else:
                cells.append(f"{cell['rows_out']} out, {cell['equal']}/{rows_in} equal")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--envs", default=",".join(ENVS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=ENVS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        work = args.out.parent
        if args.child == "dask-cluster":
            result = child_dask(args.model, work)
        else:
            result = child_spark(args.child, args.model, work)
        args.out.write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # a client's lingering threads (gRPC, py4j) must not hold the exit
    envs = [e for e in args.envs.split(",") if e]
    unknown = sorted(set(envs) - set(ENVS))
    if unknown:
        parser.error(f"unknown environments {unknown}; choose from {', '.join(ENVS)}")
    report = run_matrix(args.model, envs)
    print(markdown(report))
    for env, result in report["envs"].items():
        if "failed" in result:
            print(f"\n{env} failed:\n{result['failed']}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
