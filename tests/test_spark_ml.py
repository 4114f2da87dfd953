"""Spark ML: ``LLMTransformer`` as a pipeline stage gives ``llm_infer``'s and
``LLMOperator.generate``'s results, checks its options when they are set, and survives
save and load (alone, and in a ``Pipeline``/``PipelineModel``) in another session, on
classic Spark and on Spark Connect.

The classic side is the suite's ``spark`` session. The Connect side is one local Spark
Connect server for this module, started as ``tests/test_spark_connect.py`` starts its
own (PySpark's ``sbin/start-connect-server.sh`` on a free port), and used inside
``connect_mode()``. The rows sit in one partition, so each side loads the tiny model in
one Python worker (the engine is then reused by every later job on that side).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from helpers import REVIEWS, chat_wrapped, connect_mode  # noqa: E402
from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.feature import SQLTransformer  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.integrations.infer_options import RESULT_FIELDS  # noqa: E402
from llm_operator.integrations.spark import llm_infer, llm_infer_df  # noqa: E402
from llm_operator.integrations.spark_ml import (  # noqa: E402
    DEFAULT_OUTPUT_COL,
    LLMTransformer,
    check_options,
)

MAX_TOKENS = 6
FIELDS = [name for name, _ in RESULT_FIELDS]
# four reviews and a null one: its prompt (concat with null) is null, an error row
ROWS = [(i, review) for i, review in enumerate(REVIEWS[:4])] + [(4, None)]
ROW_SCHEMA = "id int, review string"
STATEMENT = "SELECT *, concat('Classify the sentiment: ', review) AS prompt FROM __THIS__"


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


def make_frame(session):
    return session.createDataFrame(ROWS, ROW_SCHEMA).coalesce(1)


def make_stage(model_dir: str) -> LLMTransformer:
    return LLMTransformer(
        inputCol="prompt",
        outputCol="out",
        errorCol="err",
        model=model_dir,
        options={"max_tokens": MAX_TOKENS, "stop": ["\n\n"]},
        temperature=0.0,
    )


def make_pipeline(model_dir: str) -> Pipeline:
    return Pipeline(stages=[SQLTransformer(statement=STATEMENT), make_stage(model_dir)])


def by_id(rows, *columns: str) -> list[dict]:
    """Rows sorted by id, as plain dicts (structs too)."""
    ordered = sorted(rows, key=lambda row: row["id"])
    return [{c: _plain(row[c]) for c in ("id", *columns)} for row in ordered]


def _plain(value):
    return value.asDict(recursive=True) if hasattr(value, "asDict") else value


def assert_same_results(got: list[dict], want: list[dict]) -> None:
    """Row by row: equal, log-probabilities to 1e-4 (two processes' float sums)."""
    assert [r["id"] for r in got] == [r["id"] for r in want]
    for mine, theirs in zip(got, want):
        for column, value in theirs.items():
            if isinstance(value, dict):
                for field, expected in value.items():
                    actual = mine[column][field]
                    if field == "logprob" and expected is not None:
                        assert actual == pytest.approx(expected, abs=1e-4), (mine["id"], field)
                    else:
                        assert actual == expected, (mine["id"], column, field)
            else:
                assert mine[column] == value, (mine["id"], column)


@pytest.fixture(scope="module")
def classic_rows(spark, model_dir):
    """The fitted pipeline's rows on classic Spark, next to ``llm_infer``'s own column
    computed in the same job."""
    frame = make_frame(spark)
    model = make_pipeline(model_dir).fit(frame)
    direct = llm_infer("prompt", model=model_dir, max_tokens=MAX_TOKENS, stop=["\n\n"])
    rows = model.transform(frame).withColumn("direct", direct).collect()
    return model, by_id(rows, "prompt", "out", "err", "direct")


# -- options and params, no Spark job -------------------------------------------------
def test_unknown_and_bad_options_fail_when_set():
    with pytest.raises(TypeError, match=r"unknown option 'max_token' \(did you mean 'max_tokens'"):
        LLMTransformer(model="m", options={"max_token": 8})
    stage = LLMTransformer(model="m")
    with pytest.raises(TypeError, match="unknown option 'temprature'"):
        stage.setOptions({"temprature": 0.5})
    with pytest.raises(TypeError, match="unknown option 'temprature'"):
        stage.setOption("temprature", 0.5)
    with pytest.raises(TypeError, match="unknown option 'temprature'"):
        stage.setOptions('{"temprature": 0.5}')  # JSON text too
    with pytest.raises(TypeError, match="unknown option 'no_such'"):
        stage.setOptions({"engine_options": {"no_such": 1}})
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        stage.setMaxTokens(0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        stage.copy({stage.options: {"max_tokens": 0}})  # a transform(df, params) param map
    with pytest.raises(ValueError, match="model is a Param of its own"):
        stage.setOptions({"model": "other"})
    with pytest.raises(TypeError, match="JSON"):
        stage.setOptions({"seed": 1, "vllm_options": {"x": object()}})
    with pytest.raises(TypeError, match="value must be a bool"):
        stage.setOptions({"value": "yes"})
    with pytest.raises(TypeError, match="forces keyword arguments"):
        LLMTransformer("prompt")
    assert stage.getOptions() == {}  # every failed set left the options as they were


def test_params_defaults_shortcuts_and_copies():
    stage = LLMTransformer()
    assert stage.getOutputCol() == DEFAULT_OUTPUT_COL
    assert stage.getErrorCol() is None and stage.getModel() is None
    assert not stage.isDefined(stage.inputCol)
    assert stage.getOptions() == {}
    assert stage.getMaxTokens() == 64 and stage.getTemperature() == 0.0  # the fields' defaults
    assert stage.getOption("value") is True and stage.getTemplate() is None

    stage.setInputCol("p").setOutputCol("o").setErrorCol("e").setModel(Path("/models/x"))
    stage.setOptions({"stop": ("a", "b"), "json_schema": {"type": "object", "properties": {}}})
    stage.setMaxTokens(8).setTemperature(0.5).setOption("backend", "native")
    assert (stage.getInputCol(), stage.getOutputCol(), stage.getErrorCol()) == ("p", "o", "e")
    assert stage.getModel() == "/models/x"
    assert stage.getOptions() == {
        "stop": ["a", "b"],  # JSON values: tuples become lists
        "json_schema": {"type": "object", "properties": {}},
        "max_tokens": 8,
        "temperature": 0.5,
        "backend": "native",
    }
    assert json.loads(stage.getOrDefault(stage.options)) == stage.getOptions()  # a JSON Param
    stage.setOption("backend", None).setErrorCol(None)
    assert "backend" not in stage.getOptions() and stage.getErrorCol() is None

    # keyword shortcuts land in options, after options itself
    both = LLMTransformer(options={"max_tokens": 4, "seed": 3}, maxTokens=9, template="{t}")
    assert both.getOptions() == {"max_tokens": 9, "seed": 3, "template": "{t}"}
    both.setParams(temperature=0.7)
    assert both.getOptions() == {"max_tokens": 9, "seed": 3, "template": "{t}", "temperature": 0.7}

    copied = both.copy({both.options: {"max_tokens": 2}})
    assert copied.getOptions() == {"max_tokens": 2} and both.getMaxTokens() == 9
    assert check_options('{"chat": false}') == {"chat": False}
    assert "max_tokens, temperature" in stage.explainParam(stage.options)


def test_transform_errors_name_the_problem(spark, model_dir):
    frame = make_frame(spark).withColumn("prompt", F.col("review"))
    with pytest.raises(ValueError, match="model is not set"):
        LLMTransformer(inputCol="prompt").transform(frame)
    with pytest.raises(
        ValueError, match=r"inputCol 'promt' is not a column .*: id, review, prompt"
    ):
        LLMTransformer(inputCol="promt", model=model_dir).transform(frame)
    with pytest.raises(ValueError, match="outputCol='review' is a column of the dataset"):
        LLMTransformer(inputCol="prompt", outputCol="review", model=model_dir).transform(frame)
    with pytest.raises(ValueError, match="errorCol='id' is a column of the dataset"):
        LLMTransformer(inputCol="prompt", errorCol="id", model=model_dir).transform(frame)
    with pytest.raises(ValueError, match="col or a template/columns, not both"):
        stage = LLMTransformer(inputCol="prompt", model=model_dir, template="{review}")
        stage.transform(frame)
    with pytest.raises(TypeError, match="col must hold prompts .* type int"):  # no job
        LLMTransformer(inputCol="id", model=model_dir).transform(frame)


# -- results --------------------------------------------------------------------------
def test_transform_gives_llm_infer_and_generate_results(classic_rows, model_dir):
    _, rows = classic_rows
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        assert set(row["out"]) == set(FIELDS)
        assert row["out"] == row["direct"], row["id"]  # the transformer is llm_infer
    good, bad = rows[:4], rows[4]
    assert bad["prompt"] is None and bad["out"]["finish_reason"] == "error"
    assert bad["err"] == bad["out"]["error"] and "null" in bad["err"]
    assert all(r["err"] is None and r["out"]["error"] is None for r in good)

    operator = LLMOperator(model_dir)
    expected = operator.generate(
        chat_wrapped([r["prompt"] for r in good]),
        SamplingParams(max_tokens=MAX_TOKENS, stop=("\n\n",)),
    )
    for row, result in zip(good, expected):
        assert row["out"]["text"] == result.text, row["id"]
        assert row["out"]["finish_reason"] == result.finish_reason
        assert row["out"]["completion_tokens"] == result.completion_tokens


def test_template_option_needs_no_input_col(spark, model_dir):
    """With ``template``, the prompt renders from the row's columns: no inputCol (the
    rendering itself is llm_infer's, tested in test_spark; no job runs here)."""
    frame = make_frame(spark)
    stage = LLMTransformer(model=model_dir, template="Review: {review}", maxTokens=MAX_TOKENS)
    out = stage.transform(frame).schema[DEFAULT_OUTPUT_COL].dataType
    assert (
        out
        == llm_infer_df(frame, template="Review: {review}", model=model_dir).schema["out"].dataType
    )
    assert out.fieldNames() == FIELDS
    with pytest.raises(ValueError, match="lacks|review2|not a column"):
        LLMTransformer(model=model_dir, template="{review2}").transform(frame)


# -- persistence ----------------------------------------------------------------------
def same_params(loaded: LLMTransformer, stage: LLMTransformer) -> None:
    assert type(loaded) is LLMTransformer and loaded.uid == stage.uid
    assert loaded.getOptions() == stage.getOptions()
    assert list(loaded.getOptions()) == list(stage.getOptions())  # the options' order too
    for name in ("getInputCol", "getOutputCol", "getErrorCol", "getModel"):
        assert getattr(loaded, name)() == getattr(stage, name)(), name


def test_pipeline_model_save_load_in_a_new_session(spark, classic_rows, tmp_path):
    model, rows = classic_rows
    path = str(tmp_path / "pipeline-model")
    model.save(path)
    other = spark.newSession()
    loaded = PipelineModel.read().session(other).load(path)
    assert [type(s).__name__ for s in loaded.stages] == ["SQLTransformer", "LLMTransformer"]
    same_params(loaded.stages[1], model.stages[1])
    again = by_id(loaded.transform(make_frame(other)).collect(), "prompt", "out", "err")
    assert_same_results(again, [{k: r[k] for k in ("id", "prompt", "out", "err")} for r in rows])


def test_pipeline_and_stage_save_load(model_dir, tmp_path, spark):
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    stage = make_stage(model_dir).setOptions({"json_schema": schema, "max_tokens": 12})
    stage.save(str(tmp_path / "stage"))
    stage.write().overwrite().save(str(tmp_path / "stage"))  # LLMTransformerWriter's overwrite
    loaded = LLMTransformer.load(str(tmp_path / "stage"))
    same_params(loaded, stage)
    assert list(loaded.getOption("json_schema")["properties"]) == ["z", "a"]  # not sorted
    assert loaded.explainParams() == stage.explainParams()

    pipeline = Pipeline(stages=[SQLTransformer(statement=STATEMENT), stage])
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
    stages = Pipeline.load(str(tmp_path / "pipeline")).getStages()
    same_params(stages[1], stage)
    assert stages[0].getStatement() == STATEMENT

    # a key is never written in plain text: saving refuses it, alone or in a pipeline
    keyed = make_stage(model_dir).setOptions({"backend": "openai", "api_key": "sk-secret"})
    for saved in (keyed, Pipeline(stages=[SQLTransformer(statement=STATEMENT), keyed])):
        with pytest.raises(ValueError, match="api_key"):
            saved.write().overwrite().save(str(tmp_path / "keyed"))
    written = [
        p.read_text(errors="replace") for p in (tmp_path / "keyed").rglob("*") if p.is_file()
    ]
    assert not any("sk-secret" in text for text in written)


# -- Spark Connect --------------------------------------------------------------------
@pytest.fixture(scope="module")
def remote(connect_url):
    """A Spark Connect session on the suite's local Connect server (conftest)."""
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    with connect_mode():
        session = RemoteSparkSession.builder.remote(connect_url).create()
    yield session
    with connect_mode():
        session.stop()


def test_spark_connect_transform_save_and_load(spark, remote, classic_rows, model_dir, tmp_path):
    """On Connect: a PipelineModel saved on classic Spark loads and gives classic's rows;
    the stage alone, a PipelineModel and a Pipeline save (overwrite too) and load there,
    and what Connect saved loads on classic Spark (and gives classic's rows)."""
    model, rows = classic_rows
    want = [{k: r[k] for k in ("id", "prompt", "out", "err")} for r in rows]
    classic_path = str(tmp_path / "classic-model")
    model.save(classic_path)
    stage_path, connect_path = str(tmp_path / "stage"), str(tmp_path / "connect-model")
    with connect_mode():
        loaded = PipelineModel.load(classic_path)
        same_params(loaded.stages[1], model.stages[1])
        got = by_id(loaded.transform(make_frame(remote)).collect(), "prompt", "out", "err")
        assert_same_results(got, want)

        stage = model.stages[1]
        stage.save(stage_path)
        stage.write().overwrite().save(stage_path)  # PySpark's own overwrite needs the JVM
        same_params(LLMTransformer.load(stage_path), stage)
        fitted = make_pipeline(model_dir).fit(make_frame(remote))
        fitted.write().overwrite().save(connect_path)
        reloaded = PipelineModel.load(connect_path)
        same_params(reloaded.stages[1], fitted.stages[1])
        pipeline = make_pipeline(model_dir)
        pipeline.write().overwrite().save(str(tmp_path / "pipeline"))
        same_params(
            Pipeline.load(str(tmp_path / "pipeline")).getStages()[1], pipeline.getStages()[1]
        )
    same_params(LLMTransformer.load(stage_path), stage)  # Connect's files, read on classic
    back = PipelineModel.load(connect_path)
    assert_same_results(
        by_id(back.transform(make_frame(spark)).collect(), "prompt", "out", "err"), want
    )
