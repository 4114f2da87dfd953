"""Co-location by default: every entry point that sees the whole frame moves the rows that
share a prompt prefix into one partition first (unless a sample shows it cannot help), so
a shuffled frame prefills about what one plan over all its rows computes, with the same
rows as a one-partition run. ``co_locate=False`` keeps the frame's partitions.

The frame: 64 rows in 8 groups, each group a long shared instruction and a short row of
its own, shuffled over 4 partitions. Prefill is summed from the partitions' statistics
log (the ``stats_log`` option).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from helpers import chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.integrations.co_location import plan_co_location

GROUPS, PER_GROUP, PARTITIONS, MAX_TOKENS = 8, 8, 4, 3
TOPICS = ("battery", "shipping", "refund", "login", "screen", "printer", "tent", "blender")


def _frame_prompts() -> list[str]:
    """GROUPS x PER_GROUP prompts, shuffled: each group a long instruction of its own."""
    prompts = [
        f"Task {g}: read the customer's message about the {topic} and answer with one "
        f"word that names the problem, the mood and the urgency of the {topic} issue. "
        f"Examples of {topic} messages: the {topic} stopped working after a week; the "
        f"{topic} arrived broken; the {topic} is fine but support never answered. "
        f"Message {r}: the {topic} broke on day {r}."
        for g, topic in enumerate(TOPICS[:GROUPS])
        for r in range(PER_GROUP)
    ]
    random.Random(7).shuffle(prompts)
    return prompts


def _logged_prefill(log: Path) -> int:
    return sum(json.loads(line)["prefill_tokens"] for line in log.read_text().splitlines())


@pytest.fixture(scope="module")
def one_plan(tiny_llama_dir):
    """The rows and prefill of one plan over all the frame's rows (one partition)."""
    prompts = _frame_prompts()
    op = LLMOperator(tiny_llama_dir)
    results = op.generate(chat_wrapped(prompts), SamplingParams(max_tokens=MAX_TOKENS))
    texts = {p: r.text for p, r in zip(prompts, results)}
    return texts, op.last_stats.prefill_tokens_computed


# -- the decision ------------------------------------------------------------------------


def _placed(prompts: list[str], partitions: int) -> list[tuple[str, int]]:
    return [(p, i % partitions) for i, p in enumerate(prompts)]


def test_shuffled_groups_are_co_located_and_reported():
    decision = plan_co_location(_placed(_frame_prompts(), 4), 4, rows=6400)
    assert decision.skipped is None
    assert decision.saving > decision.saving_as_is + 0.1
    assert 0.5 < decision.moved < 1.0
    report = decision.report()
    assert report.startswith("co-location: about ") and "rows (" in report
    assert "one plan over the frame shares" in report and "4 partitions as they came" in report
    assert "a sample of 64 of 6,400 rows" in report


def test_it_is_skipped_where_it_cannot_help():
    prompts = sorted(_frame_prompts())  # each group whole in one partition already
    grouped = [(p, i // (2 * PER_GROUP)) for i, p in enumerate(prompts)]
    decision = plan_co_location(grouped, 4)
    assert decision.skipped == "the frame's partitions already keep its shared prefixes together"
    assert decision.report().startswith("co-location skipped (the frame's partitions")
    unrelated = [(f"{i} {TOPICS[i % 8]} row {i * 7919}", i % 4) for i in range(64)]
    assert plan_co_location(unrelated, 4).skipped == "the prompts share no prefixes"
    assert plan_co_location([("one prompt", 0)], 2).skipped is not None
    assert plan_co_location(grouped, 4, force=True).skipped is None  # dedupe, reorder_fields


def test_the_option_is_checked():
    from llm_operator.integrations.infer_options import make_options
    from llm_operator.prompts.options import PromptOptions

    assert PromptOptions().co_locate is True
    assert make_options(model="m", co_locate=False).co_locate is False
    with pytest.raises((TypeError, ValueError), match="co_locate"):
        make_options(model="m", co_locate="yes")


# -- Dask --------------------------------------------------------------------------------


def _dask_frame(prompts):
    import dask.dataframe as dd
    import pandas as pd

    frame = pd.DataFrame({"prompt": prompts, "n": range(len(prompts))})
    frame.index = pd.Index([1000 + i for i in range(len(prompts))], name="row_id")
    return dd.from_pandas(frame, npartitions=PARTITIONS)


@pytest.mark.parametrize("co_locate", [True, False])
def test_dask_llm_infer_shares_like_one_plan_and_keeps_the_frame(
    tiny_llama_dir, one_plan, tmp_path, co_locate, caplog
):
    import dask

    from llm_operator.integrations.dask import llm_infer

    texts, prefill = one_plan
    prompts = _frame_prompts()
    ddf = _dask_frame(prompts)
    log = tmp_path / "partitions.jsonl"
    with dask.config.set(scheduler="synchronous"), caplog.at_level("INFO"):
        out = llm_infer(
            ddf, "prompt", model=tiny_llama_dir, max_tokens=MAX_TOKENS, co_locate=co_locate,
            stats_log=str(log),
        )  # fmt: skip
        assert out.npartitions == PARTITIONS and out.divisions == ddf.divisions
        result = out.compute()
    expected = ddf.compute()
    assert result.index.tolist() == expected.index.tolist()  # index and order kept
    assert result.index.name == "row_id" and result["n"].tolist() == expected["n"].tolist()
    assert result["out"].tolist() == [texts[p] for p in expected["prompt"]]
    computed = _logged_prefill(log)
    if co_locate:
        assert computed <= 1.15 * prefill, (computed, prefill)
        decided = [r.getMessage() for r in caplog.records if "co-location: about" in r.getMessage()]
        assert len(decided) == 1 and re.search(r"of 64 rows, \d+\.\d\d s\)$", decided[0])
    else:
        assert computed > 1.5 * prefill  # the shuffled partitions, each planned alone
        assert not any("co-location" in r.getMessage() for r in caplog.records)


def test_dask_co_location_is_skipped_on_a_grouped_frame(tiny_llama_dir, tmp_path, caplog):
    import dask

    from llm_operator.integrations.dask import llm_infer

    ddf = _dask_frame(sorted(_frame_prompts()))  # sorted: each group in one partition
    with dask.config.set(scheduler="synchronous"), caplog.at_level("INFO"):
        llm_infer(ddf, "prompt", model=tiny_llama_dir, max_tokens=MAX_TOKENS).compute()
    messages = [r.getMessage() for r in caplog.records]
    assert any("co-location skipped (the frame's partitions already" in m for m in messages)


def test_dask_bad_prompt_column_for_co_location(tiny_llama_dir):
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations.dask import co_locate, llm_infer

    numbers = dd.from_pandas(pd.DataFrame({"prompt": [1, 2, 3, 4]}), npartitions=2)
    with pytest.raises(TypeError, match="must hold prompt strings"):
        llm_infer(numbers, "prompt", model=tiny_llama_dir)
    with pytest.raises(TypeError, match="must hold prompt strings"):
        co_locate(numbers, "prompt")
    with pytest.raises((TypeError, ValueError), match="co_locate"):
        llm_infer(_dask_frame(["a", "b"]), "prompt", model=tiny_llama_dir, co_locate=1)


# -- Spark -------------------------------------------------------------------------------


def _spark_frame(spark, prompts):
    rows = [(i, p) for i, p in enumerate(prompts)]
    return spark.createDataFrame(rows, "id long, prompt string").repartition(PARTITIONS)


@pytest.mark.parametrize("entry", ["llm_infer_df", "LLMTransformer"])
def test_spark_entry_points_share_like_one_plan(spark, tiny_llama_dir, one_plan, tmp_path, entry):
    from llm_operator.integrations.spark import llm_infer_df
    from llm_operator.integrations.spark_ml import LLMTransformer

    texts, prefill = one_plan
    df = _spark_frame(spark, _frame_prompts())
    log = tmp_path / "partitions.jsonl"
    options = {"max_tokens": MAX_TOKENS, "stats_log": str(log)}
    if entry == "llm_infer_df":
        out = llm_infer_df(df, "prompt", model=tiny_llama_dir, **options)
    else:
        stage = LLMTransformer(inputCol="prompt", outputCol="out", model=tiny_llama_dir)
        out = stage.setOptions(options).transform(df)
    rows = out.select("prompt", "out.text").collect()
    assert sorted((r["prompt"], r["text"]) for r in rows) == sorted(texts.items())
    computed = _logged_prefill(log)
    assert computed <= 1.15 * prefill, (computed, prefill)


def test_spark_co_locate_false_keeps_the_partitions(spark, tiny_llama_dir, one_plan, tmp_path):
    from llm_operator.integrations.spark import llm_infer_df

    texts, prefill = one_plan
    df = _spark_frame(spark, _frame_prompts())
    log = tmp_path / "partitions.jsonl"
    out = llm_infer_df(
        df, "prompt", model=tiny_llama_dir, max_tokens=MAX_TOKENS, co_locate=False,
        stats_log=str(log),
    )  # fmt: skip
    rows = out.select("prompt", "out.text").collect()
    assert sorted((r["prompt"], r["text"]) for r in rows) == sorted(texts.items())
    assert _logged_prefill(log) > 1.5 * prefill
    with pytest.raises((TypeError, ValueError), match="co_locate"):
        llm_infer_df(df, "prompt", model=tiny_llama_dir, co_locate="no")


def test_spark_prompt_column_that_cannot_be_keyed(spark, tiny_llama_dir):
    from llm_operator.integrations.spark import co_locate, llm_infer_df

    numbers = spark.createDataFrame([(1,), (2,)], "prompt long")
    with pytest.raises(TypeError, match="prompt"):
        llm_infer_df(numbers, "prompt", model=tiny_llama_dir)
    with pytest.raises(TypeError, match="col must be a string column"):
        co_locate(numbers, "prompt")


# -- the CLI -----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_cli_engines_co_locate_and_say_so(
    spark, tiny_llama_dir, one_plan, tmp_path, engine, capsys
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_operator.cli import main

    texts, prefill = one_plan
    prompts = _frame_prompts()
    source, output, log = tmp_path / "in.parquet", tmp_path / "out.jsonl", tmp_path / "p.jsonl"
    pq.write_table(pa.table({"prompt": prompts}), source)
    argv = [
        "run", str(source), "--prompt-col", "prompt", "--output", str(output), "--model",
        str(tiny_llama_dir), "--max-tokens", str(MAX_TOKENS), "--engine", engine,
        "--partitions", str(PARTITIONS), "--stats-log", str(log), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "co-location: about" in printed and "as they came" in printed
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["out"] for r in records] == [texts[p] for p in prompts]
    assert _logged_prefill(log) <= 1.15 * prefill
