"""Dask: prompts rendered from a DataFrame's columns (``template=`` / ``columns=``), and
the per-field statistics that choose their order (``reorder_fields``).

Each partition renders its rows as the CLI does (``table_prompt.render_pandas``: Arrow's
cast to string, nulls as the empty ``NULL_TEXT``). The statistics (``DaskStatistics``)
are two passes: the row count and mean lengths, then each partition hashes its rows'
rendered values per field set (``pandas.util.hash_pandas_object``) and Dask counts the
distinct hashes of each set. No row reaches the client.

Dask's ``dataframe.convert-string`` (on by default) turns object columns into strings
when the frame is made, so an object column of Python booleans arrives as "True"/"False";
a ``boolean`` dtype column renders as Arrow's "true"/"false".
"""

from __future__ import annotations

from collections.abc import Sequence

import dask
import dask.dataframe as dd
import pandas as pd

from llm_operator.prompts.field_order import FieldPlan, plan_fields
from llm_operator.prompts.table import (
    TablePrompt,
    check_columns,
    field_texts,
    pandas_table,
    render_pandas,
)


def check_table(ddf: dd.DataFrame, prompt: TablePrompt) -> None:
    """ValueError naming missing columns, TypeError naming columns whose dtype does not
    render (object columns are checked per partition, as they render)."""
    check_columns(prompt, list(ddf.columns), "the DataFrame")
    texts(ddf._meta, prompt)  # an empty frame of the real dtypes: Arrow types them


def texts(frame: pd.DataFrame, prompt: TablePrompt) -> pd.DataFrame:
    """Each field's rendered text (nulls as NULL_TEXT), one column per field."""
    rendered = field_texts(pandas_table(frame, prompt), prompt)
    columns = {
        name: pd.Series(text.to_pylist(), index=frame.index, dtype=object)
        for name, text in rendered.items()
    }
    return pd.DataFrame(columns, index=frame.index)


def render_partition(frame: pd.DataFrame, prompt: TablePrompt) -> pd.Series:
    return pd.Series(render_pandas(frame, prompt), index=frame.index, dtype=object)


def _hashes(frame: pd.DataFrame, prompt: TablePrompt, sets: Sequence[frozenset[str]]):
    rendered = texts(frame, prompt)
    columns = {"__length_" + name: rendered[name].str.len() for name in prompt.fields}
    for i, fields in enumerate(sets):
        columns[f"__set{i}"] = pd.util.hash_pandas_object(
            rendered[sorted(fields)], index=False
        ).astype("uint64")
    return pd.DataFrame(columns, index=frame.index)


EXACT_HASHES = 50_000_000
"""Up to this many (row, field set) hashes, distinct counts are exact (``nunique``: the
last reduction holds each set's distinct hashes, 8 bytes each); past it, HyperLogLog
(``nunique_approx``, within about 1%)."""


class DaskStatistics:
    """FieldStatistics of a dask DataFrame: the first ``distinct`` call counts rows and
    mean lengths (one pass), then each call counts every set's distinct value hashes in
    one pass (exact up to ``EXACT_HASHES`` row-set pairs, approximate past it)."""

    def __init__(self, ddf: dd.DataFrame, prompt: TablePrompt) -> None:
        check_table(ddf, prompt)
        self._ddf, self._prompt = ddf, prompt
        self.rows = -1
        self.mean_chars: dict[str, float] = {}
        self.exact = True

    def _count_rows(self) -> None:
        hashed = self._ddf.map_partitions(
            _hashes, self._prompt, [], meta=_hashes(self._ddf._meta, self._prompt, [])
        )
        lengths = [hashed["__length_" + name].sum() for name in self._prompt.fields]
        rows, sums = dask.compute(hashed.shape[0], lengths)
        self.rows = int(rows)
        self.mean_chars = {
            name: float(total) / max(self.rows, 1) for name, total in zip(self._prompt.fields, sums)
        }

    def distinct(self, sets: Sequence[frozenset[str]]) -> dict[frozenset[str], int]:
        if self.rows < 0:
            self._count_rows()
        if not sets:
            return {}
        meta = _hashes(self._ddf._meta, self._prompt, sets)
        hashed = self._ddf.map_partitions(_hashes, self._prompt, list(sets), meta=meta)
        if self.rows * len(sets) > EXACT_HASHES:
            self.exact = False
        columns = [hashed[f"__set{i}"] for i in range(len(sets))]
        counts = dask.compute(*[c.nunique() if self.exact else c.nunique_approx() for c in columns])
        return {fields: int(round(count)) for fields, count in zip(sets, counts)}


def plan_table(ddf: dd.DataFrame, prompt: TablePrompt, *, reorder: bool = True) -> FieldPlan:
    """Statistics of ``ddf`` under the prompt's given order and (``reorder``) the chosen one."""
    return plan_fields(prompt, DaskStatistics(ddf, prompt), reorder=reorder)
