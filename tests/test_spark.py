"""Spark integration: exact outputs per partition, co-location, bad rows, one engine per
worker, task retries. All Spark tests share the session-scoped ``spark`` fixture."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")

import pandas as pd  # noqa: E402
from helpers import REVIEWS, TYPED_SCHEMA, chat_wrapped, job_group  # noqa: E402
from pyspark import cloudpickle  # noqa: E402
from pyspark.resource import ResourceInformation  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

import llm_operator.integrations.spark as spark_module  # noqa: E402
from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.integrations.infer_options import RESULT_FIELDS, make_options  # noqa: E402
from llm_operator.integrations.json_values import value_type  # noqa: E402
from llm_operator.integrations.spark import (  # noqa: E402
    RESULT_TYPE,
    check_prompt_type,
    co_locate,
    infer_batches,
    llm_infer,
    llm_infer_df,
    result_type,
    spark_value_type,
    task_device,
)
from llm_operator.results import GenerationResult  # noqa: E402

# Workers cannot import this test module: ship the functions defined here by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_TOKENS = 8
FIELDS = [name for name, _ in RESULT_FIELDS]
INSTRUCTIONS = (
    "Classify the sentiment as positive, negative or neutral.",
    "Summarize the review in one sentence.",
    "Extract the product name and the main complaint.",
    "Rate the urgency from 1 to 5 and explain briefly.",
)
# 40 rows: 4 instructions x 10 reviews, in 4 partitions of 10 rows
ROWS = [
    (index, instruction, review)
    for index, (instruction, review) in enumerate(
        (instruction, review) for instruction in INSTRUCTIONS for review in REVIEWS
    )
]
ROW_SCHEMA = "id int, instruction string, review string"


def template(instruction: str, review: str) -> str:
    return f"{instruction}\nReview: {review}\nAnswer:"


PROMPTS = [template(instruction, review) for _, instruction, review in ROWS]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """prompts -> LLMOperator.generate's results as result-field dicts."""
    operator = LLMOperator(model_dir)

    def generate(prompts) -> list[dict]:
        results = operator.generate(chat_wrapped(prompts), SamplingParams(max_tokens=MAX_TOKENS))
        return [{name: getattr(r, name) for name in FIELDS} for r in results]

    return generate


@pytest.fixture
def frame(spark):
    """ROWS with a ``prompt`` column, in 4 partitions of 10 rows."""
    rdd = spark.sparkContext.parallelize(ROWS, 4)
    df = spark.createDataFrame(rdd, ROW_SCHEMA)
    return df.withColumn("prompt", _prompt_template())


def _prompt_template():
    return F.concat(F.col("instruction"), F.lit("\nReview: "), F.col("review"), F.lit("\nAnswer:"))


def _records(rows, column: str = "out") -> list[dict]:
    return [rows_out.asDict() for rows_out in (row[column] for row in rows)]


# -- driver-side checks ---------------------------------------------------------------
def test_bad_options_raise_on_the_driver(spark, model_dir):
    with pytest.raises(ValueError, match="max_tokens"):
        llm_infer("prompt", model=model_dir, max_tokens=0)
    with pytest.raises(ValueError, match="engine_options"):
        llm_infer("prompt", model=model_dir, engine_options={"no_such_option": 1})
    with pytest.raises(TypeError, match="model"):
        llm_infer("prompt", model=None)
    with pytest.raises(TypeError, match="col must be a column name or a Column, got int"):
        llm_infer(3, model=model_dir)
    with pytest.raises(ValueError, match="output"):
        llm_infer_df(spark.range(1), "id", output="", model=model_dir)


def test_prompt_types():
    message = T.StructType(
        [T.StructField("role", T.StringType()), T.StructField("content", T.StringType())]
    )
    check_prompt_type(T.StringType())
    check_prompt_type(T.ArrayType(message))
    check_prompt_type(T.ArrayType(T.MapType(T.StringType(), T.StringType())))
    for bad in (T.IntegerType(), T.BinaryType(), T.ArrayType(T.StringType())):
        with pytest.raises(TypeError, match=re.escape(bad.simpleString())):
            check_prompt_type(bad)


def test_task_device_uses_the_first_assigned_gpu(model_dir):
    class Context:
        def __init__(self, resources):
            self._resources = resources

        def resources(self):
            return self._resources

    options = make_options(model=model_dir)
    gpu = {"gpu": ResourceInformation("gpu", ["1", "3"])}
    assert task_device(Context(gpu), options) == "cuda:1"
    assert task_device(Context({}), options) == "cpu"
    assert task_device(None, options) == "cpu"
    chosen = make_options(model=model_dir, engine_options={"device": "cpu"})
    assert task_device(Context({}), chosen) is None  # get_operator keeps the option's device


def test_infer_batches_runs_the_partition_once_and_keeps_batch_sizes(
    model_dir, reference, monkeypatch, caplog
):
    calls = []
    real = spark_module.run_partition

    def counting(values, options, **kwargs):
        calls.append((len(values), kwargs["label"]))
        return real(values, options, **kwargs)

    class FakeContext:
        @staticmethod
        def get():
            return FakeContext()

        def partitionId(self):
            return 7

        def resources(self):
            return {}

    monkeypatch.setattr(spark_module, "run_partition", counting)
    monkeypatch.setattr(spark_module, "TaskContext", FakeContext)
    batches = [pd.Series(PROMPTS[:3]), pd.Series([], dtype=object), pd.Series(PROMPTS[3:5])]
    options = make_options(model=model_dir, max_tokens=MAX_TOKENS)
    with caplog.at_level("INFO", logger="llm_operator.integrations"):
        frames = list(infer_batches(iter(batches), options))
    assert calls == [(5, "spark partition 7")]
    assert [len(f) for f in frames] == [3, 0, 2]
    assert list(frames[0].columns) == FIELDS
    assert pd.concat(frames).to_dict("records") == reference(PROMPTS[:5])
    assert "spark partition 7: 5 rows" in caplog.text
    with pytest.raises(TypeError, match="int64"):
        list(infer_batches(iter([pd.Series([1, 2])]), options))
    with pytest.raises(TypeError, match="prompt column 'n': llm_infer needs a string column"):
        list(infer_batches(iter([pd.Series([1, 2])]), options, prompt_name="n"))


# -- jobs ---------------------------------------------------------------------------
# Order matters for speed only: a failed task takes its Python workers down, and the
# injected failure runs in a worker of its own that a later llm_infer task may get (and
# build an engine in), so the retry test runs first, while no worker has an engine yet.
def test_failed_task_is_retried_with_identical_output(spark, frame, model_dir):
    @F.pandas_udf("string")
    def fail_first_attempt(prompts: pd.Series) -> pd.Series:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context.partitionId() == 0 and context.attemptNumber() == 0:
            raise RuntimeError("injected failure of partition 0, attempt 0")
        return prompts

    options = dict(model=model_dir, max_tokens=MAX_TOKENS)
    with job_group(spark, "llm-retry") as tracker:
        retried = frame.select(
            "id", llm_infer(fail_first_attempt("prompt"), **options).alias("out")
        ).collect()
        stages = [
            stage
            for job in tracker.getJobIdsForGroup("llm-retry")
            for stage in tracker.getJobInfo(job).stageIds
        ]
        failed = sum(tracker.getStageInfo(stage).numFailedTasks for stage in stages)
    assert failed >= 1, "the injected failure did not happen"
    clean = frame.select("id", llm_infer("prompt", **options).alias("out")).collect()
    assert [row["id"] for row in retried] == [row[0] for row in ROWS]  # none lost or repeated
    assert _records(retried) == _records(clean)


@pytest.mark.parametrize(("method", "column"), [("withColumn", "name"), ("select", "template")])
def test_outputs_match_the_operator(spark, frame, model_dir, reference, method, column):
    prompt = "prompt" if column == "name" else _prompt_template()
    out = llm_infer(prompt, model=model_dir, max_tokens=MAX_TOKENS)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "4")  # 3 batches a partition
    try:
        if method == "withColumn":
            result = frame.withColumn("out", out).select("id", "out")
        else:
            result = frame.select("id", out.alias("out"))
        assert result.rdd.getNumPartitions() == 4
        rows = result.collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert [row["id"] for row in rows] == [row[0] for row in ROWS]
    assert _records(rows) == reference(PROMPTS)


def test_chat_message_lists(spark, model_dir, reference):
    messages = [[("system", "Be brief."), ("user", review)] for review in REVIEWS[:4]]
    schema = "id int, messages array<struct<role: string, content: string>>"
    df = spark.createDataFrame(list(enumerate(messages)), schema).coalesce(1)
    rows = llm_infer_df(df, "messages", model=model_dir, max_tokens=MAX_TOKENS).collect()
    expected = reference([[{"role": r, "content": c} for r, c in m] for m in messages])
    assert [row["out"].asDict() for row in rows] == expected
    assert all(row["out"]["finish_reason"] in ("stop", "length") for row in rows)


def test_null_and_empty_prompts_get_error_rows(spark, model_dir, reference):
    prompts = [PROMPTS[0], None, PROMPTS[1], "", PROMPTS[2]]
    df = spark.createDataFrame(list(enumerate(prompts)), "id int, prompt string").repartition(1)
    rows = llm_infer_df(df, "prompt", model=model_dir, max_tokens=MAX_TOKENS).collect()
    by_id = {row["id"]: row["out"] for row in rows}
    assert len(rows) == 5
    for bad in (1, 3):
        assert by_id[bad]["finish_reason"] == "error"
        assert by_id[bad]["error"]
        assert by_id[bad]["completion_tokens"] == 0
    expected = reference([PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    assert [by_id[i].asDict() for i in (0, 2, 4)] == expected


# -- constrained outputs ------------------------------------------------------------
# every type the value maps, for the conversion test (texts are given, not generated)
EVERY_TYPE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "member": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zips": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "scores": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "friends": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    },
    "required": ["name"],
}
CHOICES = ("billing", "shipping", "tech support")


def test_value_types_map_to_spark_types():
    every = spark_value_type(value_type(EVERY_TYPE_SCHEMA))
    assert every.simpleString() == (
        "struct<name:string,age:bigint,height:double,member:boolean,"
        "address:struct<city:string,zips:array<bigint>>,scores:array<array<double>>,"
        "friends:array<struct<name:string>>>"
    )
    assert all(field.nullable for field in every.fields)  # required or not
    assert RESULT_TYPE["logprob"].dataType == T.DoubleType()
    assert RESULT_TYPE["choice_logprobs"].dataType == T.MapType(T.StringType(), T.DoubleType())
    assert result_type(None) == RESULT_TYPE
    typed = result_type(value_type(TYPED_SCHEMA))
    assert typed.fieldNames() == [*FIELDS, "value"]
    assert RESULT_TYPE.fieldNames() == FIELDS  # left as it was
    # the user's property order, not the canonical (sorted) one the options keep
    assert typed["value"].dataType.fieldNames() == ["ok", "label", "detail", "tags"]


def test_infer_batches_types_values_and_says_why_not(spark, model_dir, monkeypatch):
    """Given texts through the UDF body, then through Arrow into the Spark type."""
    texts = [
        '{"name": "Ada", "age": 36, "height": 1.7, "member": true, "address": {"city": "X",'
        ' "zips": [1, 2]}, "scores": [[1, 2.5], []], "friends": [{"name": "Bo"}]}',
        '{"name": "Bo", "age": 5.0, "height": null, "extra": 1}',
        '{"name": "Cy", "age": "5"}',
        '{"name": "Di", "age": 5',
    ]
    results = [GenerationResult(text, (1,), "stop", 4, 9, logprob=-2.0) for text in texts]
    results.append(GenerationResult("{", (1,), "length", 4, 1, "the output is not valid: cut"))
    results.append(GenerationResult.failed("prompt is null"))
    monkeypatch.setattr(spark_module, "run_partition", lambda values, *a, **k: results)
    node = value_type(EVERY_TYPE_SCHEMA)
    options = make_options(model=model_dir, json_schema=EVERY_TYPE_SCHEMA)
    batches = [pd.Series(["p"] * 4), pd.Series(["p", None])]
    frame = pd.concat(list(infer_batches(iter(batches), options, node)), ignore_index=True)
    assert list(frame.columns) == [*FIELDS, "value"]
    rows = spark.createDataFrame(frame, result_type(node)).collect()  # Arrow, as the UDF's
    values = [row["value"] for row in rows]
    assert values[0].asDict(recursive=True) == {
        "name": "Ada", "age": 36, "height": 1.7, "member": True,
        "address": {"city": "X", "zips": [1, 2]}, "scores": [[1.0, 2.5], []],
        "friends": [{"name": "Bo"}],
    }  # fmt: skip
    assert values[1].asDict(recursive=True) == {
        "name": "Bo", "age": 5, "height": None, "member": None, "address": None,
        "scores": None, "friends": None,
    }  # fmt: skip
    assert values[2:] == [None] * 4
    errors = [row["error"] for row in rows]
    assert errors[:2] == [None, None]
    assert "does not fit json_schema: value.age: expected an integer" in errors[2]
    assert "not valid JSON" in errors[3]
    assert errors[4:] == ["the output is not valid: cut", "prompt is null"]  # kept
    assert [row["logprob"] for row in rows] == [-2.0] * 4 + [None, None]


def test_untypable_schema_is_refused_on_the_driver(spark, model_dir):
    union = {
        "type": "object",
        "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
    }
    df = spark.createDataFrame([("a",)], "prompt string")
    with job_group(spark, "llm-untypable") as tracker:
        with pytest.raises(ValueError, match=r"json_schema\.properties\.x: 'anyOf'.*value=False"):
            llm_infer("prompt", model=model_dir, json_schema=union)
        with pytest.raises(TypeError, match="value must be a bool"):
            llm_infer("prompt", model=model_dir, json_schema=union, value=1)
        assert tracker.getJobIdsForGroup("llm-untypable") == []
    plain = df.select(
        llm_infer("prompt", model=model_dir, json_schema=union, value=False).alias("o")
    )
    assert plain.schema["o"].dataType == RESULT_TYPE  # no job: only the schema


def test_constrained_outputs_match_the_operator(spark, model_dir):
    prompts = PROMPTS[::7][:6]
    df = spark.createDataFrame(list(enumerate(prompts)), "id int, prompt string").repartition(
        2, "id"
    )
    runs = {  # column -> options
        "typed": dict(max_tokens=100, json_schema=TYPED_SCHEMA, logprobs=True),
        "pick": dict(max_tokens=8, choices=CHOICES, logprobs=True),
        "cut": dict(max_tokens=3, json_schema=json.dumps(TYPED_SCHEMA)),
        "plain": dict(max_tokens=4),
    }
    out = df.select(
        "id", *(llm_infer("prompt", model=model_dir, **o).alias(c) for c, o in runs.items())
    )
    assert out.schema["typed"].dataType == result_type(value_type(TYPED_SCHEMA))
    assert out.schema["cut"].dataType == out.schema["typed"].dataType
    assert out.schema["pick"].dataType == RESULT_TYPE
    rows = sorted(out.collect(), key=lambda row: row["id"])
    nested = {
        row["id"]: row[1:]
        for row in out.select(
            "id", "typed.value.detail.urgent", "typed.value.tags", "typed.value.label"
        ).collect()
    }
    operator = LLMOperator(model_dir)
    expected = {
        c: operator.generate(chat_wrapped(prompts), SamplingParams(**o)) for c, o in runs.items()
    }
    for row in rows:
        for column, results in expected.items():
            want, got = results[row["id"]], row[column]
            assert (got["text"], got["finish_reason"]) == (want.text, want.finish_reason), column
            if want.logprob is None:
                assert got["logprob"] is None, column
            else:
                assert got["logprob"] == pytest.approx(want.logprob, abs=1e-4), column
        typed = row["typed"]
        assert typed["error"] is None and typed["finish_reason"] == "stop"
        assert typed["value"].asDict(recursive=True) == json.loads(typed["text"])
        data = json.loads(typed["text"])
        assert nested[row["id"]] == (data["detail"]["urgent"], data["tags"], data["label"])
        assert row["pick"]["text"] in CHOICES
        want_scores = expected["pick"][row["id"]].choice_logprobs
        assert row["pick"]["choice_logprobs"] == pytest.approx(want_scores, abs=1e-4)
        assert row["typed"]["choice_logprobs"] is None and row["plain"]["choice_logprobs"] is None
        cut = row["cut"]
        assert cut["finish_reason"] == "length" and cut["value"] is None
        assert "not valid" in cut["error"]


def test_engine_is_built_once_per_python_worker(spark, frame, model_dir):
    for max_tokens in (4, 6):  # two jobs of 4 tasks each; options differ, the engine does not
        out = llm_infer("prompt", model=model_dir, max_tokens=max_tokens)
        assert frame.select(out.alias("out")).where("out.finish_reason = 'error'").count() == 0

    # Workers live across the suite and may hold engines for other options; count this key's.
    key = make_options(model=model_dir).engine_key("cpu")  # task_device on a CPU task

    @F.pandas_udf("string")
    def probe(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        from llm_operator.integrations.worker import engine_constructions

        time.sleep(0.1)  # keep both task slots busy, so every idle worker gets a task
        for batch in batches:
            yield pd.Series([f"{os.getpid()}:{engine_constructions(key)}"] * len(batch))

    probes = spark.sparkContext.parallelize(range(8), 8).map(lambda i: (i,)).toDF(["i"])
    reports = {row[0] for row in probes.select(probe("i")).collect()}
    constructions = dict(report.split(":") for report in reports)  # pid -> count
    assert set(constructions.values()) <= {"0", "1"}, constructions
    assert "1" in constructions.values(), constructions


# -- co-location --------------------------------------------------------------------
def test_co_locate_keeps_groups_whole_sorted_and_balanced(spark):
    import random

    rng = random.Random(0)
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    rows = []
    for group in range(30):  # groups of 2 to 34 rows sharing a 70+ character prefix
        size = rng.choice((2, 3, 5, 8, 13, 21, 34))
        prefix = f"Task {group:02d}: " + " ".join(rng.choice(words) for _ in range(10)) + " | "
        for i in range(size):
            rows.append((group, f"{prefix}row {i} {rng.choice(words)}"))
    rng.shuffle(rows)
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 3), "group int, prompt string")
    placed = co_locate(df, "prompt", 4)
    assert placed.rdd.getNumPartitions() == 4
    assert placed.columns == ["group", "prompt"]
    located = placed.withColumn("partition", F.spark_partition_id()).collect()
    assert sorted((r["group"], r["prompt"]) for r in located) == sorted(rows)
    partitions_of: dict[int, set[int]] = {}
    for row in located:
        partitions_of.setdefault(row["group"], set()).add(row["partition"])
    assert all(len(p) == 1 for p in partitions_of.values()), partitions_of
    by_partition: dict[int, list[str]] = {}
    for row in located:  # collect keeps partition order and the order within each
        by_partition.setdefault(row["partition"], []).append(row["prompt"])
    assert all(prompts == sorted(prompts) for prompts in by_partition.values())
    sizes = [len(by_partition.get(p, [])) for p in range(4)]
    assert max(sizes) <= 2 * min(sizes), sizes
    # deterministic, and a Column expression works as the key (its temporary column is dropped)
    again = co_locate(df, F.col("prompt"), 4).withColumn("partition", F.spark_partition_id())
    assert sorted(tuple(r) for r in again.collect()) == sorted(tuple(r) for r in located)


def test_co_location_sample_is_seeded_and_spans_every_partition(spark):
    """The sample is capped, the same for the same seed, every prompt sits in the partition
    it names, a partition of many rows gets its share, nulls are never sampled, and the
    count is the frame's rows."""
    from llm_operator.integrations.spark import _sample_prompts

    parts = [[(f"p{part} row {i}" if i % 7 else None,) for i in range(50)] for part in range(3)]
    parts.append([(f"big row {i}",) for i in range(400)])  # one partition of 3x its share
    rdd = spark.sparkContext.parallelize(parts, len(parts)).flatMap(lambda part: part)
    df = spark.createDataFrame(rdd, "prompt string")  # partition i holds parts[i]
    rows = [row for part in parts for row in part]
    located = df.select("prompt", F.spark_partition_id().alias("part")).collect()
    where = {r["prompt"]: r["part"] for r in located}
    assert sorted(set(where.values())) == [0, 1, 2, 3] and where["big row 0"] == 3
    sample, total = _sample_prompts(df, "prompt", 40, 7)
    assert total == len(rows)
    assert len(sample) == 40 and len(set(sample)) == 40
    assert all(prompt is not None and where[prompt] == part for prompt, part in sample)
    assert _sample_prompts(df, "prompt", 40, 7) == (sample, total)
    big = sum(prompt.startswith("big") for prompt, _ in sample)
    assert 15 <= big <= 38, big  # about 400 / 529 of the sample
    whole, _ = _sample_prompts(df, "prompt", 1000, 7)
    assert sorted(p for p, _ in whole) == sorted(r[0] for r in rows if r[0] is not None)


def test_co_locate_checks_its_arguments(spark):
    df = spark.createDataFrame([(1, "a")], "n int, prompt string")
    with pytest.raises(ValueError, match="num_partitions"):
        co_locate(df, "prompt", 0)
    with pytest.raises(ValueError, match="sample_size"):
        co_locate(df, "prompt", sample_size=0)
    with pytest.raises(TypeError, match="type int"):
        co_locate(df, "n")


def test_wrong_type_column_is_a_type_error_before_any_model_loads(spark, model_dir):
    df = spark.createDataFrame([(1,), (2,)], "n int").coalesce(1)
    with job_group(spark, "llm-wrong-type") as tracker:
        with pytest.raises(TypeError, match="type int"):
            llm_infer_df(df, "n", model=model_dir)
        assert tracker.getJobIdsForGroup("llm-wrong-type") == []  # no job ran
    # Through the bare column the UDF raises it, before run_partition loads a model. (Last
    # in this file: a task that raises takes its Python worker down, engine and all.)
    with pytest.raises(
        Exception, match=r"(?s)TypeError.*prompt column 'n'.*llm_infer needs a string column.*int32"
    ):
        df.select(llm_infer("n", model=model_dir)).collect()


def test_a_worker_python_without_llm_operator_is_named_on_the_driver(
    spark, model_dir, tmp_path, monkeypatch
):
    """The README's recipe without PYSPARK_PYTHON: workers would run a `python3` that has
    no llm_operator and fail inside a JVM trace; llm_infer says what to set instead."""
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llm_operator'\" >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(spark.sparkContext, "pythonExec", str(fake))
    with pytest.raises(ValueError) as error:
        llm_infer("prompt", model=model_dir, max_tokens=2)
    message = str(error.value)
    assert str(fake) in message and "PYSPARK_PYTHON" in message
    assert "No module named 'llm_operator'" in message and sys.executable in message
    monkeypatch.setattr(spark.sparkContext, "pythonExec", sys.executable)
    llm_infer("prompt", model=model_dir, max_tokens=2)  # this interpreter: no check needed
