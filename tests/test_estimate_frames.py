"""Spark's and Dask's ``llm_estimate``: a DataFrame job predicted partition by partition
equals ``LLMOperator.estimate`` on the same rendered prompts where it must (rows, error
rows, prompt tokens; exact output tokens with ``ignore_eos``), follows the partitioning
where it should (prefill), and packs partitions onto executors. The calibration cache is a
folder of this module (``LLM_OPERATOR_CACHE``), so the tiny model calibrates once."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from helpers import REVIEWS, chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.integrations import dask as llm_dask
from llm_operator.integrations.estimate_frames import (
    check_estimate_options,
    driver_inputs,
    makespan,
    predict_partition,
)
from llm_operator.integrations.infer_options import make_options
from llm_operator.integrations.worker import get_operator

MAX_TOKENS = 6
INSTRUCTIONS = (
    "Classify the sentiment as positive, negative or neutral. Review: ",
    "Summarize the review in one sentence. Review: ",
    "Extract the product name and the main complaint. Review: ",
    "Rate the urgency from 1 to 5 and explain briefly. Review: ",
)
# 24 distinct prompts, grouped by instruction (4 groups of 6 rows)
GROUPED = [instruction + review for instruction in INSTRUCTIONS for review in REVIEWS[:6]]
# the same rows dealt round-robin: cut into 4 contiguous partitions, each holds every group
SCATTERED = [GROUPED[(i % 4) * 6 + i // 4] for i in range(len(GROUPED))]
COUNTED = ("rows", "error_rows", "requests", "prompt_tokens", "prefill_tokens", "output_tokens")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("estimate-cache"))


@pytest.fixture(autouse=True)
def calibration_cache(cache_folder, monkeypatch):
    monkeypatch.setenv("LLM_OPERATOR_CACHE", cache_folder)
    with dask.config.set(scheduler="sync"):
        yield


def dask_frame(prompts, npartitions: int = 4) -> dd.DataFrame:
    frame = pd.DataFrame({"prompt": pd.Series(prompts, dtype=object), "row": range(len(prompts))})
    return dd.from_pandas(frame, npartitions=npartitions, sort=True)


def spark_frame(spark, prompts, partitions: int = 4):
    rows = [(i, p) for i, p in enumerate(prompts)]
    return spark.createDataFrame(
        spark.sparkContext.parallelize(rows, partitions), "id int, prompt string"
    )


def counts(estimate) -> dict:
    return {name: getattr(estimate, name) for name in COUNTED}


# -- options --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"sample_rows": -1}, "sample_rows"),
        ({"sample_rows": "all"}, "sample_rows"),
        ({"sample_rows": True}, "sample_rows"),
        ({"executors": 0}, "executors"),
        ({"executors": 2.0}, "executors"),
    ],
)
def test_bad_options_raise_naming_them(model_dir, given, named):
    frame = dask_frame(GROUPED[:4], 2)
    with pytest.raises(ValueError, match=named):
        llm_dask.llm_estimate(frame, "prompt", model=model_dir, **given)
    with pytest.raises(ValueError, match=named):
        check_estimate_options(**{"sample_rows": "auto", "executors": 1, "seed": 0, **given})


def test_bad_prompt_options_raise_before_anything_runs(model_dir):
    frame = dask_frame(GROUPED[:4], 2)
    with pytest.raises(ValueError, match="max_tokens"):
        llm_dask.llm_estimate(frame, "prompt", model=model_dir, max_tokens=0)
    with pytest.raises(ValueError, match="not a column"):
        llm_dask.llm_estimate(frame, "nope", model=model_dir)
    with pytest.raises(ValueError, match="not a column"):
        llm_dask.llm_estimate(frame, "prompt", model=model_dir, choices_col="nope")


def test_makespan_packs_longest_first():
    assert makespan([], 3) == 0.0
    assert makespan([5.0, 1.0, 1.0, 1.0], 1) == 8.0
    assert makespan([5.0, 4.0, 3.0, 3.0], 2) == 8.0  # 5+3 and 4+3
    assert makespan([2.0, 1.0], 8) == 2.0  # never below the longest partition


# -- Dask ---------------------------------------------------------------------------------
def test_dask_equals_the_operator_estimate_on_the_same_prompts(model_dir):
    prompts = [*SCATTERED[:11], None, *SCATTERED[11:]]  # a null prompt: an error row
    got = llm_dask.llm_estimate(
        dask_frame(prompts), "prompt", model=model_dir, max_tokens=MAX_TOKENS
    )
    want = LLMOperator(model_dir).estimate(
        chat_wrapped(prompts), SamplingParams(max_tokens=MAX_TOKENS)
    )
    assert got.rows == want.rows == 25
    assert got.error_rows == want.error_rows == 1
    assert got.requests == want.requests == 24
    assert got.prompt_tokens == want.prompt_tokens
    # four partitions, each planned alone, compute every instruction up to four times
    assert got.prefill_tokens > want.prefill_tokens
    assert 0 < got.output_tokens <= 24 * MAX_TOKENS
    assert got.backend == want.backend and got.device == want.device
    assert 0 < got.sample_rows <= 24
    assert got.seconds > got.prepare_seconds > 0
    assert got.low_seconds <= got.seconds <= got.high_seconds
    assert got.executors == 1 and got.executor_seconds == pytest.approx(got.seconds)
    assert got.machine_hours * 3600 == pytest.approx(got.seconds)
    assert want.calibration["cached"]  # read from the folder the frame estimate wrote
    assert want.calibration["path"] == got.calibration["path"]
    assert any("4 Dask partitions" in a for a in got.assumptions)
    assert any("sampled rows" in a for a in got.assumptions)
    report = got.report()
    assert "25" in report and "assumes:" in report
    assert got.as_dict()["rows"] == 25


def test_dask_ignore_eos_predicts_max_tokens_exactly_without_a_sample(model_dir):
    got = llm_dask.llm_estimate(
        dask_frame(GROUPED), "prompt", model=model_dir, max_tokens=5, ignore_eos=True
    )
    assert got.output_tokens == len(GROUPED) * 5
    assert got.sample_rows == 0  # every length is known: nothing to generate
    assert not any("sampled rows" in a for a in got.assumptions)


def test_dask_prefill_follows_the_partitioning(model_dir):
    # unaligned segments (deterministic=False): the chat template's short opening is shared
    options = {"model": model_dir, "max_tokens": 3, "ignore_eos": True, "deterministic": False}
    grouped = llm_dask.llm_estimate(dask_frame(GROUPED), "prompt", **options)
    scattered = llm_dask.llm_estimate(dask_frame(SCATTERED), "prompt", **options)
    one = llm_dask.llm_estimate(dask_frame(SCATTERED, 1), "prompt", **options)
    assert grouped.prompt_tokens == scattered.prompt_tokens == one.prompt_tokens
    assert grouped.output_tokens == scattered.output_tokens == len(GROUPED) * 3
    # one partition computes each shared prefix once; a group per partition computes each
    # instruction once too (only the chat template's opening once per partition); every
    # group in every partition computes each instruction four times
    assert one.prefill_tokens < grouped.prefill_tokens < scattered.prefill_tokens
    grouped_extra = grouped.prefill_tokens - one.prefill_tokens
    assert scattered.prefill_tokens - one.prefill_tokens > 4 * grouped_extra


def test_dask_executors_pack_the_partitions(model_dir):
    options = {"model": model_dir, "max_tokens": 4, "ignore_eos": True}
    one = llm_dask.llm_estimate(dask_frame(GROUPED), "prompt", **options)
    two = llm_dask.llm_estimate(dask_frame(GROUPED), "prompt", executors=2, **options)
    assert two.executors == 2
    assert two.seconds / 2 <= two.executor_seconds <= two.seconds
    assert two.machine_hours * 3600 >= two.executor_seconds
    assert two.machine_hours * 3600 == pytest.approx(two.seconds)
    assert counts(two) == counts(one)
    assert "on 2 executors" in two.report()


def test_dask_template_and_constraint_column(model_dir):
    frame = pd.DataFrame(
        {
            "instruction": [INSTRUCTIONS[i % 2] for i in range(8)],
            "review": list(REVIEWS[:8]),
            "labels": ["yes,no", '["a", "b"]', None, "[", "yes,no", "x,y", "yes,no", "p,q"],
        }
    )
    ddf = dd.from_pandas(frame, npartitions=2, sort=True)
    got = llm_dask.llm_estimate(
        ddf,
        template="{instruction}{review}",
        choices_col="labels",
        model=model_dir,
        max_tokens=4,
        sample_rows=3,
    )
    rendered = (frame["instruction"] + frame["review"]).tolist()
    rendered[3] = None  # the row whose labels are no valid constraint
    want = LLMOperator(model_dir).estimate(
        chat_wrapped(rendered), SamplingParams(max_tokens=4), sample_rows=0
    )
    assert got.rows == want.rows == 8
    assert got.error_rows == want.error_rows == 1  # "[" is no JSON list: the row fails
    assert got.prompt_tokens == want.prompt_tokens
    assert 0 < got.sample_rows <= 3
    assert any("constrained rows" in a for a in got.assumptions)


def test_dask_dedupe_counts_every_row(model_dir):
    prompts = [GROUPED[0], GROUPED[0], GROUPED[1], "", "", None, GROUPED[1], GROUPED[2]]
    options = {"model": model_dir, "max_tokens": 3, "ignore_eos": True, "temperature": 0.7}
    kept = llm_dask.llm_estimate(dask_frame(prompts, 1), "prompt", **options)
    deduped = llm_dask.llm_estimate(dask_frame(prompts, 1), "prompt", dedupe=True, **options)
    assert kept.rows == deduped.rows == 8
    assert kept.error_rows == deduped.error_rows == 3  # two empty prompts and a null
    assert kept.requests == 5  # sampled rows are never merged
    assert deduped.requests == 3  # each distinct prompt computed once
    assert deduped.output_tokens == 3 * 3 < kept.output_tokens == 5 * 3


def test_a_worker_never_loads_the_model(model_dir):
    driver = make_options(model=model_dir, max_tokens=4)
    inputs, sample, _ = driver_inputs(GROUPED[:4], driver)
    assert sample["rows"] == 4
    worker = make_options(model=model_dir, max_tokens=4, max_batch_size=7)  # its own operator
    predicted = predict_partition([*GROUPED[:6], None], worker, inputs, partition=3)
    assert predicted["partition"] == 3
    assert predicted["rows"] == 7 and predicted["error_rows"] == 1
    assert predicted["requests"] == 6 and predicted["seconds"] > 0
    assert get_operator(worker)._backend is None
    empty = predict_partition([], worker, inputs, partition=5)
    assert empty["rows"] == 0 and empty["seconds"] == 0.0 and empty["partition"] == 5


# -- Spark --------------------------------------------------------------------------------
def test_spark_equals_the_operator_estimate_and_dask(spark, model_dir):
    from llm_operator.integrations.spark import llm_estimate

    prompts = [*SCATTERED[:11], None, *SCATTERED[11:]]
    got = llm_estimate(
        spark_frame(spark, prompts), "prompt", model=model_dir, max_tokens=MAX_TOKENS
    )
    want = LLMOperator(model_dir).estimate(
        chat_wrapped(prompts), SamplingParams(max_tokens=MAX_TOKENS)
    )
    assert got.rows == want.rows == 25
    assert got.error_rows == want.error_rows == 1
    assert got.requests == want.requests
    assert got.prompt_tokens == want.prompt_tokens
    assert got.prefill_tokens > want.prefill_tokens
    assert 0 < got.sample_rows <= 24
    assert any("4 Spark partitions" in a for a in got.assumptions)
    # the same partitions on Dask (contiguous rows, as parallelize cuts them) and EOS
    # ignored: the same prediction, token for token
    options = {"model": model_dir, "max_tokens": 5, "ignore_eos": True, "executors": 2}
    on_spark = llm_estimate(spark_frame(spark, SCATTERED), "prompt", **options)
    on_dask = llm_dask.llm_estimate(dask_frame(SCATTERED), "prompt", **options)
    assert counts(on_spark) == counts(on_dask)
    assert on_spark.output_tokens == len(SCATTERED) * 5
    assert on_spark.iterations == on_dask.iterations
    assert on_spark.seconds / 2 <= on_spark.executor_seconds <= on_spark.seconds
    assert on_spark.machine_hours * 3600 >= on_spark.executor_seconds


def test_spark_template_options_and_bad_options(spark, model_dir):
    from llm_operator.integrations.spark import llm_estimate

    df = spark_frame(spark, GROUPED, 2)
    by_column = llm_estimate(df, "prompt", model=model_dir, max_tokens=3, sample_rows=2)
    by_template = llm_estimate(
        df, template="{prompt}", model=model_dir, max_tokens=3, sample_rows=0
    )
    assert by_template.prompt_tokens == by_column.prompt_tokens
    assert by_template.requests == by_column.requests == len(GROUPED)
    assert by_template.sample_rows == 0 and 0 < by_column.sample_rows <= 2
    assert any("every row runs to its max_tokens" in a for a in by_template.assumptions)
    assert by_template.output_tokens == len(GROUPED) * 3  # the upper bound, with no sample
    with pytest.raises(ValueError, match="executors"):
        llm_estimate(df, "prompt", model=model_dir, executors=0)
    with pytest.raises(ValueError, match="sample_rows"):
        llm_estimate(df, "prompt", model=model_dir, sample_rows=-1)
    with pytest.raises(TypeError, match="col must hold prompts"):
        llm_estimate(df, "id", model=model_dir)
    with pytest.raises(ValueError, match="not both"):
        llm_estimate(df, "prompt", template="{prompt}", model=model_dir)
