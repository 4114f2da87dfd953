"""Identical prompts computed once: the CLI's ``--dedupe`` (over the whole table) and each
Spark or Dask partition's ``dedupe=True`` both call ``dedupe``. (The planner also merges
requests whose token ids are equal, whatever their source: that is what makes duplicates
free inside one ``generate`` call even without ``dedupe``.)"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from typing import Any


def dedupe(values: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """(each distinct prompt once, in first-seen order; each row's index into them).
    Chat message lists compare by their JSON; missing prompts stay one row each (they
    become error rows)."""
    distinct: list[Any] = []
    index: dict[Any, int] = {}
    positions: list[int] = []
    for value in values:
        key = _prompt_key(value)
        if key is None or key not in index:
            if key is not None:
                index[key] = len(distinct)
            positions.append(len(distinct))
            distinct.append(value)
        else:
            positions.append(index[key])
    return distinct, positions


def distinct_with(
    positions: Sequence[int], keys: Sequence[Hashable]
) -> tuple[list[int], list[int]]:
    """Rows distinct by their prompt and one more key each (a row's constraint): (the first
    row of each distinct (prompt, key), each row's index into those). ``positions``: each
    row's prompt, as ``dedupe`` gives them."""
    index: dict[tuple[int, Hashable], int] = {}
    firsts: list[int] = []
    rows: list[int] = []
    for row, pair in enumerate(zip(positions, keys)):
        if pair not in index:
            index[pair] = len(firsts)
            firsts.append(row)
        rows.append(index[pair])
    return firsts, rows


def _prompt_key(value: Any) -> Any:
    if isinstance(value, str):
        return ("text", value)
    if isinstance(value, list):
        try:
            return ("chat", json.dumps(value, sort_keys=True, ensure_ascii=False))
        except (TypeError, ValueError):
            return None
    return None
