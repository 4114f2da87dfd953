"""Spark: prompts rendered from a DataFrame's columns (``template=`` / ``columns=``), and
the per-field statistics that choose their order (``reorder_fields``), as Spark SQL.

Rendering is one ``concat`` expression: no Python runs until the model's UDF. A value
renders as Spark's ``CAST(... AS STRING)`` (a float or double that is a whole number
drops its ".0", as Arrow's cast does for the CLI and Dask); a null renders as the empty
value ``NULL_TEXT``. Array, map, struct and binary columns are refused (TypeError naming
the column) before any job runs.

The statistics (``SparkStatistics``) are two jobs over the DataFrame: the row count and
each field's mean rendered length, then the exact number of distinct values of each field
set the order search needs (distinct 64-bit hashes, counted per set); no row reaches the
driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from llm_operator.prompts.field_order import FieldPlan, plan_fields
from llm_operator.prompts.table import NULL_TEXT, Field, TablePrompt, check_columns

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
    return _text(name, data_type)


def _text(name: str, data_type: T.DataType | None) -> Column:
    """``CAST(name AS STRING)``, nulls as NULL_TEXT (a whole float drops its ".0", as Arrow
    renders it; with no ``data_type`` known, the cast alone)."""
    text = F.col(name).cast("string")
    if isinstance(data_type, (T.FloatType, T.DoubleType)):
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
    parts = [
        F.lit(piece)
        if isinstance(piece, str)
        else (_text(piece.name, None) if df is None else field_text(df, piece.name))
        for piece in prompt.pieces()
    ]
    return F.concat(*parts) if len(parts) > 1 else parts[0]


class SparkStatistics:
    """FieldStatistics of a DataFrame, exact: the first ``distinct`` call runs one
    aggregate for the row count and mean lengths; each call then counts the distinct
    64-bit hashes (``xxhash64``) of every field set's values in one job: each row emits a
    (set, hash) pair per set, and ``countDistinct`` per set aggregates them map-side
    first, so what is shuffled is each partition's distinct pairs. No row reaches the
    driver. (64-bit hashes of different values collide with odds of about n^2 / 2^65.)"""

    exact = True

    def __init__(self, df: DataFrame, prompt: TablePrompt) -> None:
        check_table(df, prompt)
        self._texts = df.select(
            *[field_text(df, name).alias(f"f{i}") for i, name in enumerate(prompt.fields)]
        )
        self._alias = {name: f"f{i}" for i, name in enumerate(prompt.fields)}
        self.rows = -1
        self.mean_chars: dict[str, float] = {}

    def _count_rows(self) -> None:
        aggregates = [F.count(F.lit(1)).alias("rows")] + [
            F.avg(F.length(F.col(alias))).alias(f"len_{alias}") for alias in self._alias.values()
        ]
        row = self._texts.agg(*aggregates).collect()[0]
        self.rows = int(row["rows"])
        self.mean_chars = {
            name: float(row[f"len_{alias}"] or 0.0) for name, alias in self._alias.items()
        }

    def distinct(self, sets: Sequence[frozenset[str]]) -> dict[frozenset[str], int]:
        if self.rows < 0:
            self._count_rows()
        if not sets:
            return {}
        pairs = [
            F.struct(
                F.lit(i).alias("set"),
                F.xxhash64(*[F.col(self._alias[name]) for name in sorted(fields)]).alias("hash"),
            )
            for i, fields in enumerate(sets)
        ]
        exploded = self._texts.select(F.explode(F.array(*pairs)).alias("pair"))
        counted = (
            exploded.select("pair.set", "pair.hash")
            .groupBy("set")
            .agg(F.countDistinct("hash").alias("distinct"))
            .collect()
        )
        found = {row["set"]: int(row["distinct"]) for row in counted}
        return {fields: found.get(i, 0) for i, fields in enumerate(sets)}


def plan_table(df: DataFrame, prompt: TablePrompt, *, reorder: bool = True) -> FieldPlan:
    """Statistics of ``df`` under the prompt's given order and (``reorder``) the chosen
    one: two jobs when every movable block is ordered exactly (one more per position of
    a block ordered greedily)."""
    return plan_fields(prompt, SparkStatistics(df, prompt), reorder=reorder)


__all__ = ["Field", "SparkStatistics", "check_table", "field_text", "plan_table", "prompt_column"]
