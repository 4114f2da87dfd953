"""Per-iteration decode figures of the native engine, from ``NativeBackend.last_profile``.

The native backend may list each iteration of its last run in ``last_profile.steps`` as
``(tokens, rows_sampled, seconds)``. An iteration in which every scheduled token was a
sampled row's single next token (tokens == rows_sampled) is a pure decode step of batch
size ``rows_sampled``; its time against that batch size shows what one more row costs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def summarize_decode_steps(
    steps: Iterable[Any], ops: Iterable[dict[str, float]] | None = None
) -> dict[str, Any] | None:
    """Median seconds per decode-only iteration, by batch size; None without such steps.

    Returns ``{"iterations", "decode_iterations", "decode_seconds", "by_batch": [{"rows",
    "iterations", "median_ms"[, "ops_ms"]}, ...]}`` (ascending rows). Entries that are not
    ``(tokens, rows_sampled, seconds)`` with tokens >= 1 are skipped, so a profile of
    another shape yields None rather than an error. ``ops``: each iteration's seconds by
    kind of work (``last_profile.ops``, one per step), whose medians over a batch
    size's decode iterations become its ``ops_ms``.
    """
    iterations = 0
    by_rows: dict[int, list[float]] = {}
    ops_by_rows: dict[int, list[dict[str, float]]] = {}
    splits = list(ops) if ops is not None else []
    for index, step in enumerate(steps):
        iterations += 1
        try:
            tokens, rows, seconds = step
            tokens, rows, seconds = int(tokens), int(rows), float(seconds)
        except (TypeError, ValueError):
            continue
        if tokens >= 1 and tokens == rows and seconds >= 0:
            by_rows.setdefault(rows, []).append(seconds)
            if index < len(splits) and isinstance(splits[index], dict):
                ops_by_rows.setdefault(rows, []).append(splits[index])
    if not by_rows:
        return None
    return {
        "iterations": iterations,
        "decode_iterations": sum(len(times) for times in by_rows.values()),
        "decode_seconds": sum(sum(times) for times in by_rows.values()),
        "by_batch": [
            {
                "rows": rows,
                "iterations": len(by_rows[rows]),
                "median_ms": statistics.median(by_rows[rows]) * 1e3,
                **(
                    {
                        "ops_ms": {
                            kind: statistics.median(split[kind] for split in ops_by_rows[rows])
                            * 1e3
                            for kind in ops_by_rows[rows][0]
                        }
                    }
                    if ops_by_rows.get(rows)
                    else {}
                ),
            }
            for rows in sorted(by_rows)
        ],
    }


def backend_decode_profile(backend: Any) -> dict[str, Any] | None:
    """``summarize_decode_steps`` of a native backend's last run; None for other backends
    or when its profile has no ``steps``."""
    if getattr(backend, "name", None) != "native":
        return None
    profile = getattr(backend, "last_profile", None)  # a RunProfile, None before a run
    steps = getattr(profile, "steps", None)
    if not isinstance(steps, (list, tuple)):
        return None
    return summarize_decode_steps(steps, profile.ops)
