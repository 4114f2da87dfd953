"""Embeddings on Spark and Dask frames: ``llm_embed`` gives each row the vector
``LLMOperator.embed`` gives it (bit for bit: the CPU default is batch-invariant), bad rows
get an error and no vector while the others complete, the pooling options pass through,
and rows that share a prefix are co-located (prefill summed from the ``stats_log``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llm_operator import LLMOperator

GROUPS, PER_GROUP, PARTITIONS = 4, 6, 4
TOPICS = ("battery", "shipping", "refund", "login")


def _grouped_prompts() -> list[str]:
    """GROUPS x PER_GROUP chunks, shuffled: each group a document of its own, then a chunk."""
    prompts = [
        f"Document {g}: the {topic} policy. Customers write about the {topic} when it "
        f"fails; support answers within a day and keeps a note of the {topic} case. "
        f"Chunk {r}: the {topic} case {r}."
        for g, topic in enumerate(TOPICS[:GROUPS])
        for r in range(PER_GROUP)
    ]
    random.Random(3).shuffle(prompts)
    return prompts


ROWS = ["Instruct: find the policy\nQuery: refunds?", None, "", "Instruct: find the policy\nQuery: shipping?", "word " * 400]  # fmt: skip
GOOD = [True, False, False, True, False]


def _logged_prefill(log: Path) -> int:
    return sum(json.loads(line)["prefill_tokens"] for line in log.read_text().splitlines())


@pytest.fixture(scope="module")
def local(tiny_llama_dir):
    """The operator the frames are checked against, and one plan's prefill over the
    grouped rows."""
    op = LLMOperator(tiny_llama_dir)
    op.embed(_grouped_prompts())
    return op, op.last_stats.prefill_tokens_computed


def _expected(op: LLMOperator, prompts, **options) -> dict:
    return {p: r.embedding for p, r in zip(prompts, op.embed(prompts, **options))}


# -- Dask --------------------------------------------------------------------------------


def _dask_frame(prompts, partitions=PARTITIONS):
    import dask.dataframe as dd
    import pandas as pd

    frame = pd.DataFrame({"text": pd.Series(prompts, dtype=object), "n": range(len(prompts))})
    frame.index = pd.Index([500 + i for i in range(len(prompts))], name="row_id")
    return dd.from_pandas(frame, npartitions=partitions)


@pytest.mark.parametrize("co_locate", [True, False])
def test_dask_vectors_equal_the_operator_and_rows_share(
    tiny_llama_dir, local, tmp_path, co_locate, caplog
):
    import dask
    import pyarrow as pa

    from llm_operator.integrations.dask import llm_embed

    op, prefill = local
    prompts = _grouped_prompts()
    ddf = _dask_frame(prompts)
    log = tmp_path / "partitions.jsonl"
    with dask.config.set(scheduler="synchronous"), caplog.at_level("INFO"):
        out = llm_embed(ddf, "text", model=tiny_llama_dir, co_locate=co_locate, stats_log=str(log))
        assert out.npartitions == PARTITIONS and out.divisions == ddf.divisions
        result = out.compute()
    expected = ddf.compute()
    assert result.index.tolist() == expected.index.tolist()  # index and order kept
    assert result["n"].tolist() == expected["n"].tolist()
    width = op.model_config.hidden_size
    assert result["embedding"].dtype.pyarrow_dtype == pa.list_(pa.float32(), width)
    vectors = _expected(op, prompts)
    for prompt, vector in zip(result["text"], result["embedding"]):
        assert [float(v) for v in vector] == vectors[prompt]
    assert result["embedding_error"].isna().all()
    assert (result["embedding_prompt_tokens"] > 20).all()
    computed = _logged_prefill(log)
    decided = [r.getMessage() for r in caplog.records if "co-location: about" in r.getMessage()]
    if co_locate:
        assert computed <= 1.15 * prefill, (computed, prefill)
        assert len(decided) == 1 and decided[0].startswith("llm_embed co-location")
    else:
        assert computed > 1.5 * prefill  # the shuffled partitions, each planned alone
        assert not decided


def test_dask_bad_rows_and_options_pass_through(tiny_llama_dir, tiny_qwen3_dir, local):
    import dask
    import pyarrow as pa

    from llm_operator.integrations.dask import llm_embed

    ddf = _dask_frame(ROWS, partitions=2)
    with dask.config.set(scheduler="synchronous"):
        out = llm_embed(
            ddf, "text", output="vec", model=tiny_qwen3_dir, pooling="mean", dimensions=16,
            normalize=False,
        ).compute()  # fmt: skip
    assert out["vec"].dtype.pyarrow_dtype == pa.list_(pa.float32(), 16)
    assert out["vec"].notna().tolist() == GOOD
    assert out["vec_error"].isna().tolist() == GOOD
    errors = out["vec_error"].tolist()
    assert "null" in errors[1] and "empty" in errors[2] and "context" in errors[4]
    reference = LLMOperator(tiny_qwen3_dir).embed(
        ROWS, pooling="mean", dimensions=16, normalize=False
    )
    for got, want in zip(out["vec"], reference):
        if want.embedding is not None:
            assert [float(v) for v in got] == want.embedding
    assert out["vec_prompt_tokens"].tolist() == [r.prompt_tokens for r in reference]


def test_dask_bad_options_are_refused_before_any_work(tiny_llama_dir):
    from llm_operator.integrations.dask import llm_embed

    ddf = _dask_frame(["a", "b"], partitions=1)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        llm_embed(ddf, "text", model=tiny_llama_dir, pooling="max")
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        llm_embed(ddf, "text", model=tiny_llama_dir, dimensions=0)
    with pytest.raises(ValueError, match="dimensions=4096 is more than the model's"):
        llm_embed(ddf, "text", model=tiny_llama_dir, dimensions=4096)
    with pytest.raises(TypeError, match="unknown option 'max_tokens'"):
        llm_embed(ddf, "text", model=tiny_llama_dir, max_tokens=4)
    with pytest.raises(TypeError, match="did you mean 'max_batch_size'"):
        llm_embed(ddf, "text", model=tiny_llama_dir, max_batch_sise=4)
    with pytest.raises(ValueError, match="overwrite"):
        llm_embed(ddf, "text", output="n", model=tiny_llama_dir)


# -- Spark -------------------------------------------------------------------------------


def _spark_frame(spark, prompts):
    rows = [(i, p) for i, p in enumerate(prompts)]
    return spark.createDataFrame(rows, "id long, text string").repartition(PARTITIONS)


@pytest.mark.parametrize("co_locate", [True, False])
def test_spark_vectors_equal_the_operator_and_rows_share(
    spark, tiny_llama_dir, local, tmp_path, co_locate
):
    from llm_operator.integrations.spark import llm_embed_df

    op, prefill = local
    prompts = _grouped_prompts()
    log = tmp_path / "partitions.jsonl"
    out = llm_embed_df(
        _spark_frame(spark, prompts), "text", model=tiny_llama_dir, co_locate=co_locate,
        stats_log=str(log),
    )  # fmt: skip
    assert out.schema["embedding"].dataType.simpleString() == (
        "struct<embedding:array<float>,prompt_tokens:int,error:string>"
    )
    rows = out.select("text", "embedding.*").collect()
    vectors = _expected(op, prompts)
    assert sorted(r["text"] for r in rows) == sorted(prompts)
    for row in rows:
        assert row["error"] is None and row["embedding"] == vectors[row["text"]]
    computed = _logged_prefill(log)
    if co_locate:
        assert computed <= 1.15 * prefill, (computed, prefill)
    else:
        assert computed > 1.5 * prefill


def test_spark_bad_rows_and_options_pass_through(spark, tiny_llama_dir):
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark import llm_embed

    df = spark.createDataFrame(list(enumerate(ROWS)), "id long, text string").repartition(2)
    column = llm_embed("text", model=tiny_llama_dir, pooling="cls", dimensions=8, normalize=False)
    rows = sorted(df.withColumn("e", column).select("id", "e.*").collect(), key=lambda r: r.id)
    assert [r["embedding"] is not None for r in rows] == GOOD
    assert [r["error"] is None for r in rows] == GOOD
    assert "null" in rows[1]["error"] and "context" in rows[4]["error"]
    reference = LLMOperator(tiny_llama_dir).embed(
        ROWS, pooling="cls", dimensions=8, normalize=False
    )
    assert [r["embedding"] for r in rows] == [r.embedding for r in reference]
    assert [r["prompt_tokens"] for r in rows] == [r.prompt_tokens for r in reference]
    # an expression column too, with the vectors normalized
    unit = df.select(llm_embed(F.concat(F.lit("Query: "), "text"), model=tiny_llama_dir).alias("e"))
    norms = [sum(v * v for v in r.e.embedding) for r in unit.collect() if r.e.embedding]
    assert norms and all(abs(n - 1) < 1e-5 for n in norms)


def test_spark_bad_options_are_refused_on_the_driver(spark, tiny_llama_dir):
    from llm_operator.integrations.spark import llm_embed, llm_embed_df

    df = spark.createDataFrame([(1, "a")], "id long, text string")
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        llm_embed("text", model=tiny_llama_dir, pooling="max")
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        llm_embed_df(df, "text", model=tiny_llama_dir, dimensions=0)
    with pytest.raises(TypeError, match="unknown option 'temperature'"):
        llm_embed_df(df, "text", model=tiny_llama_dir, temperature=0.5)
    with pytest.raises(TypeError, match="prompt"):
        llm_embed_df(df, "id", model=tiny_llama_dir)
    with pytest.raises(ValueError, match="already"):
        llm_embed_df(df, "text", output="id", model=tiny_llama_dir)
