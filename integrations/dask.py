"""Dask: ``llm_infer`` adds generated columns to a dask DataFrame, the rows that share a
prompt prefix co-located for the run (``co_locate``) and put back in order after it.

>>> ddf = llm_infer(ddf, "prompt", output="out", model="smollm2-135m-instruct", max_tokens=32)
>>> ddf[["prompt", "out", "out_finish_reason"]].compute()
>>> llm_estimate(ddf, "prompt", model="smollm2-135m-instruct", max_tokens=32, executors=8).report()

One partition is one batch: a single ``LLMOperator.generate`` call, planned over all of
the partition's prompts, on the worker process's cached engine (one per process, shared
by its threads). Options are checked on the client before any model loads, and the
tasks capture only an ``InferOptions`` (the model loads on the worker). ``llm_estimate``
predicts such a job's time before it runs: a sample of rows generated on the client, every
partition tokenized and planned on the workers (no model there).
``llm_embed`` adds each row's vector instead (``LLMOperator.embed``), planned, cached and
co-located the same way.

This module is ``llm_operator.integrations.dask``; ``import dask.dataframe`` below is an
absolute import of the real dask package (Python 3 has no implicit relative imports).
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa

from llm_operator.integrations.co_location import (
    CoLocation,
    PrefixPartitioner,
    plan_co_location,
)
from llm_operator.integrations.estimate_frames import (
    PREDICTION_FIELDS,
    check_estimate_options,
    driver_inputs,
    frame_estimate,
    oversampled_fraction,
    predict_partition,
    sample_size,
)
from llm_operator.integrations.infer_options import (
    RESULT_FIELDS,
    VALUE_FIELD,
    InferOptions,
    check_prompt_source,
    check_server,
    is_missing,
    make_options,
    typed_value,
)
from llm_operator.integrations.json_values import ANY, ValueType
from llm_operator.integrations.worker import logger, result_records, run_partition, show_worker_logs
from llm_operator.options import SCOPES, keyword_signature

if TYPE_CHECKING:
    from llm_operator.estimate import CostInputs, Estimate

# Text results use the dtype dask itself gives text columns (its "convert-string" default).
STRING_DTYPE = pd.StringDtype("pyarrow")

# Helper columns of co_locate, dropped before it returns.
_PARTITION = "__llm_operator_partition__"  # the target partition of each row
_ORDER = "__llm_operator_order__"  # input order: (input partition << 32) | row in it
_INDEX = "__llm_operator_index__"  # the original index, restored at the end
_PROMPT = "__llm_operator_prompt__"  # prompts rendered from template= or columns=


_DTYPES = {
    str: STRING_DTYPE,
    int: np.dtype("int64"),
    float: np.dtype("float64"),
    dict: np.dtype(object),
}


def result_columns(output: str, value: bool = False) -> dict[str, tuple[str, Any]]:
    """Result field -> (column name, dtype): ``text`` is ``{output}``, others ``{output}_{field}``;
    with ``value``, the parsed JSON too (``{output}_value``, Python objects)."""
    columns = {
        field: (output if field == "text" else f"{output}_{field}", _DTYPES[python_type])
        for field, python_type in RESULT_FIELDS
    }
    if value:
        columns[VALUE_FIELD] = (f"{output}_{VALUE_FIELD}", np.dtype(object))
    return columns


def llm_infer(
    ddf: dd.DataFrame,
    col: Hashable | None = None,
    *,
    output: str = "out",
    model: Any,
    engine_options: Mapping[str, Any] | None = None,
    value: bool = True,
    choices_col: Hashable | None = None,
    regex_col: Hashable | None = None,
    json_schema_col: Hashable | None = None,
    **options: Any,
) -> dd.DataFrame:
    """``ddf`` with the generated columns added (lazy; nothing runs until compute).

    Adds ``{output}`` (the text), ``{output}_finish_reason`` ("stop" | "length" | "error"),
    ``{output}_prompt_tokens``, ``{output}_completion_tokens`` (int64),
    ``{output}_error`` (a message on error rows, else missing), ``{output}_logprob``
    (float64: the output's log-probability under the unconstrained model with
    ``logprobs=True``, else NaN) and ``{output}_choice_logprobs`` (objects: a dict
    choice -> log-probability with ``choices`` and ``logprobs``, else None). With
    ``json_schema`` (and ``value``), ``{output}_value`` holds each row's JSON parsed
    into Python objects (dicts with every declared property, None for absent ones;
    typed and checked as Spark's ``value`` is, see ``llm_operator.integrations.json_values``;
    parts of the schema with no single type, e.g. ``anyOf``, are kept as parsed). A
    row whose text is not valid JSON or does not fit gets None and ``{output}_error``
    says why. Text columns are ``string[pyarrow]``. Index, divisions and row order are kept.

    col: a column of strings (string or object dtype); with ``chat=True`` (or a
        ``system`` prompt) each string becomes a user message. Missing and empty
        prompts become error rows; they never fail the partition. Or None, with
        ``template="... {title} ..."`` or ``columns=[...]`` (and ``instruction``): each
        row's prompt is rendered from its columns (``dask_tables``; nulls render
        empty). Missing columns (ValueError) and dtypes that do not render (TypeError)
        are refused here, before anything runs.
    co_locate (default True): rows sharing a prompt prefix move into one partition for
        the run (``co_locate``: skipped when a sample shows the prompts share no
        prefixes or the partitions keep each group together already; the decision, the
        rows moved and the sharing it buys are logged, logger
        ``llm_operator.integrations``), then go back to their partitions in their
        order: the result has ``ddf``'s partitions, index, order and divisions either
        way. Costs a sample pass and, when it runs, two shuffles. False: each partition
        runs as it is.
    reorder_fields: two passes of statistics (``dask_tables.plan_table``: row count and
        mean lengths, then distinct counts of field sets) choose the order of the movable
        field lines that shares the most prefix; the prompts render in it and rows are
        co-located by them (always).
    dedupe: rows are co-located by the prompt (always) and each partition computes each
        distinct prompt once; identical prompts get identical outputs.
    model and the engine options: which engine each worker process builds once and reuses
        (``LLMOperator`` arguments; ``engine_options`` takes them as a mapping too).
    options: every engine, sampling and prompt option (``llm_operator.options``),
        constrained outputs included: ``choices``, ``regex``, ``json_schema``, ``logprobs``.
    choices_col, regex_col, json_schema_col: a column holding each row's constraint, so
        one call serves several tasks: ``choices_col`` a list, tuple or array of strings
        per row (or text: a JSON list or comma-separated labels), ``regex_col`` a string,
        ``json_schema_col`` a dict or JSON text. A missing value leaves that row
        unconstrained; a value that is no valid constraint (an empty or duplicated label
        list, a regex or schema the grammar engine cannot compile) makes that row an error
        row (``{output}_error`` names the column and the problem). At most one of these
        and ``choices``/``regex``/``json_schema`` per call. With ``json_schema_col`` (and
        ``value``), ``{output}_value`` holds the parsed JSON of the rows given a schema
        (untyped: as ``json.loads`` gives it), None on the others.
    """
    if not isinstance(output, str) or not output:
        raise TypeError(f"output must be a non-empty string, got {output!r}")
    schema = options.get("json_schema")  # as given: its property order
    options = make_options(
        model=model,
        engine_options=engine_options,
        choices_col=choices_col,
        regex_col=regex_col,
        json_schema_col=json_schema_col,
        **options,
    )
    value_type = typed_value(schema, value, untyped=True)
    if value and options.constraint_col is not None and options.constraint_col[0] == "json_schema":
        value_type = ANY  # each row's own schema: the parsed JSON as it is
    columns = result_columns(output, value_type is not None)
    check_prompt_source(col, options)
    check_server(options)  # backend "openai": the server answers, with that model
    if options.table is not None:
        if not isinstance(ddf, dd.DataFrame):
            raise TypeError(f"ddf must be a dask.dataframe.DataFrame, got {type(ddf).__name__}")
    else:
        _check_prompt_column(ddf, col)
    if options.constraint_col is not None and options.constraint_col[1] not in ddf.columns:
        kind, name = options.constraint_col
        raise ValueError(
            f"{kind}_col={name!r} is not a column of ddf; columns: {list(ddf.columns)}"
        )
    existing = [name for name, _ in columns.values() if name in ddf.columns]
    if existing:
        raise ValueError(
            f"output={output!r} would overwrite existing column(s) {existing}; choose another output"
        )
    frame, key = ddf, col
    if options.table is not None:
        frame, key = _rendered(ddf, options)
    meta = _with_results(frame._meta, [], output, value_type is not None)
    if not (options.co_locate or options.dedupe or options.reorder_fields):
        result = frame.map_partitions(_infer_partition, key, options, output, value_type, meta=meta)
        return result.drop(columns=[_PROMPT]) if key == _PROMPT else result
    # rows sharing a prefix meet (identical and like prompts always, with dedupe and
    # reorder_fields), run, then go back to their partitions in their order
    placed, decision = _co_locate(
        frame, key, force=options.dedupe or options.reorder_fields, keep_order=True
    )
    logger.info("llm_infer %s", decision.report())
    if decision.skipped is not None:
        result = frame.map_partitions(_infer_partition, key, options, output, value_type, meta=meta)
    else:
        placed_meta = _with_results(placed._meta, [], output, value_type is not None)
        ran = placed.map_partitions(
            _infer_partition, key, options, output, value_type, meta=placed_meta
        )
        result = _back_in_order(ran, frame)
    return result.drop(columns=[_PROMPT]) if key == _PROMPT else result


def _rendered(ddf: dd.DataFrame, options: InferOptions) -> tuple[dd.DataFrame, str]:
    """``ddf`` plus the rendered prompt column (in the chosen order with reorder_fields)."""
    from llm_operator.integrations.dask_tables import check_table, plan_table, render_partition

    if _PROMPT in ddf.columns:
        raise ValueError(f"ddf has llm_infer's reserved column {_PROMPT!r}; rename it")
    prompt = options.table
    check_table(ddf, prompt)
    if options.reorder_fields:
        plan = plan_table(ddf, prompt)
        logger.info("llm_infer fields:\n%s", plan.report())
        prompt = plan.chosen
    rendered = ddf.map_partitions(render_partition, prompt, meta=(_PROMPT, object))
    return ddf.assign(**{_PROMPT: rendered}), _PROMPT


keyword_signature(llm_infer, SCOPES)


def _infer_partition(
    frame: pd.DataFrame,
    col: Hashable,
    options: InferOptions,
    output: str,
    value_type: ValueType | None = None,
    partition_info: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """One partition, one ``run_partition`` call (runs on the worker)."""
    label = "dask partition"
    if partition_info is not None:
        label = f"dask partition {partition_info['number']}"
    from llm_operator.integrations.devices import current_dask_worker, dask_worker_device

    if current_dask_worker() is not None:
        show_worker_logs()  # one line per partition in the worker's log, as Spark's executors

    device = dask_worker_device(options.engine.device)  # None: the option's device
    extra: dict[str, Any] = {}
    parsed = None
    constraint_col = options.constraint_col
    if constraint_col is not None:  # each row's constraint, from its column
        extra["constraints"] = frame[constraint_col[1]].tolist()
        if constraint_col[0] == "json_schema":  # parse only rows given a schema
            parsed = [not is_missing(c) for c in extra["constraints"]]
    results = run_partition(frame[col].tolist(), options, device=device, label=label, **extra)
    records = result_records(results, value_type, parsed)
    return _with_results(frame, records, output, value_type is not None)


def _with_results(
    frame: pd.DataFrame, records: Sequence[Mapping[str, Any]], output: str, value: bool = False
) -> pd.DataFrame:
    """``frame`` plus the result columns, filled positionally from ``records``."""
    assert len(records) == len(frame), "one result record per row"
    result = frame.copy(deep=False)
    for field, (name, dtype) in result_columns(output, value).items():
        values = [record[field] for record in records]
        if dtype == STRING_DTYPE:
            result[name] = pd.array(values, dtype=STRING_DTYPE)
        elif dtype.kind == "O":  # dicts and lists stay Python objects, one per row
            column = np.empty(len(values), dtype=object)
            for row, item in enumerate(values):
                column[row] = item
            result[name] = column
        elif dtype.kind == "f":  # None -> NaN
            result[name] = np.asarray([np.nan if v is None else v for v in values], dtype=dtype)
        else:
            result[name] = np.asarray(values, dtype=dtype)
    return result


def embedding_columns(output: str, width: int | None) -> dict[str, tuple[str, Any]]:
    """Embedding field -> (column name, dtype): the vector is ``{output}`` (Arrow
    ``fixed_size_list<float>[width]``, or ``list<float>`` where the width is not known before
    the job), then ``{output}_prompt_tokens`` (int64) and ``{output}_error`` (text)."""
    vector = pa.list_(pa.float32(), width) if width is not None else pa.list_(pa.float32())
    return {
        "embedding": (output, pd.ArrowDtype(vector)),
        "prompt_tokens": (f"{output}_prompt_tokens", np.dtype("int64")),
        "error": (f"{output}_error", STRING_DTYPE),
    }


def llm_embed(
    ddf: dd.DataFrame,
    col: Hashable,
    *,
    output: str = "embedding",
    model: Any,
    pooling: str = "last",
    normalize: bool = True,
    dimensions: int | None = None,
    co_locate: bool = True,
    engine_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> dd.DataFrame:
    """``ddf`` with each row's vector added (lazy; nothing runs until compute).

    Adds ``{output}``: the vector, an Arrow-backed column of ``fixed_size_list<float>[d]``
    where ``d`` is known on the client (``dimensions``, or the model's hidden size from a
    model directory or the local Hub cache), else ``list<float>``; missing where the row
    could not run (missing, empty, too long for the model, not a prompt), and then
    ``{output}_error`` says why. ``{output}_prompt_tokens`` (int64). Index, divisions and
    row order are kept.

    col: a column of strings (embedded as they are: no chat template).
    pooling: ``"last"``, ``"mean"`` or ``"cls"``; normalize: unit-length vectors;
        dimensions: the first that many values (Matryoshka), before normalizing.
    co_locate (default True): rows sharing a prompt prefix meet in one partition for the
        run and go back to their partitions in their order afterwards, as ``llm_infer``
        does (skipped where a sample shows it cannot help; the decision is logged).
    options: engine options only (``llm_operator.options``, scope ``engine``;
        ``engine_options`` takes them as a mapping); an unknown name is a TypeError.
    Each partition is one ``LLMOperator.embed`` call on the worker process's cached engine.
    """
    from llm_operator.integrations.infer_options import embedding_width, make_embed_options

    if not isinstance(output, str) or not output:
        raise TypeError(f"output must be a non-empty string, got {output!r}")
    checked = make_embed_options(
        model=model,
        pooling=pooling,
        normalize=normalize,
        dimensions=dimensions,
        co_locate=co_locate,
        engine_options=engine_options,
        **options,
    )
    _check_prompt_column(ddf, col)
    width = embedding_width(checked)
    existing = [
        name for name, _ in embedding_columns(output, width).values() if name in ddf.columns
    ]
    if existing:
        raise ValueError(
            f"output={output!r} would overwrite existing column(s) {existing}; choose another output"
        )
    meta = _with_embeddings(ddf._meta, [], output, width)
    if checked.co_locate:
        placed, decision = _co_locate(ddf, col, keep_order=True)
        logger.info("llm_embed %s", decision.report())
        if decision.skipped is None:
            placed_meta = _with_embeddings(placed._meta, [], output, width)
            ran = placed.map_partitions(
                _embed_partition, col, checked, output, width, meta=placed_meta
            )
            return _back_in_order(ran, ddf)
    return ddf.map_partitions(_embed_partition, col, checked, output, width, meta=meta)


keyword_signature(llm_embed, ["engine"])


def _embed_partition(
    frame: pd.DataFrame,
    col: Hashable,
    options: Any,
    output: str,
    width: int | None,
    partition_info: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """One partition, one ``run_embed_partition`` call (runs on the worker)."""
    from llm_operator.integrations.devices import current_dask_worker, dask_worker_device
    from llm_operator.integrations.worker import run_embed_partition

    label = "dask partition"
    if partition_info is not None:
        label = f"dask partition {partition_info['number']}"
    if current_dask_worker() is not None:
        show_worker_logs()
    device = dask_worker_device(options.engine.device)  # None: the option's device
    results = run_embed_partition(frame[col].tolist(), options, device=device, label=label)
    return _with_embeddings(frame, results, output, width)


def _with_embeddings(
    frame: pd.DataFrame, results: Sequence[Any], output: str, width: int | None
) -> pd.DataFrame:
    """``frame`` plus the embedding columns, filled positionally from ``results``."""
    assert len(results) == len(frame), "one embedding result per row"
    result = frame.copy(deep=False)
    columns = embedding_columns(output, width)
    name, dtype = columns["embedding"]
    vectors = pa.array([r.embedding for r in results], type=dtype.pyarrow_dtype)
    result[name] = pd.array(vectors, dtype=dtype)
    name, dtype = columns["prompt_tokens"]
    result[name] = np.asarray([r.prompt_tokens for r in results], dtype=dtype)
    name, dtype = columns["error"]
    result[name] = pd.array([r.error for r in results], dtype=dtype)
    return result


def llm_estimate(
    ddf: dd.DataFrame,
    col: Hashable | None = None,
    *,
    model: Any,
    sample_rows: int | str = "auto",
    executors: int = 1,
    seed: int = 0,
    recalibrate: bool = False,
    engine_options: Mapping[str, Any] | None = None,
    choices_col: Hashable | None = None,
    regex_col: Hashable | None = None,
    json_schema_col: Hashable | None = None,
    **options: Any,
) -> Estimate:
    """What ``llm_infer(ddf, col, **options)`` would cost, predicted without running it
    whole: an ``llm_operator.estimate.Estimate`` (``report()`` prints it; ``as_dict()``
    is JSON-ready) with the rows, tokens, seconds on one machine (and a range), on
    ``executors`` machines, and machine-hours.

    col and options: as ``llm_infer`` takes them (a prompt column, or ``template=`` /
        ``columns=``, ``chat``, ``system``, sampling, constraint and engine options);
        with ``reorder_fields`` the prompts render in the order ``plan_table`` chooses.
    sample_rows: rows the client samples and generates for their output lengths ("auto":
        2% of the rows, 4 to 64; 0: none, every row then runs to its max_tokens).
        seed: which rows (``ddf.sample``); not the sampling seed.
    executors: workers the partitions are spread over (longest first, whole): the
        Estimate's ``executor_seconds`` is the slowest one's time.
    recalibrate: measure the backend again rather than read its cached calibration.

    Three passes: the row count, the sample (to the client), and one task per partition
    that renders, tokenizes and plans its prompts exactly as ``llm_infer`` would
    (``predict_prompts``, with an operator that never loads the model) and returns one
    row. The client loads the model (kept for the next estimate with these options),
    calibrates it once (cached under ``cache_dir`` / ``LLM_OPERATOR_CACHE``) and assumes
    the workers are machines like it. Partitions are predicted as they are: with
    ``dedupe`` or ``reorder_fields``, which co-locate the rows first in ``llm_infer``,
    ``co_locate`` the frame first to estimate that. ValueError for a bad ``sample_rows``
    or ``executors``, before anything runs.
    """
    started = time.perf_counter()
    check_estimate_options(sample_rows, executors, seed)
    checked = make_options(
        model=model,
        engine_options=engine_options,
        choices_col=choices_col,
        regex_col=regex_col,
        json_schema_col=json_schema_col,
        **options,
    )
    check_prompt_source(col, checked)
    if checked.table is not None:
        if not isinstance(ddf, dd.DataFrame):
            raise TypeError(f"ddf must be a dask.dataframe.DataFrame, got {type(ddf).__name__}")
    else:
        _check_prompt_column(ddf, col)
    constraint = None
    if checked.constraint_col is not None:
        kind, constraint = checked.constraint_col
        if constraint not in ddf.columns:
            raise ValueError(
                f"{kind}_col={constraint!r} is not a column of ddf; columns: {list(ddf.columns)}"
            )
    frame, key = ddf, col
    if checked.table is not None:
        frame, key = _rendered(ddf, checked)
    frame = frame[[key] if constraint is None or constraint == key else [key, constraint]]
    total = len(ddf)  # (the frame's rows, without rendering its prompts)
    sampled = _sample_rows(frame, key, sample_size(sample_rows, total), total, seed)
    constraints = None if constraint is None else sampled[constraint].tolist()
    inputs, sample, load_seconds = driver_inputs(
        sampled[key].tolist(), checked, constraints, seed=seed, recalibrate=recalibrate
    )
    meta = _prediction_frame({name: kind() for name, kind in PREDICTION_FIELDS}).iloc[:0]
    predicted = frame.map_partitions(
        _predict_partition, key, constraint, checked, inputs, meta=meta
    ).compute()
    partitions = predicted.sort_values("partition").to_dict("records")
    estimate = frame_estimate(
        partitions,
        inputs,
        sample,
        checked,
        executors=executors,
        started=started,
        load_seconds=load_seconds,
        engine="Dask",
    )
    logger.info(
        "llm_estimate: %d rows in %d partitions, %.1f s on one machine (slowest partition %.1f s)",
        estimate.rows,
        len(partitions),
        estimate.seconds,
        max((p["seconds"] for p in partitions), default=0.0),
    )
    return estimate


keyword_signature(llm_estimate, SCOPES)


def _sample_rows(
    frame: dd.DataFrame, key: Hashable, wanted: int, total: int, seed: int
) -> pd.DataFrame:
    """``wanted`` rows with a prompt, chosen at random (the same for the same ``seed`` and
    input): a seeded ``ddf.sample`` a little larger than needed, cut to ``wanted``; a
    larger fraction when it came out short."""
    present = frame[frame[key].notnull()]
    if wanted <= 0:
        return present._meta
    state = seed % 2**32
    fraction = oversampled_fraction(wanted, total)
    while True:
        picked = present if fraction >= 1 else present.sample(frac=fraction, random_state=state)
        rows = picked.compute()
        if len(rows) >= wanted or fraction >= 1:
            return rows.sample(n=min(wanted, len(rows)), random_state=state)
        fraction = min(1.0, 4 * fraction)


def _predict_partition(
    frame: pd.DataFrame,
    key: Hashable,
    constraint: Hashable | None,
    options: InferOptions,
    inputs: CostInputs,
    partition_info: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """``llm_estimate``'s task: one partition predicted (``predict_partition``), one row."""
    number = 0 if partition_info is None else partition_info["number"]
    constraints = None if constraint is None else frame[constraint].tolist()
    return _prediction_frame(
        predict_partition(frame[key].tolist(), options, inputs, constraints, number)
    )


def _prediction_frame(predicted: Mapping[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            name: pd.Series([predicted[name]], dtype="int64" if kind is int else "float64")
            for name, kind in PREDICTION_FIELDS
        }
    )


def co_locate(
    ddf: dd.DataFrame,
    col: Hashable,
    npartitions: int | None = None,
    *,
    sample_size: int = 2000,
    min_prefix_chars: int = 32,
    seed: int = 0,
) -> dd.DataFrame:
    """``ddf`` repartitioned so rows sharing a prompt prefix meet, each partition sorted.

    Each partition of ``llm_infer`` is planned on its own, so a prefix is computed
    once per partition that holds it. Sorting helps within a partition
    (lexicographic order is the depth-first order of the prefix tree), but a range
    partitioning on the prompt splits any group that straddles a boundary, and
    arbitrary input partitions scatter a group over all of them. Here a
    deterministic sample of ``sample_size`` prompts is cut where it branches
    (``build_partitioner``): runs sharing at least ``min_prefix_chars`` characters
    are groups, packed into ``npartitions`` (default: ``ddf.npartitions``) partitions,
    largest first, so sizes stay balanced. Every row then moves to exactly its
    group's partition (a range shuffle on the partition number, not a hash), and
    each partition is sorted by the prompt (equal prompts keep their input order;
    missing prompts go to partition 0, last).

    It pays when the prompts share long prefixes (instructions, few-shot examples, a
    document asked several questions) and the input order mixes them; it costs a
    sample pass over ``ddf`` (persist an expensive input first) and a shuffle.
    ``llm_infer`` does it for you unless a sample shows it cannot help, and puts the
    rows back in their partitions and order afterwards.

    The result keeps the columns and each row's original index label (so results can
    be joined back), but the index is no longer sorted: divisions are unknown.
    """
    return _co_locate(
        ddf, col, npartitions, sample_size=sample_size, min_prefix_chars=min_prefix_chars,
        seed=seed, force=True,
    )[0]  # fmt: skip


def co_locate_if_it_helps(
    ddf: dd.DataFrame,
    col: Hashable,
    npartitions: int | None = None,
    *,
    sample_size: int = 2000,
    min_prefix_chars: int = 32,
    seed: int = 0,
) -> tuple[dd.DataFrame, CoLocation]:
    """``co_locate(ddf, col, ...)``, unless a sample of the rows, each with the partition
    it is in, shows that it cannot help: the prompts share no prefixes, or the partitions
    keep each group together already (``co_location.plan_co_location``). Returns the
    frame (``ddf`` itself when skipped) and the decision, whose ``report()`` says how many
    rows moved and what one plan over the frame shares against its partitions as they
    came. Message-list prompts are keyed by their JSON."""
    return _co_locate(
        ddf, col, npartitions, sample_size=sample_size, min_prefix_chars=min_prefix_chars,
        seed=seed,
    )  # fmt: skip


def _co_locate(
    ddf: dd.DataFrame,
    col: Hashable,
    npartitions: int | None = None,
    *,
    sample_size: int = 2000,
    min_prefix_chars: int = 32,
    seed: int = 0,
    force: bool = False,
    keep_order: bool = False,
) -> tuple[dd.DataFrame, CoLocation]:
    """``co_locate`` and its decision (``co_location.plan_co_location``): ``ddf`` as it
    came when the sample shows co-locating cannot help (unless ``force``). Prompts that
    are message lists are keyed by their JSON. ``keep_order``: the placed frame keeps the
    helper columns ``_ORDER`` and ``_INDEX`` (``_back_in_order`` uses them) and its index
    is the target partition."""
    if not isinstance(ddf, dd.DataFrame):
        raise TypeError(f"ddf must be a dask.dataframe.DataFrame, got {type(ddf).__name__}")
    _check_prompt_column(ddf, col)
    if npartitions is None:
        npartitions = ddf.npartitions
    _check_int("npartitions", npartitions, minimum=1)
    _check_int("sample_size", sample_size, minimum=1)
    _check_int("min_prefix_chars", min_prefix_chars, minimum=1)
    _check_int("seed", seed, minimum=0)
    clashes = [name for name in (_PARTITION, _ORDER, _INDEX) if name in ddf.columns]
    if clashes:
        raise ValueError(f"ddf has co_locate's reserved column(s) {clashes}; rename them")
    started = time.perf_counter()
    sample, rows = _sample_prompts(ddf[col], sample_size, seed)
    decision = plan_co_location(
        sample, npartitions, rows=rows, min_prefix_chars=min_prefix_chars, force=force
    )
    decision = decision._replace(seconds=time.perf_counter() - started)
    if decision.skipped is not None:
        return ddf, decision
    partitioner = decision.partitioner
    tagged = ddf.map_partitions(
        _tag_partition, col, partitioner, meta=_tag_partition(ddf._meta, col, partitioner)
    )
    # divisions [0, 1, ..., n-1, n-1]: partition i holds exactly the key i
    placed = tagged.set_index(_PARTITION, divisions=[*range(npartitions), npartitions - 1])
    if keep_order:
        meta = _sort_partition(placed._meta, col, None, keep=True)
        sorted_ = placed.map_partitions(_sort_partition, col, None, True, meta=meta)
        return sorted_, decision
    return placed.map_partitions(
        _sort_partition, col, ddf._meta.index.name, meta=ddf._meta, clear_divisions=True
    ), decision


def _back_in_order(placed: dd.DataFrame, original: dd.DataFrame) -> dd.DataFrame:
    """Rows placed by ``_co_locate(keep_order=True)`` (and their results) back in the
    partitions and the order ``original`` had them, with its index (and divisions, when
    it knew them): a range shuffle on the input order, then the index restored."""
    count = original.npartitions
    divisions = [number << 32 for number in range(count)] + [((count - 1) << 32) + (1 << 32) - 1]
    ordered = placed.set_index(_ORDER, divisions=divisions)
    name = original._meta.index.name
    if original.known_divisions:  # sorted by it already: no shuffle, the same divisions
        restored = ordered.set_index(_INDEX, sorted=True, divisions=original.divisions)
        return restored.map_partitions(_named_index, name, meta=_named_index(restored._meta, name))
    meta = _restore_index(ordered._meta, name)
    return ordered.map_partitions(_restore_index, name, meta=meta, clear_divisions=True)


def _restore_index(frame: pd.DataFrame, name: Hashable) -> pd.DataFrame:
    return _named_index(frame.set_index(_INDEX), name)


def _named_index(frame: pd.DataFrame, name: Hashable) -> pd.DataFrame:
    return frame.rename_axis(index=name)


def _tag_partition(
    frame: pd.DataFrame,
    col: Hashable,
    partitioner: PrefixPartitioner,
    partition_info: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """Add each row's target partition, input order and original index as columns."""
    number = 0 if partition_info is None else partition_info["number"]
    tagged = frame.copy(deep=False)
    tagged[_PARTITION] = np.fromiter(
        (partitioner(_key_of(prompt)) for prompt in frame[col]), dtype=np.int64, count=len(frame)
    )
    tagged[_ORDER] = (np.int64(number) << 32) + np.arange(len(frame), dtype=np.int64)
    tagged[_INDEX] = frame.index.array
    return tagged


def _sort_partition(
    frame: pd.DataFrame, col: Hashable, index_name: Hashable, keep: bool = False
) -> pd.DataFrame:
    """Sort one placed partition by (prompt, input order); restore the original index
    (``keep``: keep the helper columns and the partition index instead)."""
    prompts = frame[col]
    if prompts.dtype == object:  # non-strings (missing, chat messages) sort by their JSON
        prompts = prompts.map(_key_of).astype(STRING_DTYPE)
    keys = pd.DataFrame({"prompt": prompts.array, "order": frame[_ORDER].to_numpy()})
    positions = keys.sort_values(["prompt", "order"], kind="stable", na_position="last").index
    if keep:
        return frame.iloc[positions.to_numpy()]
    result = frame.iloc[positions.to_numpy()].set_index(_INDEX).drop(columns=[_ORDER])
    result.index.name = index_name
    return result


def _key_of(prompt: Any) -> str | None:
    """What co-location keys a prompt by: the text, or a message list's JSON (the system
    message and shared turns come first); None for anything else (missing prompts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return json.dumps(list(prompt), default=str)
    return None


def _sample_prompts(
    prompts: dd.Series, sample_size: int, seed: int
) -> tuple[list[tuple[Any, int]], int]:
    """A uniform sample without replacement of the keyed prompts, each with the partition
    it is in, the same on every run for the same input; and the rows counted on the way.

    Bottom-k sampling: every prompt gets a random key from a generator seeded by
    (seed, partition number); each partition keeps its ``sample_size`` smallest keys,
    and the client keeps the smallest ``sample_size`` of those. One pass.
    """
    meta = pd.DataFrame(
        {
            "key": pd.Series(dtype="float64"),
            "prompt": pd.Series(dtype=object),
            "part": pd.Series(dtype="int64"),
            "rows": pd.Series(dtype="int64"),
        }
    )
    candidates = prompts.map_partitions(_smallest_keys, sample_size, seed, meta=meta).compute()
    rows = int(candidates.groupby("part")["rows"].first().sum())
    chosen = candidates.sort_values("key", kind="stable").head(sample_size)
    return list(zip(chosen["prompt"].tolist(), chosen["part"].tolist())), rows


def _smallest_keys(
    prompts: pd.Series,
    sample_size: int,
    seed: int,
    partition_info: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    number = 0 if partition_info is None else partition_info["number"]
    keys = np.random.default_rng([seed, number]).random(len(prompts))
    chosen = np.argsort(keys, kind="stable")[:sample_size]
    keyed = np.empty(len(chosen), dtype=object)
    for row, value in enumerate(prompts.iloc[chosen]):
        keyed[row] = _key_of(value)
    return pd.DataFrame(
        {
            "key": keys[chosen],
            "prompt": keyed,
            "part": np.full(len(chosen), number),
            "rows": np.full(len(chosen), len(prompts)),
        },
        index=pd.RangeIndex(len(chosen)),
    )


def _check_prompt_column(ddf: Any, col: Any) -> None:
    if not isinstance(ddf, dd.DataFrame):
        raise TypeError(f"ddf must be a dask.dataframe.DataFrame, got {type(ddf).__name__}")
    if not isinstance(col, Hashable):
        raise TypeError(f"col must be a column name, got {type(col).__name__}")
    if col not in ddf.columns:
        raise ValueError(f"col={col!r} is not a column of ddf; columns: {list(ddf.columns)}")
    dtype = ddf._meta[col].dtype
    if not (pd.api.types.is_object_dtype(dtype) or pd.api.types.is_string_dtype(dtype)):
        raise TypeError(
            f"col={col!r} must hold prompt strings (string or object dtype), got dtype {dtype}"
        )


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
