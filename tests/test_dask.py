"""Dask integration: llm_infer equals LLMOperator.generate row for row (sync, threads,
processes), meta and empty partitions, bad input, one engine per worker, co_locate."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster
from helpers import TYPED_SCHEMA, chat_wrapped

from llm_operator import LLMOperator, SamplingParams
from llm_operator.integrations import dask as llm_dask
from llm_operator.integrations.co_location import build_partitioner
from llm_operator.integrations.infer_options import make_options
from llm_operator.integrations.worker import engine_constructions

MAX_TOKENS = 8
INSTRUCTIONS = (
    "Classify the sentiment as positive, negative or neutral. Review: ",
    "Summarize the review in one sentence. Review: ",
    "Extract the product name and the main complaint. Review: ",
)
REVIEWS = (
    "The battery lasts two full days. ",
    "Shipping took 12 days and the box arrived crushed. ",
    "The blender is loud, but it crushes ice in seconds. ",
    "Great value for the price. ",
    "The app crashes every time I open the settings page. ",
)
COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def shared_prefix_prompts(rows: int = 40) -> list[str]:
    """Instruction -> review -> row number: two levels of sharing, in mixed order."""
    prompts = [INSTRUCTIONS[i % 3] + REVIEWS[i % 5] + f"Row {i}." for i in range(rows)]
    random.Random(3).shuffle(prompts)
    return prompts


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    prompts = shared_prefix_prompts()
    return pd.DataFrame({"prompt": prompts, "row": range(len(prompts))})


@pytest.fixture(scope="module")
def expected(model_dir, frame) -> pd.DataFrame:
    """The oracle: LLMOperator.generate on all rows at once, as result columns."""
    results = LLMOperator(model_dir).generate(
        chat_wrapped(frame["prompt"]), SamplingParams(max_tokens=MAX_TOKENS)
    )
    return pd.DataFrame([r._asdict() for r in results], index=frame.index)


def infer(ddf: dd.DataFrame, model_dir: str) -> dd.DataFrame:
    return llm_dask.llm_infer(ddf, "prompt", output="out", model=model_dir, max_tokens=MAX_TOKENS)


def assert_results(computed: pd.DataFrame, expected: pd.DataFrame) -> None:
    """computed's result columns equal expected's, matched by index label."""
    for field in COLUMNS:
        name = "out" if field == "text" else f"out_{field}"
        got = computed[name].astype(object).where(computed[name].notna(), None)
        assert got.tolist() == expected.loc[computed.index, field].tolist(), field


def test_module_does_not_shadow_dask():
    assert llm_dask.dd.__name__ == "dask.dataframe"
    assert os.sep + "site-packages" + os.sep in llm_dask.dd.__file__


def test_sync_scheduler_matches_operator_with_meta(model_dir, frame, expected, caplog):
    ddf = dd.from_pandas(frame, npartitions=4)
    with caplog.at_level(logging.INFO, logger="llm_operator.integrations"):
        result = infer(ddf, model_dir)  # co-location is decided (and logged) here
        computed = result.compute(scheduler="sync")
    assert computed.index.tolist() == frame.index.tolist()  # same rows, same order
    assert_results(computed, expected)
    assert (computed["out_finish_reason"] != "error").all()
    assert computed.dtypes.to_dict() == result.dtypes.to_dict()
    assert list(computed.columns) == list(result.columns)
    assert result.divisions == ddf.divisions
    # the rows ran co-located (one line per partition), then came back as they were
    assert caplog.text.count("dask partition ") == 4 and "llm_infer co-location" in caplog.text


def test_empty_partitions(model_dir, frame, expected):
    ddf = dd.from_pandas(frame, npartitions=4)
    result = infer(ddf[ddf["row"] >= 25], model_dir)  # partitions 0 and 1 become empty
    parts = [result.get_partition(i).compute(scheduler="sync") for i in range(4)]
    assert [len(p) for p in parts] == [0, 0, 5, 10]
    assert all(p.dtypes.to_dict() == result.dtypes.to_dict() for p in parts)
    assert_results(pd.concat(parts), expected)
    nothing = infer(ddf[ddf["row"] < 0], model_dir).compute(scheduler="sync")
    assert nothing.empty and nothing.dtypes.to_dict() == result.dtypes.to_dict()


def test_null_prompt_is_an_error_row(model_dir):
    frame = pd.DataFrame({"prompt": ["Great value for the price.", None, "Why?", ""]})
    computed = infer(dd.from_pandas(frame, npartitions=2), model_dir).compute(scheduler="sync")
    assert computed["out_finish_reason"].tolist()[1] == "error"
    assert computed["out_finish_reason"].tolist()[3] == "error"
    assert "null" in computed["out_error"].iloc[1]
    assert set(computed["out_finish_reason"].iloc[[0, 2]]) <= {"stop", "length"}
    assert computed["out_error"].iloc[[0, 2]].isna().all()
    assert (computed["out_completion_tokens"].iloc[[0, 2]] > 0).all()


def test_bad_input_fails_on_the_client_before_any_model_loads():
    frame = pd.DataFrame({"prompt": ["a", "b"], "number": [1, 2], "out": ["x", "y"]})
    ddf = dd.from_pandas(frame, npartitions=1)
    before = engine_constructions()
    with pytest.raises(TypeError, match=r"col='number'.*int64"):
        llm_dask.llm_infer(ddf, "number", output="gen", model="/no/such/model")
    with pytest.raises(ValueError, match=r"output='out'.*\['out'\]"):
        llm_dask.llm_infer(ddf, "prompt", output="out", model="/no/such/model")
    with pytest.raises(ValueError, match=r"col='missing'"):
        llm_dask.llm_infer(ddf, "missing", model="/no/such/model")
    with pytest.raises(ValueError, match="max_tokens"):
        llm_dask.llm_infer(ddf, "prompt", output="gen", model="/no/such/model", max_tokens=0)
    with pytest.raises(TypeError, match="col='number'"):
        llm_dask.co_locate(ddf, "number")
    with pytest.raises(ValueError, match="npartitions"):
        llm_dask.co_locate(ddf, "prompt", 0)
    assert engine_constructions() == before


def test_tasks_capture_only_small_options():
    options = make_options(model="/some/model", max_tokens=MAX_TOKENS)
    # every option's value travels with each task (about 1 KB with the model server's
    # options), never a tokenizer, model or frame
    assert len(pickle.dumps((llm_dask._infer_partition, "prompt", options, "out"))) < 1500


def test_threads_cluster_with_co_locate(model_dir, frame, expected):
    ddf = dd.from_pandas(frame, npartitions=4)
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=3, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster),
    ):
        assert_results(infer(ddf, model_dir).compute(), expected)
        placed = llm_dask.co_locate(ddf, "prompt")  # a p2p shuffle on distributed
        parts = dask.compute(*placed.to_delayed())
        computed = infer(placed, model_dir).compute()
    partitioner = build_partitioner(frame["prompt"].tolist(), 4)  # sample = every row
    assert [set(map(partitioner, part["prompt"])) for part in parts] == [{0}, {1}, {2}, {3}]
    assert sorted(computed.index) == list(frame.index)
    assert_results(computed, expected)


def test_processes_cluster_one_engine_per_worker(model_dir, frame, expected):
    ddf = infer(dd.from_pandas(frame, npartitions=4), model_dir)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        assert_results(ddf.compute(), expected)
        for address in client.scheduler_info()["workers"]:  # every worker computes once more
            assert_results(client.compute(ddf, workers=[address]).result(), expected)
        constructions = client.run(engine_constructions)
    assert len(constructions) == 2
    assert set(constructions.values()) == {1}, constructions


def grouped_prompts() -> tuple[list[str], list[str]]:
    """Groups of 1 to 60 rows sharing a 60+ char prefix (half also share a preamble)."""
    rng = random.Random(11)
    prefixes, prompts = [], []
    for group in range(48):
        size = rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 60])
        preamble = "You label support tickets for the billing team. " if group % 2 else ""
        prefix = f"{preamble}Task {group:02d}: " + " ".join(rng.sample(REVIEWS, 3))
        assert len(prefix) >= 60
        prefixes.append(prefix)
        prompts += [prefix + f"{chr(97 + i % 26)}{i} ticket" for i in range(size)]
    rng.shuffle(prompts)
    return prefixes, prompts


def test_co_locate_keeps_groups_whole_balanced_and_sorted():
    prefixes, prompts = grouped_prompts()
    frame = pd.DataFrame({"prompt": prompts, "row": range(len(prompts))})
    frame.index = frame.index * 3  # a non-default index, kept as row labels
    ddf = dd.from_pandas(frame, npartitions=6)
    placed = llm_dask.co_locate(ddf, "prompt", 4)
    parts = [placed.get_partition(i).compute(scheduler="sync") for i in range(4)]
    assert placed.npartitions == 4
    assert sum(len(p) for p in parts) == len(frame)
    assert max(len(p) for p in parts) <= 2 * min(len(p) for p in parts), [len(p) for p in parts]
    partitioner = build_partitioner(prompts, 4)  # the whole table is the sample here
    for number, part in enumerate(parts):
        assert part["prompt"].tolist() == sorted(part["prompt"])
        assert all(partitioner(p) == number for p in part["prompt"])
        assert list(part.columns) == ["prompt", "row"]
    home = {p: n for n, part in enumerate(parts) for p in part["prompt"]}
    for prefix in prefixes:
        assert len({n for p, n in home.items() if p.startswith(prefix)}) == 1, prefix
    together = pd.concat(parts).sort_index()
    assert together.index.tolist() == frame.index.tolist()
    assert together["prompt"].tolist() == frame["prompt"].tolist()


def test_co_locate_sample_is_deterministic():
    _, prompts = grouped_prompts()
    ddf = dd.from_pandas(pd.DataFrame({"prompt": prompts}), npartitions=5)
    runs = [
        llm_dask.co_locate(ddf, "prompt", 3, sample_size=50, seed=4).compute(scheduler="sync")
        for _ in range(2)
    ]
    assert runs[0].index.tolist() == runs[1].index.tolist()


# -- constrained outputs ------------------------------------------------------------------
# closed schemas (TYPED_SCHEMA in helpers): a random tiny model completes them
# no single type for "x": Spark refuses it; Dask keeps the parsed JSON as it is
UNION_SCHEMA = {
    "type": "object",
    "properties": {"x": {"anyOf": [{"type": "boolean"}, {"enum": ["a", "b"]}]}},
    "required": ["x"],
}
CHOICES = ("billing", "shipping", "tech support")


def test_constrained_columns_match_the_operator_with_meta(model_dir):
    prompts = shared_prefix_prompts(6)
    frame = pd.DataFrame({"prompt": prompts})
    ddf = dd.from_pandas(frame, npartitions=2)
    runs = {  # output -> sampling options
        "typed": dict(max_tokens=100, json_schema=TYPED_SCHEMA, logprobs=True),
        "pick": dict(max_tokens=8, choices=CHOICES, logprobs=True),
        "union": dict(max_tokens=40, json_schema=UNION_SCHEMA),
        "cut": dict(max_tokens=3, json_schema=TYPED_SCHEMA),
        "plain": dict(max_tokens=4),
    }
    result = ddf
    for output, options in runs.items():
        result = llm_dask.llm_infer(result, "prompt", output=output, model=model_dir, **options)
    computed = result.compute(scheduler="sync")
    assert computed.dtypes.to_dict() == result.dtypes.to_dict()
    assert list(computed.columns) == list(result.columns)
    for output in runs:
        assert result.dtypes[f"{output}_logprob"] == "float64"
        assert result.dtypes[f"{output}_choice_logprobs"] == "object"
    assert [c for c in result.columns if c.endswith("_value")] == [
        "typed_value",
        "union_value",
        "cut_value",
    ]
    assert result.dtypes["typed_value"] == "object"

    operator = LLMOperator(model_dir)
    expected = {
        output: operator.generate(chat_wrapped(prompts), SamplingParams(**options))
        for output, options in runs.items()
    }
    for row, (_, got) in enumerate(computed.iterrows()):
        for output, results in expected.items():
            want = results[row]
            assert got[output] == want.text, (output, row)
            assert got[f"{output}_finish_reason"] == want.finish_reason
            if want.logprob is None:
                assert np.isnan(got[f"{output}_logprob"])
            else:
                assert got[f"{output}_logprob"] == pytest.approx(want.logprob, abs=1e-4)
        # typed: every row completes; the value is the text's JSON
        assert pd.isna(got["typed_error"])
        assert got["typed_value"] == json.loads(got["typed"])
        assert set(got["typed_value"]["detail"]) == {"urgent"}
        # choices with logprobs: every choice's log-probability, the pick among them
        assert got["pick"] in CHOICES
        assert set(got["pick_choice_logprobs"]) == set(CHOICES)
        for choice, logprob in got["pick_choice_logprobs"].items():
            assert logprob == pytest.approx(expected["pick"][row].choice_logprobs[choice], abs=1e-4)
        assert got["typed_choice_logprobs"] is None and got["plain_choice_logprobs"] is None
        # a part with no single type is kept as parsed
        assert got["union_value"] == json.loads(got["union"])
        assert got["union_value"]["x"] in (True, False, "a", "b")
        # cut by max_tokens: no value, and the error says why
        assert got["cut_finish_reason"] == "length" and got["cut_value"] is None
        assert "not valid" in got["cut_error"]


def test_empty_partition_with_a_value_column(model_dir):
    frame = pd.DataFrame({"prompt": shared_prefix_prompts(4)})
    ddf = dd.from_pandas(frame, npartitions=2)
    result = llm_dask.llm_infer(
        ddf[ddf["prompt"] == "no such prompt"], "prompt", model=model_dir, json_schema=UNION_SCHEMA
    )
    nothing = result.compute(scheduler="sync")
    assert nothing.empty and nothing.dtypes.to_dict() == result.dtypes.to_dict()
    assert "out_value" in nothing.columns


def test_value_false_and_bad_value_argument(model_dir):
    ddf = dd.from_pandas(pd.DataFrame({"prompt": ["a"]}), npartitions=1)
    plain = llm_dask.llm_infer(
        ddf, "prompt", model=model_dir, json_schema=UNION_SCHEMA, value=False
    )
    assert "out_value" not in plain.columns
    with pytest.raises(TypeError, match="value must be a bool"):
        llm_dask.llm_infer(ddf, "prompt", model=model_dir, json_schema=UNION_SCHEMA, value="yes")
    existing = dd.from_pandas(pd.DataFrame({"prompt": ["a"], "out_value": [1]}), npartitions=1)
    with pytest.raises(ValueError, match="out_value"):
        llm_dask.llm_infer(existing, "prompt", model=model_dir, json_schema=UNION_SCHEMA)
