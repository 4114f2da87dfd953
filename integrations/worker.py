"""One engine per worker process, and running one partition on it: what the Spark and Dask
operators do inside a task. Statistics per partition go to the worker's log (and the
``stats_log`` file when asked); results come back in input order, one per row.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from llm_operator.integrations.infer_options import (
    RESULT_FIELDS,
    VALUE_FIELD,
    EmbedOptions,
    InferOptions,
    is_missing,
    row_sampling,
)
from llm_operator.integrations.json_values import ValueType, parse_value
from llm_operator.prompts.dedupe import dedupe, distinct_with
from llm_operator.results import GenerationResult
from llm_operator.sampling import SamplingParams

logger = logging.getLogger("llm_operator.integrations")

# -- one engine per worker process ----------------------------------------------------
_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()
_constructions: dict[tuple, int] = {}  # engine key -> operators built for it in this process


def get_operator(options: InferOptions | EmbedOptions, device: str | None = None):
    """The worker's LLMOperator for these options, built on first use and then reused.

    One per options and device: asked for another device (a reused worker given another
    GPU), the process first releases its engine for the same options on the old device,
    unless that one is running a partition in another thread. ``device`` may carry a
    share of its GPU (``integrations.devices.Device``): the engine's ``gpu_share`` unless
    the options set one."""
    key = options.engine_key(device)
    with _engines_lock:
        operator = _engines.get(key)
        if operator is None:
            from llm_operator import LLMOperator

            _release_other_devices(key)
            engine = {f.name: getattr(options.engine, f.name) for f in fields(options.engine)}
            if device is not None:
                engine["device"] = str(device)
                share = getattr(device, "gpu_share", None)
                if share is not None and engine.get("gpu_share") is None:
                    engine["gpu_share"] = share
            operator = LLMOperator(options.model, **engine)
            _engines[key] = operator
            _constructions[key] = _constructions.get(key, 0) + 1
        return operator


def _release_other_devices(key: tuple) -> None:
    """Drop this process's engines for the same model and options on other devices (not
    one running a partition now), close their backends and free the CUDA cache. Called
    with ``_engines_lock`` held."""
    stale = [other for other in _engines if other[:-1] == key[:-1] and other[-1] != key[-1]]
    released = False
    for other in stale:
        lock = _partition_locks.get(id(_engines[other]))
        if lock is not None and lock.locked():
            continue  # busy in another thread (in-process workers on several GPUs): keep it
        operator = _engines.pop(other)
        _partition_locks.pop(id(operator), None)
        close = getattr(getattr(operator, "_backend", None), "close", None)
        if callable(close):
            close()  # vLLM: shuts its engine down
        logger.info("released the engine on %s for the one on %s", other[-1], key[-1])
        del operator
        released = True
    if released:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_constructions(key: tuple | None = None) -> int:
    """How many operators this process has built, in all or for one `engine_key` (tests, logs)."""
    if key is None:
        return sum(_constructions.values())
    return _constructions.get(key, 0)


# -- running one partition --------------------------------------------------------
def partition_prompts(
    values: Sequence[Any],
    options: InferOptions,
    chat_template: bool,
    constraints: Sequence[Any] | None = None,
) -> tuple[list[Any], SamplingParams | list[SamplingParams], list[int] | None, dict[int, str]]:
    """A partition's column values as ``generate`` takes them: (prompts, sampling, each
    row's index into the prompts with ``dedupe`` (else None), {prompt index: message} of
    the rows whose constraint value is no valid constraint: they run as missing prompts
    and get that message).

    constraints: with ``options.constraint_col``, each row's value of that column
    (``row_sampling``)."""
    values = [None if is_missing(v) else v for v in values]
    sampling: list[SamplingParams | str] | None = None
    if options.constraint_col is not None:
        if constraints is None or len(constraints) != len(values):
            raise ValueError(
                f"{options.constraint_col[0]}_col: give one constraint value per row "
                f"({len(values)} rows, {None if constraints is None else len(constraints)} values)"
            )
        sampling = row_sampling(options, list(constraints))
    distinct, positions = values, None
    if options.dedupe:
        distinct, positions = dedupe(values)
        if sampling is not None:  # a distinct row is a distinct (prompt, constraint)
            # rows of equal constraint values share one SamplingParams (row_sampling)
            firsts, positions = distinct_with(positions, [id(s) for s in sampling])
            distinct, sampling = [values[i] for i in firsts], [sampling[i] for i in firsts]
    prompts = options.prompts(distinct, chat_template)
    if sampling is None:
        return prompts, options.sampling, positions, {}
    bad = {i: given for i, given in enumerate(sampling) if isinstance(given, str)}
    for i in bad:
        prompts[i] = None
    rows = [options.sampling if isinstance(s, str) else s for s in sampling]
    return prompts, rows, positions, bad


def run_partition(
    values: Sequence[Any],
    options: InferOptions,
    *,
    device: str | None = None,
    label: str = "partition",
    constraints: Sequence[Any] | None = None,
):
    """Generate for one partition's prompts (one plan over all of them); results in order.

    constraints: with ``options.constraint_col``, each row's value of that column
    (``row_sampling``); a row whose value is no valid constraint is an error row."""
    started = time.perf_counter()
    if not len(values):
        return []
    operator = get_operator(options, device)
    lock = _partition_lock(operator)
    with lock:  # one generate at a time per engine (threaded workers share it)
        prompts, sampling, positions, bad = partition_prompts(
            values, options, operator.has_chat_template, constraints
        )
        results = list(operator.generate(prompts, sampling))
        for i, message in bad.items():  # a bad constraint ran as a missing prompt
            results[i] = GenerationResult.failed(message)
        stats = operator.last_stats
    if positions is not None:
        results = [results[i] for i in positions]
    _record(operator, stats, options, label, len(values), len(prompts), started)
    logger.info(
        "%s: %d rows%s (%d errors%s), %d prompt tokens, %d prefilled, %d output tokens, "
        "%.2f s, saving ratio %.1f%%",
        label,
        len(values),
        f", {len(prompts)} distinct prompts" if positions is not None else "",
        stats.error_rows,
        f", {stats.invalid_rows} constrained outputs cut by max_tokens before they were valid"
        if stats.invalid_rows
        else "",
        stats.prompt_tokens,
        stats.prefill_tokens_computed,
        stats.output_tokens,
        time.perf_counter() - started,
        100 * stats.saving_ratio,
    )
    if stats.server_prompt_tokens:
        logger.info(
            "%s: model server: %d prompt tokens, %d from its prefix cache, %d generated",
            label,
            stats.server_prompt_tokens,
            stats.server_cached_tokens,
            stats.server_completion_tokens,
        )
    return results


def run_embed_partition(
    values: Sequence[Any],
    options: EmbedOptions,
    *,
    device: str | None = None,
    label: str = "partition",
):
    """Embed one partition's prompts (one plan over all of them, on the worker's engine):
    one ``EmbeddingResult`` per row, in order. Missing values are error rows; strings are
    embedded as they are (no chat template), chat message lists through it."""
    started = time.perf_counter()
    if not len(values):
        return []
    operator = get_operator(options, device)
    with _partition_lock(operator):
        results = operator.embed(
            [None if is_missing(v) else v for v in values],
            pooling=options.pooling,
            normalize=options.normalize,
            dimensions=options.dimensions,
        )
        stats = operator.last_stats
    _record(operator, stats, options, label, len(values), len(values), started)
    logger.info(
        "%s: %d rows embedded (%d errors), %d prompt tokens, %d prefilled, %.2f s, "
        "saving ratio %.1f%%",
        label,
        len(values),
        stats.error_rows,
        stats.prompt_tokens,
        stats.prefill_tokens_computed,
        time.perf_counter() - started,
        100 * stats.saving_ratio,
    )
    return results


def show_worker_logs() -> None:
    """On a worker process (a Spark executor's Python worker, a Dask worker): send the
    per-partition INFO lines to its stderr (the executor or worker log), unless the
    process's logging sends them somewhere already; a level set on the logger is kept
    (other handlers, such as Dask's forwarding to the client, then see the lines too)."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    streams = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    if streams or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s")
    )
    logger.addHandler(handler)


def _record(operator, stats, options, label: str, rows: int, distinct: int, started: float):
    """After a partition: the worker's engine paths logged once per engine, and the
    partition's JSON line of statistics where ``stats_log`` asks for one."""
    if stats.engine_paths and id(operator) not in _described:
        _described.add(id(operator))
        logger.info("this worker's engine: %s", stats.engine_paths)
    if options.engine.stats_log:
        seconds = time.perf_counter() - started
        _log_stats(options.engine.stats_log, label, rows, distinct, stats, seconds)


def _log_stats(path: str, label: str, rows: int, distinct: int, stats: Any, seconds: float):
    """One JSON line of a partition's statistics appended to ``path`` (``stats_log``)."""
    line = json.dumps(
        {
            "label": label,
            "rows": rows,
            "distinct_prompts": distinct,
            "prompt_tokens": stats.prompt_tokens,
            "prefill_tokens": stats.prefill_tokens_computed,
            "output_tokens": stats.output_tokens,
            "error_rows": stats.error_rows,
            "invalid_rows": stats.invalid_rows,
            "server_prompt_tokens": stats.server_prompt_tokens,
            "server_cached_tokens": stats.server_cached_tokens,
            "server_completion_tokens": stats.server_completion_tokens,
            "seconds": round(seconds, 3),
            "pid": os.getpid(),
        }
    )
    with open(path, "a", encoding="utf-8") as f:  # one short write per line: appends whole
        f.write(line + "\n")


_partition_locks: dict[int, threading.Lock] = {}
_described: set[int] = set()  # engines whose paths a worker's log has shown


def _partition_lock(operator) -> threading.Lock:
    with _engines_lock:
        return _partition_locks.setdefault(id(operator), threading.Lock())


def result_records(
    results, value_type: ValueType | None = None, parsed: Sequence[bool] | None = None
) -> list[dict[str, Any]]:
    """One dict per result: the RESULT_FIELDS, and with ``value_type`` the row's JSON
    text parsed as that type under VALUE_FIELD (None where it does not parse or fit; then
    ``error`` says why, unless the engine's own message is there already). ``parsed``: per
    row, whether its text is JSON to parse (json_schema_col: the rows given a schema)."""
    records = [{name: getattr(r, name) for name, _ in RESULT_FIELDS} for r in results]
    if value_type is not None:
        for row, record in enumerate(records):
            record[VALUE_FIELD] = None
            if parsed is not None and not parsed[row]:
                continue
            if record["finish_reason"] == "error" or record["error"] is not None:
                continue  # no text, or the engine said why it is not valid
            record[VALUE_FIELD], why = parse_value(record["text"], value_type)
            if why is not None:
                record["error"] = why
    return records
