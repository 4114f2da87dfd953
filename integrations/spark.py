"""Spark integration: an LLM column over a DataFrame, and prefix co-location.

>>> from llm_operator.integrations.spark import co_locate, llm_infer
>>> df = co_locate(df, "prompt")  # optional: rows sharing a prefix meet in one partition
>>> df = df.withColumn("out", llm_infer("prompt", model="smollm2-135m-instruct", max_tokens=32))
>>> df.select("out.text", "out.finish_reason")

``llm_infer`` returns a struct column ``text, finish_reason, prompt_tokens,
completion_tokens, error, logprob, choice_logprobs`` (and with ``json_schema`` a typed
``value``: ``out.value.name``). Each partition is one batch: the UDF gathers all of the
partition's Arrow batches and runs one plan over all its rows (global prefix sharing),
then yields outputs aligned with the input batches. The engine is built once per Python
worker process and reused across tasks and jobs (Spark reuses Python workers by default):
the UDF closure captures only the small, validated ``InferOptions``. Classic Spark only
(``co_locate`` uses ``DataFrame.rdd``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pandas as pd
from pyspark import TaskContext
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from llm_operator.integrations.json_values import ValueType
from llm_operator.integrations.partition import (
    RESULT_FIELDS,
    VALUE_FIELD,
    InferOptions,
    PrefixPartitioner,
    _is_missing,
    build_partitioner,
    check_prompt_source,
    logger,
    make_options,
    result_records,
    run_partition,
    typed_value,
)
from llm_operator.options import SCOPES, keyword_signature
from llm_operator.prompts.table import TABLE_PROMPT_OPTIONS

_SPARK_TYPES = {
    str: T.StringType(),
    int: T.IntegerType(),
    float: T.DoubleType(),
    dict: T.MapType(T.StringType(), T.DoubleType(), valueContainsNull=True),
}
_PROMPT = "__llm_operator_prompt"  # a temporary prompt column (rendered or co-location key)
RESULT_TYPE = T.StructType(
    [T.StructField(name, _SPARK_TYPES[kind], nullable=True) for name, kind in RESULT_FIELDS]
)
# object columns keep None as None (Arrow makes it null); ints are never missing
_NUMPY_TYPES = {str: object, int: np.int32, float: object, dict: object}
_SCALAR_TYPES = {
    "string": T.StringType(),
    "integer": T.LongType(),
    "number": T.DoubleType(),
    "boolean": T.BooleanType(),
}


def spark_value_type(node: ValueType) -> T.DataType:
    """The Spark type of a JSON schema's values (json_values.value_type): objects are
    structs of nullable fields in the schema's order, arrays are arrays."""
    if node.kind == "object":
        return T.StructType(
            [
                T.StructField(name, spark_value_type(sub), nullable=True)
                for name, sub in node.properties
            ]
        )
    if node.kind == "array":
        return T.ArrayType(spark_value_type(node.items), containsNull=True)
    assert node.kind in _SCALAR_TYPES, f"no Spark type for {node.kind!r} (typed with untyped=True?)"
    return _SCALAR_TYPES[node.kind]


def result_type(value_type: ValueType | None = None) -> T.StructType:
    """RESULT_TYPE, plus a nullable ``value`` field of ``value_type``'s Spark type."""
    if value_type is None:
        return RESULT_TYPE
    value = T.StructField(VALUE_FIELD, spark_value_type(value_type), nullable=True)
    return T.StructType([*RESULT_TYPE.fields, value])  # (StructType.add would change RESULT_TYPE)


def llm_infer(
    col: str | Column | None = None,
    *,
    model: Any,
    engine_options: Mapping[str, Any] | None = None,
    value: bool = True,
    **options: Any,
) -> Column:
    """A struct column ``text, finish_reason, prompt_tokens, completion_tokens, error,
    logprob, choice_logprobs``, and with ``json_schema`` (and ``value``) a ``value`` field.

    col: a column name or a Column expression (e.g. an ``F.format_string`` or
        ``F.concat`` template) of strings, or of chat message lists
        (``array<struct<role, content>>`` or ``array<map<string, string>>``). Or None,
        with ``template="... {title} ..."`` or ``columns=[...]`` (and ``instruction``):
        the prompt is rendered from the row's columns (``spark_tables``; nulls render
        empty). ``reorder_fields`` needs the whole DataFrame: use ``llm_infer_df``;
        ``dedupe`` here computes identical prompts once per partition (over the whole
        DataFrame with ``llm_infer_df``, which co-locates them first).
    options: every engine, sampling and prompt option (``llm_operator.options``), e.g.
        ``backend``, ``max_batch_size``, ``max_tokens``, ``temperature``, ``stop``,
        ``seed``, ``chat``, ``system``; ``engine_options`` takes engine options as a mapping.
        Constrained outputs: ``choices`` (a list of strings), ``regex``, ``json_schema``
        (a dict or JSON text), ``logprobs``.
    value: with ``json_schema``, parse each row's JSON on the worker into the field
        ``value``, typed from the schema (``out.value.name``; objects are structs, every
        field nullable, integer is bigint, number is double; see
        ``llm_operator.integrations.json_values``). A row whose text is not valid JSON
        or does not fit gets a null ``value`` and ``error`` says why. ``value=False``
        leaves the field out (then any schema the engine compiles works).
    logprob: the output's log-probability under the unconstrained model (null unless
    ``logprobs=True``); choice_logprobs: each choice's (null unless ``choices`` and
    ``logprobs``).
    Options are validated here, on the driver, before any Spark job or model load; so is
    the schema's type (ValueError naming a part that has no single type, e.g. ``anyOf``).
    A null or empty prompt gives that row ``finish_reason="error"`` and a message. A
    column of another type raises TypeError naming the type inside the UDF, before any
    model loads (Spark reports it as a failed task); ``llm_infer_df`` raises it on the
    driver instead, before any job runs.
    Tasks with a "gpu" resource run on ``cuda:<first address>``; other tasks run on CPU
    unless the ``device`` option names one.
    """
    schema = options.get("json_schema")  # as given: its property order
    options = make_options(model=model, engine_options=engine_options, **options)
    value_type = typed_value(schema, value)
    return_type = result_type(value_type)
    column = _prompt_source(col, options)
    if options.reorder_fields:
        raise ValueError(
            "reorder_fields needs the whole DataFrame's statistics: use "
            "llm_infer_df(df, template=..., reorder_fields=True, ...)"
        )

    def infer(batches: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        return infer_batches(batches, options, value_type)  # the closure holds only these

    infer.__name__ = "llm_infer"
    return F.pandas_udf(infer, returnType=return_type)(column)


keyword_signature(llm_infer, SCOPES)


def llm_infer_df(
    df: DataFrame, col: str | Column | None = None, *, output: str = "out", **options: Any
) -> DataFrame:
    """``df`` with an ``output`` struct column from ``llm_infer(col, **options)``.

    Unlike ``llm_infer`` alone, this checks the prompt on the driver, before any job runs
    or any model loads: TypeError for a prompt column of anything but strings or chat
    message lists; with ``template``/``columns``, ValueError naming columns ``df``
    lacks and TypeError naming columns that do not render (arrays, maps, structs,
    binary). Over the whole DataFrame:

    reorder_fields: two Spark jobs (``spark_tables.plan_table``: row count and mean field
        lengths, then exact distinct counts of field sets) choose the order of the
        movable field lines that shares the most prefix; the prompts render in that
        order and rows are co-located by them (``co_locate``). The order is logged.
    dedupe: rows are co-located by the prompt, so identical prompts meet in one
        partition, where each is computed once; identical prompts get identical outputs.
    The output's rows come in the co-located order (Spark keeps no order anyway).
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    if not isinstance(output, str) or not output:
        raise ValueError(f"output must be a non-empty column name, got {output!r}")
    if output in df.columns:
        raise ValueError(f"output={output!r} is a column of df already; choose another output")
    checked = make_options(
        model=options.get("model"),
        **{k: v for k, v in options.items() if k not in ("model", "value")},
    )
    if checked.table is None:
        column = llm_infer(col, **options)  # validates the options first
        prompt_type = df.select(_as_column(col, "col")).schema.fields[0].dataType
        check_prompt_type(prompt_type)
        if checked.dedupe:  # identical prompts meet, then each partition computes them once
            source = _as_column(col, "col")
            if not isinstance(prompt_type, T.StringType):  # chat messages: by their JSON
                source = F.to_json(source)
            df = co_locate(df.withColumn(_PROMPT, source), _PROMPT).drop(_PROMPT)
        return df.withColumn(output, column)
    check_prompt_source(col, checked)
    from llm_operator.integrations.spark_tables import plan_table, prompt_column

    prompt = checked.table
    if checked.reorder_fields:
        plan = plan_table(df, prompt)
        logger.info("llm_infer_df fields:\n%s", plan.report())
        prompt = plan.chosen
    frame = df.withColumn(_PROMPT, prompt_column(prompt, df))  # checks columns and types
    if checked.reorder_fields or checked.dedupe:
        frame = co_locate(frame, _PROMPT)
    rest = {k: v for k, v in options.items() if k not in TABLE_PROMPT_OPTIONS}
    rest["reorder_fields"] = False  # done: the prompts are rendered in the chosen order
    return frame.withColumn(output, llm_infer(_PROMPT, **rest)).drop(_PROMPT)


def check_prompt_type(data_type: T.DataType) -> None:
    """Raise TypeError unless ``data_type`` holds prompts: strings or chat message lists."""
    if isinstance(data_type, T.StringType):
        return
    if isinstance(data_type, T.ArrayType):
        element = data_type.elementType
        if isinstance(element, T.MapType) and isinstance(element.valueType, T.StringType):
            return
        if isinstance(element, T.StructType):
            fields = {field.name: field.dataType for field in element.fields}
            if all(isinstance(fields.get(name), T.StringType) for name in ("role", "content")):
                return
    raise TypeError(
        "col must hold prompts (string, or chat messages array<struct<role: string, "
        f"content: string>>), got a column of type {data_type.simpleString()}"
    )


# -- inside the Python worker -------------------------------------------------------
def infer_batches(
    batches: Iterator[pd.Series], options: InferOptions, value_type: ValueType | None = None
) -> Iterator[pd.DataFrame]:
    """The UDF body: gather every batch of the partition, run them as one, yield per batch.

    Output frames have the input batches' sizes, in their order (Spark zips them back
    onto the input rows); with ``value_type`` they end with the parsed ``value`` column.
    """
    sizes: list[int] = []
    values: list[Any] = []
    for batch in batches:
        sizes.append(len(batch))
        values.extend(prompt_values(batch))
    context = TaskContext.get()
    if context is not None:
        _show_worker_logs()
    label = f"spark partition {context.partitionId()}" if context is not None else "spark batch"
    device = task_device(context, options)
    results = run_partition(values, options, device=device, label=label) if values else []
    records = result_records(results, value_type)
    assert len(records) == len(values), f"{label}: {len(records)} results, {len(values)} rows"
    start = 0
    for size in sizes:
        yield _frame(records[start : start + size], value_type is not None)
        start += size


def prompt_values(batch: pd.Series) -> list[Any]:
    """One batch's prompts: strings, chat message lists (lists of dicts) or None.

    Raises TypeError naming the dtype or the value type of a non-prompt column.
    """
    if isinstance(batch, pd.DataFrame):
        raise TypeError(
            f"llm_infer needs a string column, got a struct column with fields {list(batch.columns)}"
        )
    dtype = batch.dtype
    if not (pd.api.types.is_object_dtype(dtype) or isinstance(dtype, pd.StringDtype)):
        raise TypeError(f"llm_infer needs a string column, got a column of {dtype} values")
    values: list[Any] = []
    for value in batch.tolist():
        if isinstance(value, str) or _is_missing(value):
            values.append(value)
        elif isinstance(value, (list, tuple, np.ndarray)) and all(
            isinstance(message, Mapping) for message in value
        ):
            values.append([dict(message) for message in value])
        else:
            raise TypeError(
                f"llm_infer needs a string column, got a {type(value).__name__} value {value!r:.60}"
            )
    return values


def task_device(context: Any, options: InferOptions) -> str | None:
    """``cuda:<first address>`` for a task given a "gpu" resource; else CPU.

    An explicit ``device`` option is kept (None lets it through).
    """
    if context is not None:
        gpus = context.resources().get("gpu")
        if gpus is not None and gpus.addresses:
            return f"cuda:{gpus.addresses[0]}"
    if options.engine.device != "auto":
        return None
    return "cpu"


def _frame(records: list[dict[str, Any]], with_value: bool = False) -> pd.DataFrame:
    """The UDF's output: one column per result field (values as dicts and lists)."""
    columns = {
        name: pd.Series([r[name] for r in records], dtype=_NUMPY_TYPES[kind])
        for name, kind in RESULT_FIELDS
    }
    if with_value:
        columns[VALUE_FIELD] = pd.Series([r[VALUE_FIELD] for r in records], dtype=object)
    return pd.DataFrame(columns)


def _show_worker_logs() -> None:
    """Send the per-partition INFO lines to the worker's stderr (the executor log), once,
    unless the worker's logging is configured already."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s")
    )
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


# -- co-location --------------------------------------------------------------------
def co_locate(
    df: DataFrame,
    col: str | Column,
    num_partitions: int | None = None,
    *,
    sample_size: int = 2000,
    min_prefix_chars: int = 32,
    seed: int = 0,
) -> DataFrame:
    """``df`` moved so that rows sharing a prompt prefix meet in one partition, sorted.

    Pays when prompts share long prefixes (a system prompt, few-shot examples, a
    document asked several questions) and rows of a group are spread over partitions:
    each partition plans its batch alone, so a group split over k partitions prefills
    its prefix k times. Lexicographic order is the depth-first order of the prefix tree,
    but a plain ``repartitionByRange`` cuts a group wherever a range boundary falls.
    Instead a sample of up to ``sample_size`` prompts (deterministic for ``seed``) is
    cut where it branches (``build_partitioner``), every row goes to exactly the
    partition its prefix is assigned to (an identity partitioner, not a hash), and
    rows are sorted within partitions. Costs a count, a sample and one shuffle; skip it
    when rows are already grouped or prompts share little.

    num_partitions: default ``df.rdd.getNumPartitions()``.
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    if num_partitions is not None:
        _check_positive_int(num_partitions, "num_partitions")
    _check_positive_int(sample_size, "sample_size")
    _check_positive_int(min_prefix_chars, "min_prefix_chars")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if isinstance(col, str) and col in df.columns:
        key, frame = col, df
    else:  # an expression or a nested field: a temporary column, dropped at the end
        key = _PROMPT
        frame = df.withColumn(key, _as_column(col, "col"))
    data_type = frame.schema[key].dataType
    if not isinstance(data_type, T.StringType):
        raise TypeError(f"col must be a string column, got type {data_type.simpleString()}")
    partitions = num_partitions or max(1, frame.rdd.getNumPartitions())
    sample = _sample_prompts(frame, key, sample_size, seed)
    partitioner = build_partitioner(sample, partitions, min_prefix_chars=min_prefix_chars)
    rows = frame.rdd.map(_keyed_by(partitioner, frame.columns.index(key)))
    placed = rows.partitionBy(partitions, _identity).values()
    result = frame.sparkSession.createDataFrame(placed, frame.schema, verifySchema=False)
    result = result.sortWithinPartitions(key)
    return result if key is col else result.drop(key)


def _sample_prompts(frame: DataFrame, key: str, sample_size: int, seed: int) -> list[str]:
    """Up to ``sample_size`` prompts, the same ones for the same seed and input."""
    column = frame.select(key).where(F.col(key).isNotNull())
    total = column.count()
    if total > sample_size:
        fraction = min(1.0, 1.2 * sample_size / total)
        column = column.sample(withReplacement=False, fraction=fraction, seed=seed)
    values = sorted(row[0] for row in column.collect())
    if len(values) > sample_size:  # evenly spaced in sorted order: every region stays
        step = len(values) / sample_size
        values = [values[int(i * step)] for i in range(sample_size)]
    return values


def _keyed_by(partitioner: PrefixPartitioner, index: int):
    def keyed(row):
        return partitioner(row[index]), row

    return keyed


def _identity(partition: int) -> int:
    return partition


def _prompt_source(col: Any, options: InferOptions) -> Column:
    """The prompt column: ``col``, or the one ``template``/``columns`` render."""
    check_prompt_source(col, options)
    if options.table is None:
        return _as_column(col, "col")
    from llm_operator.integrations.spark_tables import prompt_column

    return prompt_column(options.table)


def _as_column(col: Any, name: str) -> Column:
    if isinstance(col, str):
        return F.col(col)
    if isinstance(col, Column):
        return col
    raise TypeError(f"{name} must be a column name or a Column, got {type(col).__name__}")


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
