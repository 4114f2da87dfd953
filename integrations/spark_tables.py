"""Spark: prompts rendered from a DataFrame's columns (``template=`` / ``columns=``), and
the per-field statistics that choose their order (``reorder_fields``), as Spark SQL.

Rendering is one ``concat`` expression: no Python runs until the model's UDF. A value
renders as Spark's ``CAST(... AS STRING)`` (a float or double that is a whole number
drops its ".0", as Arrow's cast does for the CLI and Dask); a null renders as the empty
value ``NULL_TEXT``. Array, map, struct and binary columns are refused (TypeError naming
the column) before any job runs.

The statistics are one aggregate over the DataFrame: the row count, each field's mean
rendered length and an ``approx_count_distinct`` (HyperLogLog++, ``RELATIVE_SD``) of
each field set the order search needs; no row reaches the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from llm_operator.field_order import FieldPlan, plan_fields
from llm_operator.table_prompt import NULL_TEXT, Field, TablePrompt, check_columns

RELATIVE_SD = 0.05
"""approx_count_distinct's relative standard deviation (Spark's default; smaller ones cost
much more memory per field set)."""

_RENDERABLE = (
    T.StringType,
    T.CharType,
    T.VarcharType,
    T.ByteType,
    T.ShortType,
    T.IntegerType,
    T.LongType,
    T.FloatType,
    T.DoubleType,
    T.DecimalType,
    T.BooleanType,
    T.DateType,
    T.TimestampType,
    T.TimestampNTZType,
    T.NullType,
)


def field_text(df: DataFrame, name: str) -> Column:
    """Column ``name`` as prompt text, nulls as ``NULL_TEXT``; TypeError naming a column
    whose type does not render."""
    data_type = df.schema[name].dataType
    if not isinstance(data_type, _RENDERABLE):
        raise TypeError(
            f"column {name!r} holds {data_type.simpleString()} values, which do not render "
            "as prompt text; cast it to a string first or leave it out"
        )
    text = F.col(name).cast("string")
    if isinstance(data_type, (T.FloatType, T.DoubleType)):  # 3.0 -> "3", as Arrow renders it
        text = F.regexp_replace(text, r"\.0$", "")
    return F.coalesce(text, F.lit(NULL_TEXT))


def check_table(df: DataFrame, prompt: TablePrompt) -> None:
    """ValueError naming missing columns, TypeError naming unrenderable ones."""
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    check_columns(prompt, df.columns, "the DataFrame")
    for name in prompt.fields:
        field_text(df, name)


def prompt_column(prompt: TablePrompt, df: DataFrame | None = None) -> Column:
    """The rendered prompt as one ``concat`` expression (with ``df``, its columns are
    checked first; without, Spark resolves the names when the column is used)."""
    if df is not None:
        check_table(df, prompt)
    parts = []
    for piece in prompt.pieces():
        if isinstance(piece, str):
            parts.append(F.lit(piece))
        elif df is not None:
            parts.append(field_text(df, piece.name))
        else:
            parts.append(F.coalesce(F.col(piece.name).cast("string"), F.lit(NULL_TEXT)))
    return F.concat(*parts) if len(parts) > 1 else parts[0]


class SparkStatistics:
    """FieldStatistics of a DataFrame: each ``distinct`` call is one aggregate job."""

    exact = False

    def __init__(self, df: DataFrame, prompt: TablePrompt) -> None:
        check_table(df, prompt)
        self._texts = df.select(
            *[field_text(df, name).alias(f"f{i}") for i, name in enumerate(prompt.fields)]
        )
        self._alias = {name: f"f{i}" for i, name in enumerate(prompt.fields)}
        self._pending: list[Column] = [F.count(F.lit(1)).alias("rows")] + [
            F.avg(F.length(F.col(alias))).alias(f"len_{alias}") for alias in self._alias.values()
        ]
        self.rows = 0
        self.mean_chars: dict[str, float] = {}

    def distinct(self, sets: Sequence[frozenset[str]]) -> dict[frozenset[str], int]:
        aggregates = list(self._pending)
        for i, fields in enumerate(sets):
            columns = [F.col(self._alias[name]) for name in sorted(fields)]
            key = F.xxhash64(*columns) if len(columns) > 1 else columns[0]
            aggregates.append(F.approx_count_distinct(key, RELATIVE_SD).alias(f"d{i}"))
        row = self._texts.agg(*aggregates).collect()[0]
        if self._pending:  # the first pass also counts rows and mean lengths
            self.rows = int(row["rows"])
            self.mean_chars = {
                name: float(row[f"len_{alias}"] or 0.0) for name, alias in self._alias.items()
            }
            self._pending = []
        return {fields: int(row[f"d{i}"]) for i, fields in enumerate(sets)}


def plan_table(df: DataFrame, prompt: TablePrompt, *, reorder: bool = True) -> FieldPlan:
    """Statistics of ``df`` under the prompt's given order and (``reorder``) the chosen
    one: one aggregate job when every movable block is ordered exactly."""
    return plan_fields(prompt, SparkStatistics(df, prompt), reorder=reorder)


__all__ = ["Field", "SparkStatistics", "check_table", "field_text", "plan_table", "prompt_column"]
