"""Property-based tests of Spark and Dask ``llm_infer`` on generated frames: nulls, empty
strings, empty partitions, one row, many partitions, skewed groups, with and without
``co_locate``. Every row comes back once, by its id, answered as the operator answers it
alone (greedy)."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from helpers import chat_wrapped
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_operator import LLMOperator, SamplingParams

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
SETTINGS = settings(
    max_examples=200 if LONG else 6, deadline=None, suppress_health_check=list(HealthCheck)
)
MAX_TOKENS = 3
SHARED = "You label product reviews as positive or negative. Review: "
PROMPT = st.one_of(
    st.sampled_from(["great", "bad", "fine", "broken", "ok"]).map(lambda w: SHARED + w),  # skew
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.none(),
    st.just(""),
)
FRAMES = st.tuples(st.lists(PROMPT, min_size=1, max_size=20), st.integers(1, 6), st.booleans())


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """Each prompt's result when the operator runs it alone (cached by prompt)."""
    operator = LLMOperator(tiny_llama_dir, backend="native")
    cache: dict = {}

    def answer(prompt):
        if prompt not in cache:
            params = SamplingParams(max_tokens=MAX_TOKENS)
            (cache[prompt],) = operator.generate(chat_wrapped([prompt]), params)
        return cache[prompt]

    return answer


def _check(ids, prompts, texts, reasons, errors, expected) -> None:
    assert sorted(ids) == list(range(len(prompts))), "every row once"
    for row, text, reason, error in zip(ids, texts, reasons, errors):
        alone = expected(prompts[row])
        assert reason == alone.finish_reason, (prompts[row], reason, alone)
        if reason == "error":
            assert error, prompts[row]
        else:
            assert text == alone.text, (prompts[row], text, alone.text)


@SETTINGS
@given(frame=FRAMES)
def test_dask_llm_infer_on_generated_frames(tiny_llama_dir, expected, frame) -> None:
    import dask
    import dask.dataframe as dd

    from llm_operator.integrations.dask import co_locate, llm_infer

    prompts, partitions, colocate = frame
    data = pd.DataFrame({"id": range(len(prompts)), "prompt": pd.Series(prompts, dtype=object)})
    with dask.config.set({"scheduler": "threads", "dataframe.convert-string": False}):
        ddf = dd.from_pandas(data, npartitions=min(partitions, len(prompts)))
        if colocate:
            ddf = co_locate(ddf, "prompt", partitions)
        out = llm_infer(ddf, "prompt", model=str(tiny_llama_dir), max_tokens=MAX_TOKENS)
        result = out.compute()
    _check(
        result["id"].tolist(),
        prompts,
        result["out"].tolist(),
        result["out_finish_reason"].tolist(),
        result["out_error"].tolist(),
        expected,
    )


@SETTINGS
@given(frame=FRAMES)
def test_spark_llm_infer_on_generated_frames(spark, tiny_llama_dir, expected, frame) -> None:
    from pyspark.sql import types as T

    from llm_operator.integrations.spark import co_locate, llm_infer

    prompts, partitions, colocate = frame
    schema = T.StructType(
        [T.StructField("id", T.LongType()), T.StructField("prompt", T.StringType())]
    )
    df = spark.createDataFrame(list(enumerate(prompts)), schema).repartition(partitions)
    if colocate:
        df = co_locate(df, "prompt", partitions)
    out = df.select(
        "id", llm_infer("prompt", model=str(tiny_llama_dir), max_tokens=MAX_TOKENS).alias("o")
    ).collect()
    _check(
        [r["id"] for r in out],
        prompts,
        [r["o"]["text"] for r in out],
        [r["o"]["finish_reason"] for r in out],
        [r["o"]["error"] for r in out],
        expected,
    )
