"""Faults (issue 14): whatever dies mid-job, every input row comes out exactly once, and
equal to a clean run's row (greedy rows and seeded sampled rows), compared by row id.

- Spark local[2,4] (the shared session, 4 attempts per task): the Python worker running
  the LLM is SIGKILLed after its first output batch, or the Python worker feeding it its
  prompts is SIGKILLed after reading a batch; Spark retries the task.
- Spark local-cluster[2,1,2048] (two executor JVMs, in a subprocess: tests/spark_cluster_faults.py):
  an executor JVM is SIGKILLed mid-stage, after co_locate's shuffle (its map outputs go too).
  It takes 1-2 minutes, so it runs with LLM_OPERATOR_CLUSTER_TESTS=1 (``make test-faults``).
- Dask LocalCluster (2 worker processes with nannies): a worker process is SIGKILLed right
  after computing a partition; the nanny restarts it and the scheduler reruns its tasks.
- A model whose weights are truncated: the job fails with the model's error on the
  driver/client, within a bound, never hangs.

Each fault fires once: the first process to create its marker file (O_CREAT | O_EXCL)
dies, every later attempt finds the file and runs normally.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import REVIEWS, job_group

MAX_TOKENS = 6
SAMPLED = dict(temperature=0.9, seed=1234)  # seeded sampling: the same text on a retry
INSTRUCTIONS = (
    "Classify the sentiment as positive, negative or neutral.\nReview: ",
    "Summarize the review in one sentence.\nReview: ",
    "Extract the product name and the main complaint.\nReview: ",
    "Rate the urgency from 1 to 5 and explain briefly.\nReview: ",
)
# 40 rows: row i is instruction i // 10, review i % 10
PROMPTS = [f"{instruction}{review}\nAnswer:" for instruction in INSTRUCTIONS for review in REVIEWS]
CLUSTER_SCRIPT = Path(__file__).with_name("spark_cluster_faults.py")


def claim(marker: str) -> bool:
    """True for the one caller that creates ``marker`` (atomically), False for all later."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def note(marker: str, **fields) -> None:
    """Record who died where in the marker file (read back by the test)."""
    with open(marker, "w") as file:
        json.dump({"pid": os.getpid(), **fields}, file)


def assert_same_rows(clean: dict[int, tuple], faulty: dict[int, tuple], ids: list[int]) -> None:
    """Both runs hold each id exactly once (callers check for duplicates), equal row for row."""
    assert sorted(clean) == ids and sorted(faulty) == ids
    mismatched = [i for i in ids if clean[i] != faulty[i]]
    assert not mismatched, f"rows differ after the fault: {mismatched[:5]}"
    greedy = [clean[i][0] for i in ids]
    sampled = [clean[i][1] for i in ids]
    assert all(row["finish_reason"] != "error" for row in greedy + sampled)
    # the sampled column really sampled (otherwise it checks nothing greedy does not)
    assert sum(g["text"] != s["text"] for g, s in zip(greedy, sampled)) >= len(ids) // 4


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def corrupt_model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny model with its weights cut short (the header promises more than the file has)."""
    target = tmp_path_factory.mktemp("corrupt") / "model"
    shutil.copytree(tiny_llama_dir, target)
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return str(target)


MODEL_ERROR = "incomplete metadata"  # safetensors' message for a truncated file


def bounded(action: Callable[[], object], seconds: float, cancel: Callable[[], None]):
    """Run ``action`` in a thread; its exception (or None). Fails the test if it hangs."""
    outcome: dict[str, Any] = {"error": None}

    def target() -> None:
        try:
            action()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        cancel()
        thread.join(30)
        pytest.fail(f"the job did not end within {seconds} s")
    outcome["seconds"] = time.monotonic() - started
    return outcome


# -- Spark, local[2,4] ------------------------------------------------------------------
spark_available = pytest.mark.skipif(
    importlib.util.find_spec("pyspark") is None, reason="needs pyspark"
)


def _spark_frame(spark, partitions: int = 4):
    rows = [(i, prompt) for i, prompt in enumerate(PROMPTS)]  # 4 partitions of 10 rows
    rdd = spark.sparkContext.parallelize(rows, partitions)
    return spark.createDataFrame(rdd, "id int, prompt string")


def _spark_rows(df) -> dict[int, tuple]:
    rows = df.collect()
    ids = [row["id"] for row in rows]
    assert ids == sorted(set(ids)), "rows out of order, or duplicated"
    return {row["id"]: (row["g"].asDict(), row["s"].asDict()) for row in rows}


@contextlib.contextmanager
def _job_group(spark, name: str):
    """Count the failed task attempts of the jobs run inside (``helpers.job_group``)."""
    counts = {"failed_tasks": 0}
    with job_group(spark, name) as tracker:
        try:
            yield counts
        finally:
            for job in tracker.getJobIdsForGroup(name):
                for stage in tracker.getJobInfo(job).stageIds:
                    info = tracker.getStageInfo(stage)
                    counts["failed_tasks"] += info.numFailedTasks if info else 0


@pytest.fixture(scope="module")
def small_arrow_batches(spark):
    """3 Arrow batches per 10-row partition, so a worker can die between batches."""
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(key)
    spark.conf.set(key, "4")
    yield
    spark.conf.set(key, previous)


def _spark_options(model_dir: str) -> tuple[dict, dict]:
    greedy = dict(model=model_dir, max_tokens=MAX_TOKENS)
    return greedy, dict(greedy, **SAMPLED)


@pytest.fixture(scope="module")
def spark_clean(spark, model_dir, small_arrow_batches) -> dict[int, tuple]:
    """The clean run: id -> (greedy ``g``, sampled ``s``) result dicts."""
    from llm_operator.integrations.spark import llm_infer

    greedy, sampled = _spark_options(model_dir)
    return _spark_rows(
        _spark_frame(spark).select(
            "id",
            llm_infer("prompt", **greedy).alias("g"),
            llm_infer("prompt", **sampled).alias("s"),
        )
    )


def _killing_llm_udf(options_kwargs: dict, marker: str, partition: int, after_frames: int):
    """The body of ``llm_infer``'s UDF (``infer_batches`` on the same options) in a worker
    that SIGKILLs itself after yielding ``after_frames`` output batches of ``partition``,
    once. (The library has no test hook: a wrapper around the prompt column runs in a
    Python worker of its own, so the LLM worker is reached by running its UDF body here.)"""
    from pyspark.sql import functions as F

    from llm_operator.integrations.infer_options import make_options
    from llm_operator.integrations.spark import RESULT_TYPE

    options = make_options(**options_kwargs)

    def infer(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        from pyspark import TaskContext

        from llm_operator.integrations.spark import infer_batches

        context = TaskContext.get()
        armed = context.partitionId() == partition and claim(marker)
        for count, frame in enumerate(infer_batches(batches, options), 1):
            yield frame
            if armed and count == after_frames:
                note(marker, partition=partition, attempt=context.attemptNumber())
                os.kill(os.getpid(), signal.SIGKILL)

    return F.pandas_udf(infer, returnType=RESULT_TYPE)


def _killing_prompt_udf(marker: str, partition: int, after_batches: int):
    """The prompt column through a Python worker that SIGKILLs itself on reading its
    ``after_batches``-th batch of ``partition``, once (its task's LLM worker is mid-read)."""
    from pyspark.sql import functions as F

    state = {"batches": 0}

    def prompts(batch: pd.Series) -> pd.Series:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context.partitionId() == partition:
            state["batches"] += 1
            if state["batches"] >= after_batches and claim(marker):
                note(marker, partition=partition, attempt=context.attemptNumber())
                os.kill(os.getpid(), signal.SIGKILL)
        return batch

    return F.pandas_udf(prompts, "string")


@spark_available
@pytest.mark.parametrize("victim", ["llm-worker", "prompt-worker"])
def test_spark_python_worker_killed_mid_partition(spark, spark_clean, model_dir, tmp_path, victim):
    from pyspark import cloudpickle

    from llm_operator.integrations.spark import llm_infer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    df = _spark_frame(spark)
    greedy, sampled = _spark_options(model_dir)
    marker = str(tmp_path / "killed")
    if victim == "llm-worker":  # the sampled column's worker dies after its first output batch
        faulty_df = df.select(
            "id",
            llm_infer("prompt", **greedy).alias("g"),
            _killing_llm_udf(sampled, marker, partition=1, after_frames=1)("prompt").alias("s"),
        )
    else:  # the prompts' worker dies on its second batch; both LLM workers are mid-read
        prompt = _killing_prompt_udf(marker, partition=2, after_batches=2)("prompt")
        faulty_df = df.select(
            "id", llm_infer(prompt, **greedy).alias("g"), llm_infer(prompt, **sampled).alias("s")
        )
    with _job_group(spark, f"faults-{victim}") as counts:
        faulty = _spark_rows(faulty_df)
    killed = json.loads(Path(marker).read_text())  # the fault fired...
    assert killed["attempt"] == 0
    assert counts["failed_tasks"] >= 1, "Spark did not see the task fail"  # ...and was retried
    assert_same_rows(spark_clean, faulty, list(range(len(PROMPTS))))


@spark_available
def test_spark_corrupt_model_fails_fast_with_its_error(spark, corrupt_model_dir):
    """One partition: a Python worker that raises exits, so each of the task's 4 attempts
    starts a new one (seconds of imports each); more partitions only fail the same way."""
    from llm_operator.integrations.spark import llm_infer

    df = _spark_frame(spark, partitions=1).select(
        "id", llm_infer("prompt", model=corrupt_model_dir, max_tokens=2).alias("out")
    )
    group = "faults-corrupt-model"

    def collect() -> None:
        spark.sparkContext.setJobGroup(group, group)
        df.collect()

    outcome = bounded(collect, 240, lambda: spark.sparkContext.cancelJobGroup(group))
    error = outcome["error"]
    assert error is not None, "the job succeeded on a corrupt model"
    assert MODEL_ERROR in str(error), str(error)[:2000]
    assert "SafetensorError" in str(error)
    print(f"spark corrupt model: failed after {outcome['seconds']:.1f} s: {str(error)[:300]}")


# -- Spark, local-cluster[2,1,2048] -------------------------------------------------------
@spark_available
@pytest.mark.skipif(
    os.environ.get("LLM_OPERATOR_CLUSTER_TESTS") != "1",
    reason="1-2 min (three JVMs): make test-faults, or LLM_OPERATOR_CLUSTER_TESTS=1",
)
def test_spark_executor_jvm_killed_mid_job(model_dir, tmp_path):
    """Two executor JVMs; one is SIGKILLed while a task of the LLM stage runs on it, after
    co_locate's shuffle wrote map outputs there. Runs in a subprocess (the suite's local
    session cannot share a process with another SparkContext)."""
    result_file = tmp_path / "result.json"
    command = [sys.executable, str(CLUSTER_SCRIPT), model_dir, str(tmp_path), str(result_file)]
    started = time.monotonic()
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"local-cluster job did not finish in 540 s: {str(timeout.stderr)[-3000:]}")
    if run.returncode == 77:
        pytest.skip(f"local-cluster could not start here: {run.stdout.strip()[-500:]}")
    assert run.returncode == 0, run.stderr[-5000:]
    result = json.loads(result_file.read_text())
    print(f"local-cluster test: {time.monotonic() - started:.0f} s; {result['seconds']}")
    killed = json.loads((tmp_path / "killed").read_text())
    assert killed["executor_pid"] != killed["pid"]  # a JVM died, not just a Python worker
    assert result["executors_lost"] >= 1, result
    # the victim partition ran on the killed JVM, then again (a task or stage retry) elsewhere
    attempts = [line.split() for line in result["victim_attempts"]]
    assert len(attempts) >= 2 and int(attempts[0][3]) == killed["executor_pid"], attempts
    assert all(int(jvm) != killed["executor_pid"] for *_, jvm in attempts[1:]), attempts
    ids = list(range(result["rows"]))
    for run_name in ("clean", "faulty"):
        got = [row["id"] for row in result[run_name]]
        assert len(got) == len(set(got)), f"{run_name}: duplicated rows"
    clean = {row["id"]: (row["g"], row["s"]) for row in result["clean"]}
    faulty = {row["id"]: (row["g"], row["s"]) for row in result["faulty"]}
    assert_same_rows(clean, faulty, ids)
    assert result["orphans"] == [], "Python workers outlived their executor JVM"


# -- Dask ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dask_client():
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def _dask_frame(partitions: int = 8):
    import dask.dataframe as dd

    frame = pd.DataFrame({"id": range(len(PROMPTS)), "prompt": PROMPTS})
    return dd.from_pandas(frame, npartitions=partitions)


def _dask_infer(ddf, model_dir: str):
    from llm_operator.integrations.dask import llm_infer

    ddf = llm_infer(ddf, "prompt", output="g", model=model_dir, max_tokens=MAX_TOKENS)
    return llm_infer(ddf, "prompt", output="s", model=model_dir, max_tokens=MAX_TOKENS, **SAMPLED)


FIELDS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def _dask_rows(computed: pd.DataFrame) -> dict[int, tuple]:
    ids = computed["id"].tolist()
    assert ids == sorted(set(ids)), "rows out of order, or duplicated"

    def record(row, output: str) -> dict:
        values = {}
        for field in FIELDS:
            value = row[output if field == "text" else f"{output}_{field}"]
            values[field] = None if pd.isna(value) else value
        return values

    return {int(row["id"]): (record(row, "g"), record(row, "s")) for _, row in computed.iterrows()}


def _kill_after(marker: str, partition: int):
    """A map_partitions function that SIGKILLs its worker process once, right after the
    LLM columns of ``partition`` were computed (fused into the same task)."""

    def kill_after(frame: pd.DataFrame, partition_info=None) -> pd.DataFrame:
        if partition_info is not None and partition_info["number"] == partition:
            if claim(marker):
                note(marker, partition=partition)
                os.kill(os.getpid(), signal.SIGKILL)
        return frame

    return kill_after


def test_dask_worker_killed_mid_job(dask_client, model_dir, tmp_path):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests
    ddf = _dask_infer(_dask_frame(), model_dir)
    clean = _dask_rows(dask_client.compute(ddf).result(timeout=300))
    pids_before = set(dask_client.run(os.getpid).values())
    marker = str(tmp_path / "killed")
    faulty_ddf = ddf.map_partitions(_kill_after(marker, partition=5), meta=ddf._meta)
    faulty = _dask_rows(dask_client.compute(faulty_ddf).result(timeout=300))
    killed = json.loads(Path(marker).read_text())
    assert killed["pid"] in pids_before  # a worker process died...
    dask_client.wait_for_workers(2, timeout=120)  # ...and its nanny started a new one
    pids_after = set(dask_client.run(os.getpid).values())
    assert killed["pid"] not in pids_after and len(pids_after) == 2
    assert_same_rows(clean, faulty, list(range(len(PROMPTS))))


def test_dask_corrupt_model_fails_fast_with_its_error(dask_client, corrupt_model_dir):
    from llm_operator.integrations.dask import llm_infer

    ddf = llm_infer(_dask_frame(4), "prompt", output="out", model=corrupt_model_dir, max_tokens=2)
    futures = []

    def compute() -> None:
        futures.append(dask_client.compute(ddf))
        futures[0].result()

    outcome = bounded(compute, 180, lambda: dask_client.cancel(futures))
    error = outcome["error"]
    assert error is not None, "the job succeeded on a corrupt model"
    assert MODEL_ERROR in str(error), repr(error)
    print(f"dask corrupt model: {type(error).__name__}: {error} after {outcome['seconds']:.1f} s")
