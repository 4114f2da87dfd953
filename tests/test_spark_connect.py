"""Spark Connect: every Spark entry point on a Connect session gives classic Spark's results
row for row, and ``co_locate`` places each row in the same partition as on classic Spark.

One local Spark Connect server for the module (PySpark's own
``sbin/start-connect-server.sh``, ``local[2]``, on a free port), stopped at the end. The
classic side is the suite's ``spark`` session, in this same process: PySpark chooses
between its classic and its Connect functions (``F.col``, ``pandas_udf``, ...) by the
process-wide ``SPARK_CONNECT_MODE_ENABLED``, so the Connect half of each test runs inside
``connect_mode()``, which sets it and removes it again; the classic half runs outside it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("grpc", reason="the Spark Connect client needs the spark extra's grpcio")

from helpers import MODE, REVIEWS, TYPED_SCHEMA, chat_wrapped, connect_mode  # noqa: E402
from pyspark.sql import Column, DataFrame  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.integrations import spark_session  # noqa: E402
from llm_operator.integrations.infer_options import RESULT_FIELDS  # noqa: E402
from llm_operator.integrations.spark import (  # noqa: E402
    _partition_count,
    co_locate,
    llm_infer,
    llm_infer_df,
    partition_keys,
    spark_hash_long,
)
from llm_operator.integrations.spark_tables import plan_table  # noqa: E402
from llm_operator.prompts.table import TablePrompt  # noqa: E402

FIELDS = [name for name, _ in RESULT_FIELDS]
CHOICES = ("billing", "shipping", "tech support")
INSTRUCTIONS = (
    "Classify the sentiment as positive, negative or neutral.",
    "Summarize the review in one sentence.",
)
# 8 rows: 2 instructions x 4 reviews
ROWS = [
    (i, instruction, review)
    for i, (instruction, review) in enumerate(
        (instruction, review) for instruction in INSTRUCTIONS for review in REVIEWS[:4]
    )
]
TEMPLATE = "{instruction}\nReview: {review}\nAnswer:"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def remote(connect_url):
    """A Spark Connect session on the module's server."""
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    with connect_mode():
        session = RemoteSparkSession.builder.remote(connect_url).create()
    yield session
    with connect_mode():
        session.stop()


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


def on_both(spark, remote, build) -> tuple[list, list]:
    """``build(session)`` (a DataFrame) collected on classic Spark, then on Spark Connect."""
    assert MODE not in os.environ
    classic = build(spark).collect()
    with connect_mode():
        connected = build(remote).collect()
    return classic, connected


def _dicts(rows, *columns: str) -> list[dict]:
    """Rows by id, each as plain dicts (nested structs too)."""
    ordered = sorted(rows, key=lambda row: row["id"])
    return [{c: _plain(row[c]) for c in ("id", *columns)} for row in ordered]


def _assert_same(connected: list[dict], classic: list[dict]) -> None:
    """Row by row, field by field: equal, log-probabilities to 1e-4 (two processes' float
    sums); a failure names the row, column and field."""
    assert [r["id"] for r in connected] == [r["id"] for r in classic]
    for got, want in zip(connected, classic):
        for column, value in want.items():
            if not isinstance(value, dict):
                assert got[column] == value, (got["id"], column)
                continue
            assert set(got[column]) == set(value), (got["id"], column)
            for field, expected in value.items():
                actual = got[column][field]
                where = (got["id"], column, field, actual, expected)
                if field == "logprob" and expected is not None:
                    assert actual == pytest.approx(expected, abs=1e-4), where
                elif field == "choice_logprobs" and expected is not None:
                    assert set(actual) == set(expected), where
                    for choice, logprob in expected.items():
                        assert actual[choice] == pytest.approx(logprob, abs=1e-4), where
                else:
                    assert actual == expected, where


def _plain(value):
    return value.asDict(recursive=True) if hasattr(value, "asDict") else value


# -- the pieces -----------------------------------------------------------------------
HASHED = [0, 1, -1, 42, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, -(2**63)] + [
    random.Random(7).randrange(-(2**63), 2**63) for _ in range(300)
]


def test_connect_classes_and_spark_hash(spark, remote):
    def hashes(session):
        df = session.createDataFrame([(v,) for v in HASHED], "v bigint")
        return df.select("v", F.hash("v").alias("h"))

    classic, connected = on_both(spark, remote, hashes)
    expected = {v: spark_hash_long(v) for v in HASHED}
    assert {r["v"]: r["h"] for r in classic} == expected
    assert {r["v"]: r["h"] for r in connected} == expected
    with connect_mode():
        df = remote.range(3)
        assert type(df).__module__.startswith("pyspark.sql.connect")
        assert isinstance(df, DataFrame) and isinstance(F.col("id"), Column)
        assert _partition_count(df) is None  # no RDD on Connect
        with pytest.raises(NotImplementedError, match="rdd"):
            df.rdd  # noqa: B018 (what co_locate used to call)
    assert _partition_count(spark.range(10).repartition(3)) == 3


def test_partition_keys_place_rows_where_asked_under_adaptive_execution(remote):
    """repartition(n, key) puts partition_keys(n)[p] in partition p; adaptive execution,
    told to coalesce everything, coalesces a group-by's shuffle but not this one."""
    with connect_mode():
        remote.conf.set("spark.sql.adaptive.advisoryPartitionSizeInBytes", "1g")
        try:
            assert remote.conf.get("spark.sql.adaptive.enabled") == "true"
            for n in (1, 5, 16):
                keys = partition_keys(n)
                assert len(set(keys)) == n
                rows = [(p, keys[p]) for p in range(n)] * 2
                df = remote.createDataFrame(rows, "p int, k bigint").repartition(n, "k")
                placed = df.select("p", F.spark_partition_id().alias("at")).collect()
                assert sorted(placed) == sorted((p, p) for p, _ in rows), n
            grouped = remote.range(100).groupBy((F.col("id") % 10).alias("g")).count()
            at = grouped.select(F.spark_partition_id().alias("at")).distinct().collect()
            assert [r["at"] for r in at] == [0]  # 4 shuffle partitions coalesced into one
        finally:
            remote.conf.unset("spark.sql.adaptive.advisoryPartitionSizeInBytes")


def _grouped_rows() -> list[tuple[int, str]]:
    rng = random.Random(0)
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    rows = []
    for group in range(24):  # groups of 2 to 21 rows sharing a 70+ character prefix
        size = rng.choice((2, 3, 5, 8, 13, 21))
        prefix = f"Task {group:02d}: " + " ".join(rng.choice(words) for _ in range(10)) + " | "
        rows += [(group, f"{prefix}row {i} {rng.choice(words)}") for i in range(size)]
    rng.shuffle(rows)
    return rows


def test_co_locate_places_rows_as_on_classic_spark(spark, remote):
    rows = _grouped_rows()

    def placed(session, partitions=4, key="prompt"):
        df = session.createDataFrame(rows, "group int, prompt string").repartition(3)
        out = co_locate(df, F.col("prompt") if key == "expression" else key, partitions)
        assert out.columns == ["group", "prompt"]
        return out.withColumn("at", F.spark_partition_id())

    classic, connected = on_both(spark, remote, placed)
    by_partition: dict[int, list[tuple[int, str]]] = {}
    for row in connected:  # collect keeps partition order, and the order within each
        by_partition.setdefault(row["at"], []).append((row["group"], row["prompt"]))
    assert [tuple(r) for r in connected] == [tuple(r) for r in classic]  # same place, same order
    assert sorted(r for rows_ in by_partition.values() for r in rows_) == sorted(rows)
    groups: dict[int, set[int]] = {}
    for row in connected:
        groups.setdefault(row["group"], set()).add(row["at"])
    assert all(len(at) == 1 for at in groups.values()), groups  # every group whole
    assert all([p for _, p in part] == sorted(p for _, p in part) for part in by_partition.values())
    assert len(by_partition) == 4
    # default partitions on Connect: those of the input holding rows (3); an expression key
    classic, connected = on_both(spark, remote, lambda s: placed(s, None, "expression"))
    assert {r["at"] for r in connected} == {0, 1, 2}
    assert [tuple(r) for r in connected] == [tuple(r) for r in classic]


# -- inference ------------------------------------------------------------------------
def _frame(session):
    df = session.createDataFrame(ROWS, "id int, instruction string, review string")
    prompt = F.concat("instruction", F.lit("\nReview: "), "review", F.lit("\nAnswer:"))
    # the same batch, in the same order, on both. One partition: each llm_infer column is a
    # Python worker of its own per task (a separate ArrowEvalPython), each loading the model,
    # so a second partition would double those loads; later tests reuse these workers.
    return df.repartition(1).sortWithinPartitions("id").withColumn("prompt", prompt)


def test_llm_infer_columns_equal_classic_spark(spark, remote, model_dir):
    """Each llm_infer column is a Python worker of its own per task, each loading the model:
    three columns cover a prompt column (with choices, log-probabilities, a JSON schema) and
    a template."""
    runs = {
        "tmpl": dict(template=TEMPLATE, max_tokens=MAX_TOKENS),
        "pick": dict(choices=CHOICES, logprobs=True, max_tokens=8),
        "typed": dict(json_schema=TYPED_SCHEMA, max_tokens=100),
    }

    def build(session):  # a prompt column, with options, and a template of columns
        template = llm_infer(None, model=model_dir, **runs["tmpl"]).alias("tmpl")
        columns = [
            llm_infer("prompt", model=model_dir, **o).alias(c)
            for c, o in runs.items()
            if c != "tmpl"
        ]
        return _frame(session).select("id", template, *columns)

    classic, connected = on_both(spark, remote, build)
    _assert_same(_dicts(connected, *runs), _dicts(classic, *runs))
    # and both are the operator's outputs
    prompts = [f"{instruction}\nReview: {review}\nAnswer:" for _, instruction, review in ROWS]
    operator = LLMOperator(model_dir)
    prompts = chat_wrapped(prompts)  # chat="auto": the tiny tokenizer has a chat template
    plain = operator.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    typed = operator.generate(prompts, SamplingParams(max_tokens=100, json_schema=TYPED_SCHEMA))
    for row in _dicts(connected, "tmpl", "typed", "pick"):
        want = plain[row["id"]]
        # the template renders the prompt the "prompt" column holds: every field the same
        assert row["tmpl"] == {name: getattr(want, name) for name in FIELDS}
        assert (row["typed"]["text"], row["typed"]["finish_reason"]) == (
            typed[row["id"]].text,
            typed[row["id"]].finish_reason,
        )
        assert row["typed"]["value"] == json.loads(row["typed"]["text"])  # typed on the worker
        assert row["pick"]["text"] in CHOICES and set(row["pick"]["choice_logprobs"]) == set(
            CHOICES
        )


TABLE = [  # (id, review, stars): 6 distinct rows, 4 of them twice
    (i, review, stars)
    for i, (review, stars) in enumerate(
        [(REVIEWS[k % 6], 1 + k % 3) for k in range(6)]
        + [(REVIEWS[k], 1 + k % 3) for k in range(4)]
    )
]


def test_llm_infer_df_dedupe_and_reorder_fields_equal_classic_spark(spark, remote, model_dir):
    options = dict(model=model_dir, max_tokens=MAX_TOKENS)
    instruction = "Rate the urgency from 1 to 5 and explain briefly."

    def table(session):
        # round robin: rows in all 3 partitions (Connect's default partition count is that of
        # the partitions holding rows; repartition(3, "id") leaves one empty here)
        return session.createDataFrame(TABLE, "id int, review string, stars int").repartition(3)

    def build(session):
        df = table(session)
        out = llm_infer_df(
            df,
            columns=["review", "stars"],
            instruction=instruction,
            reorder_fields=True,
            dedupe=True,
            **options,
        )
        return out.withColumn("at", F.spark_partition_id())

    def by_prompt(session):  # a prompt column, deduplicated over the whole frame
        df = table(session).withColumn("prompt", F.concat(F.lit("Review: "), "review"))
        return llm_infer_df(df, "prompt", dedupe=True, **options).withColumn(
            "at", F.spark_partition_id()
        )

    for make in (build, by_prompt):
        classic, connected = on_both(spark, remote, make)
        assert len(connected) == len(TABLE)
        assert _dicts(connected, "out", "at") == _dicts(classic, "out", "at"), make.__name__
        placed: dict[str, set[int]] = {}
        for row in connected:  # identical prompts meet in one partition
            placed.setdefault(row["review"], set()).add(row["at"])
        assert all(len(at) == 1 for at in placed.values()), placed
        assert all(row["out"]["error"] is None for row in connected)
    prompt = TablePrompt.build(columns=["review", "stars"], instruction=instruction)
    classic_plan = plan_table(table(spark), prompt)
    with connect_mode():
        connect_plan = plan_table(table(remote), prompt)
    assert connect_plan.report() == classic_plan.report()
    assert (connect_plan.rows, connect_plan.distinct_prompts) == (10, 6)


# -- the command line ---------------------------------------------------------------------
def _cli_run(args: list[str], out: Path, model_dir: str, *, subprocess_run: bool = False):
    from llm_operator.cli import main

    argv = [
        "run",
        str(args[0]),
        "--template",
        "Review: {text}\nSentiment:",
        "--output",
        str(out),
        "--model",
        model_dir,
        "--max-tokens",
        "4",
        "--no-progress",
        *args[1:],
    ]
    if subprocess_run:
        done = subprocess.run(
            [sys.executable, "-m", "llm_operator.cli", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != MODE},
        )
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture()
def reviews(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "reviews.parquet"
    texts = [REVIEWS[0], REVIEWS[1], None, REVIEWS[0], REVIEWS[2]]
    pq.write_table(pa.table({"id": list(range(5)), "text": texts}), path)
    return path


def _same_outputs(got: list[dict], want: list[dict]) -> None:
    assert [r["id"] for r in got] == [0, 1, 2, 3, 4]
    for key in ("out", "out_finish_reason", "out_completion_tokens", "out_error"):
        assert [r[key] for r in got] == [r[key] for r in want], key


def test_cli_master_sc_runs_on_spark_connect(connect_url, model_dir, reviews, tmp_path):
    local = _cli_run([reviews], tmp_path / "local.jsonl", model_dir)
    connected = _cli_run(
        [reviews, "--engine", "spark", "--master", connect_url, "--partitions", "2"],
        tmp_path / "connect.jsonl",
        model_dir,
        subprocess_run=True,  # a process of its own: PySpark keeps one mode per process
    )
    _same_outputs(connected, local)


def test_cli_master_local(spark, model_dir, reviews, tmp_path):
    """In this process the suite's classic session is reused (getOrCreate); the master
    reaches the session builder (test_session_routes_the_master)."""
    local = _cli_run([reviews], tmp_path / "local.jsonl", model_dir)
    spark_out = _cli_run(
        [reviews, "--engine", "spark", "--master", "local[2]"], tmp_path / "s.jsonl", model_dir
    )
    _same_outputs(spark_out, local)


def test_session_routes_the_master(monkeypatch):
    calls = []
    monkeypatch.setattr(spark_session, "classic_session", lambda m, a: calls.append(("c", m)))
    monkeypatch.setattr(spark_session, "connect_session", lambda url: calls.append(("r", url)))
    spark_session.session(3)
    spark_session.session(3, "local-cluster[2,1,1024]")
    spark_session.session(3, "sc://host:15002")
    spark_session.session(3, "yarn")
    assert calls == [
        ("c", "local[3]"),
        ("c", "local-cluster[2,1,1024]"),
        ("r", "sc://host:15002"),
        ("c", "yarn"),
    ]
    with pytest.raises(ValueError, match="master"):
        spark_session.session(3, " ")


def test_connect_session_is_refused_beside_a_classic_context(spark):
    with pytest.raises(ValueError, match="classic SparkContext"):
        spark_session.connect_session("sc://127.0.0.1:1")
    assert MODE not in os.environ
