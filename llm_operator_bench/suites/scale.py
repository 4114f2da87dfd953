"""Scale: many rows through Spark (local mode) and Dask (a LocalCluster of worker
processes) with a tiny model, measuring rows/s and the peak memory (RSS) of the driver,
the JVM and every Python worker; and the prefix planner's peak memory on one huge batch.

    python -m llm_operator_bench.suites.scale                      # 25k and 100k rows, both engines
    python -m llm_operator_bench.suites.scale --rows 2000 --engines dask --planner-prompts 0

Each (engine, rows) run is a fresh child process (its own SparkContext or LocalCluster),
sampled from here every ``--interval`` seconds with its whole process tree. Partitions
have a fixed size (``--rows-per-partition``): a partition is one batch on one worker,
so worker memory follows the partition size, not the table size, and the driver holds
no rows: the input is generated on the executors (``spark.range``, ``dd.from_map``), the
output is written to Parquet by the workers, and the checks (rows, distinct ids, error
rows, null outputs) are aggregates read back from that Parquet.

The planner run builds ``--planner-prompts`` synthetic token prompts
(``planner_scale.make_workload``) and plans them as one batch; it reports the RSS with
the prompts in memory and the peak while planning.

Results: one line per run, and ``<out>/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

INSTRUCTIONS = (
    "Classify the sentiment:",
    "Label the topic:",
    "Is this urgent?",
    "Summarize briefly:",
)
WORDS = (
    "battery",
    "shipping",
    "refund",
    "screen",
    "price",
    "support",
    "login",
    "delivery",
    "noise",
    "size",
    "color",
    "warranty",
    "password",
)
RESULT_PREFIX = "SCALE-RESULT "
DEFAULT_OUT = Path("bench-results/scale")


# -- prompts and the tiny model ------------------------------------------------------------
def prompt_text(row: int) -> str:
    """Row ``row``'s prompt (short: about 15 tokens; 4 shared instructions)."""
    return (
        f"{INSTRUCTIONS[row % 4]} review {row % 997}: "
        f"{WORDS[row % 13]} {WORDS[(row // 13) % 13]}. Label:"
    )


def spark_prompt_column():
    """``prompt_text(id)`` as a Spark expression (evaluated on the executors)."""
    from pyspark.sql import functions as F

    def pick(options: Sequence[str], index):
        return F.element_at(F.array(*[F.lit(o) for o in options]), (index + 1).cast("int"))

    row = F.col("id")
    return F.format_string(
        "%s review %d: %s %s. Label:",
        pick(INSTRUCTIONS, row % 4),
        row % 997,
        pick(WORDS, row % 13),
        pick(WORDS, F.floor(row / 13) % 13),
    )


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random Llama (``tiny.build_tiny_model``: hidden 64, 2 layers) with a byte-level BPE
    tokenizer trained on the prompts' words: milliseconds a row, so the integration, not
    the model, is measured."""
    from llm_operator_bench.testing import tiny

    if (path / "model.safetensors").exists():
        return path
    corpus = [prompt_text(row) for row in range(2000)]
    tokenizer_dir = tiny.build_tiny_tokenizer(path / "tokenizer", corpus, vocab_size=400)
    return tiny.build_tiny_model(path, "llama", tokenizer_dir, seed)


# -- memory of a process tree ---------------------------------------------------------------
def process_kind(process, root_pid: int) -> str:
    """driver (the root), jvm, python_worker (a PySpark worker or a Dask worker process),
    pyspark_daemon (forks the PySpark workers) or other."""
    if process.pid == root_pid:
        return "driver"
    try:
        name = process.name()
        command = " ".join(process.cmdline())
        if name == "java" or command.startswith("java ") or "/bin/java " in command:
            return "jvm"
        if "pyspark.daemon" in command:
            parent = process.parent()
            parent_is_jvm = parent is not None and parent.name() == "java"
            return "pyspark_daemon" if parent_is_jvm else "python_worker"
        if "multiprocessing.spawn" in command or "multiprocessing.forkserver" in command:
            return "python_worker"
    except Exception:  # noqa: BLE001 - it ended while we looked
        return "other"
    return "other"


class MemorySampler:
    """Samples the RSS of ``root_pid`` and all its descendants every ``interval`` s (psutil).

    peaks(): per kind (process_kind), the peak of the kind's summed RSS, the peak of any
    one process of that kind, and how many processes of that kind were seen; the peak of
    the whole tree; and a timeline (driver, largest JVM, largest Python worker) to see
    whether memory levels off. RSS counts pages shared between processes (a PySpark
    worker is forked from its daemon) once per process, so sums overstate a little.
    """

    def __init__(self, root_pid: int, interval: float = 0.25):
        import psutil

        self._psutil = psutil
        self.root_pid = root_pid
        self.interval = interval
        self._kinds: dict[int, str] = {}
        self._process_peak: dict[int, int] = {}
        self._kind_sum_peak: dict[str, int] = {}
        self._tree_peak = 0
        self.samples = 0
        self._started = time.monotonic()
        self._timeline: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        try:
            root = self._psutil.Process(self.root_pid)
            processes = [root, *root.children(recursive=True)]
        except self._psutil.Error:
            return
        sums: dict[str, int] = {}
        largest: dict[str, int] = {}
        total = 0
        for process in processes:
            try:
                rss = process.memory_info().rss
            except self._psutil.Error:
                continue
            kind = self._kinds.get(process.pid)
            if kind is None or kind == "other":  # a spawned worker names itself later
                kind = self._kinds[process.pid] = process_kind(process, self.root_pid)
            self._process_peak[process.pid] = max(self._process_peak.get(process.pid, 0), rss)
            sums[kind] = sums.get(kind, 0) + rss
            largest[kind] = max(largest.get(kind, 0), rss)
            total += rss
        for kind, value in sums.items():
            self._kind_sum_peak[kind] = max(self._kind_sum_peak.get(kind, 0), value)
        self._tree_peak = max(self._tree_peak, total)
        self.samples += 1
        self._timeline.append(
            (
                time.monotonic() - self._started,
                sums.get("driver", 0),
                largest.get("jvm", 0),
                largest.get("python_worker", 0),
            )
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
        self.sample()

    def peaks(self) -> dict[str, Any]:
        mib = 1 << 20
        kinds: dict[str, dict[str, Any]] = {}
        for pid, kind in self._kinds.items():
            entry = kinds.setdefault(kind, {"processes": 0, "max_one_mib": 0.0})
            entry["processes"] += 1
            entry["max_one_mib"] = max(entry["max_one_mib"], self._process_peak[pid] / mib)
        for kind, entry in kinds.items():
            entry["sum_mib"] = self._kind_sum_peak.get(kind, 0) / mib
            entry["max_one_mib"] = round(entry["max_one_mib"], 1)
            entry["sum_mib"] = round(entry["sum_mib"], 1)
        return {
            "tree_mib": round(self._tree_peak / mib, 1),
            "samples": self.samples,
            **kinds,
            "timeline": self.timeline(),
        }

    def timeline(self, points: int = 40) -> list[list[float]]:
        """[seconds, driver MiB, largest JVM MiB, largest Python worker MiB], at most
        ``points`` rows evenly spread over the run (each the peak of its stretch)."""
        mib = 1 << 20
        samples = self._timeline
        if not samples:
            return []
        size = max(1, -(-len(samples) // points))
        rows = []
        for begin in range(0, len(samples), size):
            stretch = samples[begin : begin + size]
            rows.append(
                [round(stretch[-1][0], 1)]
                + [round(max(sample[i] for sample in stretch) / mib, 1) for i in (1, 2, 3)]
            )
        return rows


def run_sampled(command: list[str], interval: float = 0.25, timeout: float | None = None):
    """Run ``command`` (a child that prints one RESULT_PREFIX line of JSON) while sampling
    its process tree; (its result, memory peaks, wall seconds)."""
    started = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    with MemorySampler(child.pid, interval) as sampler:
        try:
            output, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = child.communicate()
            raise RuntimeError(f"{command[-6:]} ran past {timeout} s") from None
    seconds = time.monotonic() - started
    results = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if child.returncode != 0 or not results:
        raise RuntimeError(f"{command[-6:]} failed (exit {child.returncode}): {output[-2000:]}")
    return json.loads(results[-1][len(RESULT_PREFIX) :]), sampler.peaks(), seconds


# -- the jobs (in the child process, or on a session/client a test passes) ------------------
def spark_job(
    spark, model: str, rows: int, partitions: int, out_dir: Path, max_tokens: int = 2
) -> dict[str, Any]:
    """``rows`` generated rows -> llm_infer -> Parquet, then aggregates over that Parquet."""
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import llm_infer

    df = spark.range(rows, numPartitions=partitions).select(
        "id", llm_infer(spark_prompt_column(), model=model, max_tokens=max_tokens).alias("out")
    )
    path = str(out_dir / "spark-output.parquet")
    started = time.perf_counter()
    df.write.mode("overwrite").parquet(path)
    seconds = time.perf_counter() - started
    written = spark.read.parquet(path)
    check = written.agg(
        F.count("*").alias("rows"),
        F.countDistinct("id").alias("distinct_ids"),
        F.min("id").alias("min_id"),
        F.max("id").alias("max_id"),
        F.sum((F.col("out.finish_reason") == "error").cast("long")).alias("error_rows"),
        F.sum(F.col("out.text").isNull().cast("long")).alias("null_outputs"),
        F.sum("out.completion_tokens").alias("output_tokens"),
    ).first()
    return _job_result(rows, partitions, seconds, check.asDict())


def _dask_partition(arguments: tuple[int, int, int]):
    import pandas as pd

    start, stop, _ = arguments
    ids = range(start, stop)
    return pd.DataFrame(
        {
            "id": pd.Series(list(ids), dtype="int64"),
            "prompt": pd.Series([prompt_text(row) for row in ids], dtype=object),
        }
    )


def dask_job(
    client, model: str, rows: int, partitions: int, out_dir: Path, max_tokens: int = 2
) -> dict[str, Any]:
    """The same job on the client's cluster: from_map -> llm_infer -> to_parquet."""
    import dask
    import dask.dataframe as dd

    from llm_operator.integrations.dask import llm_infer

    bounds = [rows * part // partitions for part in range(partitions + 1)]
    pieces = [(bounds[part], bounds[part + 1], part) for part in range(partitions)]
    ddf = dd.from_map(_dask_partition, pieces, meta=_dask_partition((0, 0, 0)))
    out = llm_infer(ddf, "prompt", output="out", model=model, max_tokens=max_tokens)
    path = str(out_dir / "dask-output.parquet")
    started = time.perf_counter()
    out[["id", "out", "out_finish_reason", "out_completion_tokens"]].to_parquet(
        path, write_index=False, overwrite=True
    )
    seconds = time.perf_counter() - started
    written = dd.read_parquet(path)
    ids = written["id"]
    values = dask.compute(
        ids.count(),
        ids.nunique(split_out=1),  # a tree reduction, no shuffle
        ids.min(),
        ids.max(),
        (written["out_finish_reason"] == "error").sum(),
        written["out"].isna().sum(),
        written["out_completion_tokens"].sum(),
    )
    names = ("rows", "distinct_ids", "min_id", "max_id", "error_rows", "null_outputs")
    check = dict(zip((*names, "output_tokens"), (int(v) for v in values)))
    return _job_result(rows, partitions, seconds, check)


def _job_result(rows: int, partitions: int, seconds: float, check: dict) -> dict[str, Any]:
    check = {key: int(value) if value is not None else None for key, value in check.items()}
    return {
        "rows": rows,
        "partitions": partitions,
        "seconds": round(seconds, 2),
        "rows_per_second": round(rows / seconds, 1) if seconds else 0.0,
        "rows_lost": rows - check["distinct_ids"],
        "rows_duplicated": check["rows"] - check["distinct_ids"],
        **{f"written_{key}": value for key, value in check.items()},
    }


# -- child processes -------------------------------------------------------------------------
def _child_spark(arguments: argparse.Namespace) -> dict[str, Any]:
    from llm_operator.integrations.spark_session import local_session

    spark = local_session(arguments.cores, "llm-operator-scale")
    try:
        return spark_job(
            spark,
            arguments.model,
            arguments.rows,
            arguments.partitions,
            arguments.work,
            arguments.max_tokens,
        )
    finally:
        spark.stop()


def _child_dask(arguments: argparse.Namespace) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=arguments.cores,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        return dask_job(
            client,
            arguments.model,
            arguments.rows,
            arguments.partitions,
            arguments.work,
            arguments.max_tokens,
        )


def _child_planner(arguments: argparse.Namespace) -> dict[str, Any]:
    from llm_operator.planner import build_plan
    from llm_operator_bench.suites.planner import make_workload

    started = time.perf_counter()
    prompts, max_tokens = make_workload(arguments.rows, arguments.prompt_tokens)
    workload_seconds = time.perf_counter() - started
    workload_rss = _status_bytes("VmRSS")
    started = time.perf_counter()
    plan = build_plan(prompts, max_tokens)
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    mib = 1 << 20
    return {
        "prompts": arguments.rows,
        "tokens": plan.stats.prompt_tokens,
        "groups": plan.stats.groups,
        "seconds": round(seconds, 2),
        "workload_seconds": round(workload_seconds, 2),
        "rss_with_prompts_mib": round(workload_rss / mib, 1),
        "peak_rss_mib": round(peak / mib, 1),
        "planner_extra_mib": round((peak - workload_rss) / mib, 1),
    }


def _status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, from /proc/self/status. (Not
    ru_maxrss: Linux carries that over from the parent across fork and exec.)"""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "spark": _child_spark,
    "dask": _child_dask,
    "planner": _child_planner,
}


def child_main(arguments: argparse.Namespace) -> None:
    if arguments.threads:  # torch threads per worker (inherited by Spark and Dask workers)
        os.environ["OMP_NUM_THREADS"] = str(arguments.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = CHILDREN[arguments.child](arguments)
    result["driver_peak_rss_mib"] = round(_status_bytes("VmHWM") / (1 << 20), 1)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# -- the driver of it all ---------------------------------------------------------------------
def _child_command(kind: str, rows: int, partitions: int, args, work: Path) -> list[str]:
    command = [sys.executable, "-m", "llm_operator_bench.suites.scale", "--child", kind]
    command += ["--rows", str(rows), "--partitions", str(partitions), "--work", str(work)]
    command += ["--model", str(args.model), "--max-tokens", str(args.max_tokens)]
    command += ["--cores", str(args.cores), "--threads", str(args.threads)]
    command += ["--prompt-tokens", str(args.prompt_tokens)]
    return command


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    model_name = str(args.model) if args.model else "tiny random Llama (hidden 64, 2 layers)"
    if args.model is None:
        args.model = build_tiny_model(args.out / "tiny-model")
    runs = []
    for engine in args.engines:
        for rows in args.rows:
            partitions = max(1, -(-rows // args.rows_per_partition))
            with tempfile.TemporaryDirectory(prefix=f"scale-{engine}-") as work:
                command = _child_command(engine, rows, partitions, args, Path(work))
                result, memory, wall = run_sampled(command, args.interval, args.timeout)
            run = {"engine": engine, **result, "wall_seconds": round(wall, 1), "memory": memory}
            runs.append(run)
            print(_run_line(run), flush=True)
    planner = None
    if args.planner_prompts:
        command = _child_command("planner", args.planner_prompts, 1, args, args.out)
        result, memory, wall = run_sampled(command, args.interval, args.timeout)
        planner = {**result, "wall_seconds": round(wall, 1), "sampled_peak_mib": memory["tree_mib"]}
        print(
            f"planner: {planner['prompts']:,} prompts, {planner['tokens']:,} tokens: "
            f"{planner['seconds']} s planning, RSS {planner['rss_with_prompts_mib']:,.0f} MiB "
            f"with the prompts, peak {planner['peak_rss_mib']:,.0f} MiB "
            f"(+{planner['planner_extra_mib']:,.0f} MiB planning)",
            flush=True,
        )
    report = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "memory_gib": round(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
            ),
        },
        "settings": {
            "rows_per_partition": args.rows_per_partition,
            "max_tokens": args.max_tokens,
            "cores": args.cores,
            "threads": args.threads,
            "model": model_name,
        },
        "runs": runs,
        "planner": planner,
    }
    (args.out / "scale.json").write_text(json.dumps(report, indent=2))
    print(f"scale: wrote {args.out / 'scale.json'}")
    return report


def _run_line(run: dict[str, Any]) -> str:
    memory = run["memory"]

    def mib(kind: str, key: str) -> str:
        return f"{memory[kind][key]:,.0f}" if kind in memory else "-"

    return (
        f"{run['engine']:>5}: {run['rows']:>9,} rows in {run['partitions']} partitions: "
        f"{run['seconds']:.1f} s, {run['rows_per_second']:,.0f} rows/s; lost {run['rows_lost']}, "
        f"duplicated {run['rows_duplicated']}, error rows {run['written_error_rows']}; "
        f"peak RSS MiB: driver {mib('driver', 'max_one_mib')}, JVM {mib('jvm', 'max_one_mib')}, "
        f"Python workers {mib('python_worker', 'max_one_mib')} each "
        f"({memory.get('python_worker', {}).get('processes', 0)} seen, "
        f"{mib('python_worker', 'sum_mib')} together), tree {memory['tree_mib']:,.0f}"
    )


def _sizes(text: str) -> list[int]:
    sizes = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def _engines(text: str) -> list[str]:
    engines = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(engines) - {"spark", "dask"})
    if not engines or unknown:
        raise argparse.ArgumentTypeError(f"engines: spark and/or dask, got {text!r}")
    return engines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        type=_sizes,
        default=[25_000, 100_000],
        help="table sizes, comma-separated (default 25000,100000)",
    )
    parser.add_argument("--engines", type=_engines, default=["spark", "dask"])
    parser.add_argument("--rows-per-partition", type=int, default=2500)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument(
        "--cores", type=int, default=2, help="Spark local[N] / Dask worker processes"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (OMP_NUM_THREADS); 0 leaves it",
    )
    parser.add_argument(
        "--planner-prompts",
        type=int,
        default=1_000_000,
        help="prompts for the planner's memory run (0 skips it)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=500, help="planner run: tokens per prompt"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: a tiny random Llama built under --out)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--interval", type=float, default=0.25, help="memory sampling period, s")
    parser.add_argument("--timeout", type=float, default=3600, help="per run, s")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--partitions", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.rows = args.rows[0]
        args.model = str(args.model) if args.model else None
        child_main(args)
    else:
        run_scale(args)


if __name__ == "__main__":
    main()
