"""Spark on local-cluster[2,1,2048] with an executor JVM SIGKILLed mid-job (run by
tests/test_faults.py in a subprocess: one process holds one SparkContext, and the suite's
is in local mode).

    python tests/spark_cluster_faults.py MODEL_DIR WORK_DIR RESULT_JSON

The job: co_locate (a shuffle) then two LLM columns, greedy ``g`` and seeded sampled
``s``, over ROWS rows with an ``id``. It runs clean, then again with the prompt column
through a pandas UDF that, on the first task of partition VICTIM_PARTITION, SIGKILLs the
executor JVM it runs in (its parent's parent: worker -> pyspark daemon -> executor).
The executor's tasks, Python workers and shuffle outputs go with it; Spark reruns what
was lost on the other executor and on the one the standalone worker starts in its place.

RESULT_JSON: both runs' rows (id, g, s), executors lost, the attempts that ran the
victim partition (stage, task attempt id, attempt number, executor JVM), seconds, and Python workers of the killed executor still alive after it.
Exits 77 (and says why on stdout) when local-cluster cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pandas as pd

ROWS = 48
PARTITIONS = 4
VICTIM_PARTITION = 2
MAX_TOKENS = 6
SAMPLED = dict(temperature=0.9, seed=1234)
GROUPS = (
    "You label support tickets for the billing team. Classify the ticket: ",
    "Summarize the customer review below in one short sentence. Review: ",
    "Extract the product name and the main complaint from this review: ",
    "Rate the urgency of the message from 1 to 5 and explain briefly: ",
)
TAILS = (
    "The battery lasts two full days.",
    "Shipping took 12 days and the box arrived crushed.",
    "Great value for the price, would buy again.",
    "The app crashes every time I open the settings page.",
    "Terrible fit: the shoes run a full size small.",
    "Refund received, thank you for the quick help!",
)


def prompts() -> list[str]:
    # groups interleaved in id order, so co_locate has to move rows
    return [f"{GROUPS[i % 4]}{TAILS[(i // 4) % 6]} (row {i})" for i in range(ROWS)]


def spark_home(work: Path) -> Path:
    """A SPARK_HOME whose bin/, jars/ and conf/ are pyspark's: local-cluster's workers
    put the executors' work folders under SPARK_HOME/work, here instead of site-packages."""
    import pyspark

    package = Path(pyspark.__file__).parent
    home = work / "spark-home"
    home.mkdir(exist_ok=True)
    for name in ("bin", "jars", "conf", "python"):
        if (package / name).exists() and not (home / name).exists():
            (home / name).symlink_to(package / name)
    return home


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def claim(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def executor_killer(marker: str, partition: int):
    from pyspark.sql import functions as F

    state: list[bool] = []

    def prompts(batch: pd.Series) -> pd.Series:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context.partitionId() == partition and not state:
            state.append(True)  # once a task: which attempts ran, and where
            with open(f"{marker}.attempts", "a") as file:
                file.write(
                    f"{context.stageId()} {context.taskAttemptId()} "
                    f"{context.attemptNumber()} {parent(parent(os.getpid()))}\n"
                )
        if context.partitionId() == partition and claim(marker):
            daemon = parent(os.getpid())
            executor = parent(daemon)
            if "CoarseGrainedExecutorBackend" not in cmdline(executor):
                raise RuntimeError(f"not in an executor JVM: {cmdline(executor)[:200]}")
            workers = [
                int(child)
                for child in os.listdir("/proc")
                if child.isdigit() and alive(int(child)) and _parent_or_none(int(child)) == daemon
            ]
            with open(marker, "w") as file:
                json.dump(
                    {
                        "pid": os.getpid(),
                        "daemon_pid": daemon,
                        "worker_pids": workers,
                        "executor_pid": executor,
                        "partition": partition,
                        "attempt": context.attemptNumber(),
                        "stage": context.stageId(),
                    },
                    file,
                )
            os.kill(executor, signal.SIGKILL)
            time.sleep(30)  # dies with its executor (the JVM's socket closes), never returns
        return batch

    return F.pandas_udf(prompts, "string")


def _parent_or_none(pid: int) -> int | None:
    try:
        return parent(pid)
    except (OSError, IndexError, ValueError):
        return None


def executors_lost(spark) -> int:
    executors = spark.sparkContext._jsc.sc().statusStore().executorList(False)
    return sum(
        1
        for i in range(executors.size())
        if executors.apply(i).id() != "driver" and not executors.apply(i).isActive()
    )


def rows_of(df) -> list[dict]:
    return [
        {"id": row["id"], "g": row["g"].asDict(), "s": row["s"].asDict()} for row in df.collect()
    ]


def main(model_dir: str, work: Path, result_file: Path) -> int:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["SPARK_HOME"] = str(spark_home(work))
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import co_locate, llm_infer
    from llm_operator.integrations.spark_session import quiet_pandas_warning, session_settings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    quiet_pandas_warning()
    seconds: dict[str, float] = {}
    started = time.monotonic()
    builder = (
        SparkSession.builder.master("local-cluster[2,1,2048]")
        .appName("llm-operator-cluster-faults")
        .config("spark.executor.memory", "1g")
        .config("spark.task.maxFailures", "4")
        .config("spark.sql.shuffle.partitions", str(PARTITIONS))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "4")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.executorEnv.HF_HUB_OFFLINE", "1")
        .config("spark.executorEnv.TOKENIZERS_PARALLELISM", "false")
        .config("spark.executorEnv.OMP_NUM_THREADS", "1")
    )
    for key, value in session_settings().items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        spark.range(2, numPartitions=2).count()  # both executors registered and working
    except Exception as error:  # noqa: BLE001 - reported to the test, which skips
        print(f"local-cluster did not start: {type(error).__name__}: {error}")
        return 77
    seconds["start"] = time.monotonic() - started
    try:
        rows = [(i, prompt) for i, prompt in enumerate(prompts())]
        df = spark.createDataFrame(rows, "id int, prompt string").repartition(PARTITIONS)
        greedy = dict(model=model_dir, max_tokens=MAX_TOKENS)
        sampled = dict(greedy, **SAMPLED)

        def job(prompt_column):
            placed = co_locate(df, "prompt", PARTITIONS)
            return placed.select(
                "id",
                llm_infer(prompt_column, **greedy).alias("g"),
                llm_infer(prompt_column, **sampled).alias("s"),
            )

        began = time.monotonic()
        clean = rows_of(job(F.col("prompt")))
        seconds["clean"] = time.monotonic() - began
        marker = str(work / "killed")
        began = time.monotonic()
        faulty = rows_of(job(executor_killer(marker, VICTIM_PARTITION)("prompt")))
        seconds["faulty"] = time.monotonic() - began
        lost = executors_lost(spark)
    finally:
        spark.stop()
    killed = json.loads(Path(marker).read_text())
    deadline = time.monotonic() + 20
    survivors = [killed["daemon_pid"], *killed["worker_pids"]]
    while time.monotonic() < deadline and any(alive(pid) for pid in survivors):
        time.sleep(0.5)
    result_file.write_text(
        json.dumps(
            {
                "rows": ROWS,
                "clean": clean,
                "faulty": faulty,
                # "stage taskAttemptId attemptNumber executorPid" of each task of the partition
                "victim_attempts": Path(f"{marker}.attempts").read_text().split("\n")[:-1],
                "executors_lost": lost,
                "orphans": [pid for pid in survivors if alive(pid)],
                "seconds": {name: round(value, 1) for name, value in seconds.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
