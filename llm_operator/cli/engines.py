"""Run a list of prompts through the local operator, Spark (local mode) or Dask, for the CLI.

Every engine returns one GenerationResult (``generate``) or EmbeddingResult (``embed``)
per prompt, in input order: the rows carry their position through co-location and are
put back in order at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

ENGINES = ("local", "spark", "dask")
CONSTRAINT_OPTIONS = ("choices_col", "regex_col", "json_schema_col")
_TABLE_COLUMNS = ("row", "prompt", "key")  # the columns _spark and _dask build


class Generated(NamedTuple):
    results: list  # GenerationResult per prompt, in input order
    seconds: float
    stats: Any  # the operator's RunStats on the local engine; None on spark and dask
    co_location: str | None = None  # spark and dask: what co-location did (its report)


def generate(
    prompts: Sequence[Any],
    *,
    engine: str,
    model: str,
    partitions: int = 2,
    scheduler: str | None = None,
    master: str | None = None,
    constraints: Sequence[Any] | None = None,
    **options: Any,
) -> Generated:
    """Results in input order. ``options``: any engine, sampling or prompt option
    (``llm_operator.options``), passed the same way to every engine (``progress`` shows a
    bar of rows on the local engine and of finished partitions on Dask; Spark and Dask
    workers log a line per partition). ``scheduler``: a Dask scheduler address
    (``dask_client``). ``master``: where Spark runs (``spark_session.session``): a master
    URL, or ``sc://host:port`` for Spark Connect; default ``local[partitions]``.
    ``constraints``: with ``choices_col``, ``regex_col`` or ``json_schema_col`` (in
    ``options``), each prompt's constraint value (``constraint_cells``): one call serves
    rows of several tasks, on every engine."""
    _check_engine(engine, partitions)
    from llm_operator.integrations.infer_options import make_options
    from llm_operator.integrations.worker import get_operator, run_partition

    checked = make_options(model=model, **options)  # every option checked before any work
    if checked.constraint_col is not None:
        kind, _ = checked.constraint_col
        if constraints is None or len(constraints) != len(prompts):
            raise ValueError(f"{kind}_col: give one constraint value per prompt")
        constraints = constraint_cells(kind, constraints)
    started = time.perf_counter()
    stats = co_location = None
    if engine == "local":
        operator = get_operator(checked)
        if checked.constraint_col is not None:  # a bad constraint value is that row's error
            results = run_partition(list(prompts), checked, label="local", constraints=constraints)
        else:
            chat_prompts = checked.prompts(list(prompts), operator.has_chat_template)
            results = operator.generate(chat_prompts, checked.sampling)
        stats = operator.last_stats
    else:
        # workers report one log line per partition; their progress bars would interleave
        worker_options = {"model": model, **options, "progress": False}
        if engine == "spark":
            results, co_location = _spark(prompts, worker_options, partitions, master, constraints)
        else:
            progress = checked.engine.progress
            results, co_location = _dask(
                prompts, worker_options, partitions, scheduler, progress, constraints
            )
    return Generated(results, time.perf_counter() - started, stats, co_location)


def _check_engine(engine: str, partitions: int) -> None:
    """ValueError naming a bad ``engine`` or ``partitions`` (``generate``, ``embed``)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")


def embed(
    prompts: Sequence[Any],
    *,
    engine: str,
    model: str,
    partitions: int = 2,
    scheduler: str | None = None,
    master: str | None = None,
    **options: Any,
) -> Generated:
    """One ``EmbeddingResult`` per prompt, in input order, on any engine (as ``generate``).
    ``options``: ``pooling``, ``normalize``, ``dimensions``, ``co_locate`` and the engine
    options (``integrations.infer_options.make_embed_options``). A value that is not text
    is that row's error on every engine."""
    _check_engine(engine, partitions)
    from llm_operator.integrations.infer_options import make_embed_options
    from llm_operator.integrations.worker import get_operator, run_embed_partition

    checked = make_embed_options(model=model, **options)  # every option checked before any work
    texts = [p if isinstance(p, str) else None for p in prompts]
    started = time.perf_counter()
    stats = co_location = None
    if engine == "local":
        results = run_embed_partition(texts, checked, label="local")
        stats = get_operator(checked).last_stats
    else:
        # workers report one log line per partition; their progress bars would interleave
        worker_options = {"model": model, **options, "progress": False}
        if engine == "spark":
            results, co_location = _spark_embed(texts, worker_options, partitions, master)
        else:
            progress = checked.engine.progress
            results, co_location = _dask_embed(
                texts, worker_options, partitions, scheduler, progress
            )
    for row, prompt in enumerate(prompts):  # not text: say what it was
        if prompt is not None and not isinstance(prompt, str):
            results[row] = results[row]._replace(
                error=f"the column must hold text, got {type(prompt).__name__}"
            )
    return Generated(results, time.perf_counter() - started, stats, co_location)


def _spark_embed(
    prompts: Sequence[str | None], embed_kwargs: Mapping[str, Any], partitions: int, master=None
) -> tuple[list, str | None]:
    from llm_operator.embedding import EmbeddingResult
    from llm_operator.integrations.spark import co_locate_if_it_helps, llm_embed
    from llm_operator.integrations.spark_session import session

    spark = session(partitions, master)
    frame = spark.createDataFrame(list(enumerate(prompts)), "row long, prompt string")
    frame = frame.repartition(partitions)
    kwargs = dict(embed_kwargs)
    report = None
    if kwargs.pop("co_locate", True):
        frame, decision = co_locate_if_it_helps(frame, "prompt", partitions)
        report = decision.report()
    out = frame.select("row", llm_embed("prompt", **kwargs).alias("out"))
    rows = sorted(out.collect(), key=lambda r: r["row"])
    results = [
        EmbeddingResult(r.out.embedding, int(r.out.prompt_tokens or 0), r.out.error) for r in rows
    ]
    return results, report


def _dask_embed(
    prompts: Sequence[str | None],
    embed_kwargs: Mapping[str, Any],
    partitions: int,
    scheduler: str | None = None,
    progress: bool = False,
) -> tuple[list, str | None]:
    import dask
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.embedding import EmbeddingResult
    from llm_operator.integrations.dask import co_locate_if_it_helps, llm_embed

    frame = pd.DataFrame(
        {"row": range(len(prompts)), "prompt": pd.Series(list(prompts), dtype=object)}
    )
    client, owned = dask_client(scheduler)
    settings: dict[str, Any] = {"dataframe.convert-string": False}
    if client is None:
        settings["scheduler"] = "threads"
    kwargs = dict(embed_kwargs)
    try:
        with dask.config.set(settings):
            ddf = dd.from_pandas(frame, npartitions=partitions)
            report = None
            if kwargs.pop("co_locate", True):  # the rows are put back in order below
                ddf, decision = co_locate_if_it_helps(ddf, "prompt", partitions)
                report = decision.report()
            ddf = llm_embed(ddf, "prompt", output="out", co_locate=False, **kwargs)
            computed = _compute_with_progress(ddf, client, progress).sort_values("row")
    finally:
        if owned:
            client.close()
    results = [
        EmbeddingResult(
            None if vector is None or vector is pd.NA else [float(v) for v in vector],
            int(tokens),
            None if error is None or error is pd.NA else str(error),
        )
        for vector, tokens, error in zip(
            computed["out"].tolist(),
            computed["out_prompt_tokens"].tolist(),
            computed["out_error"].tolist(),
        )
    ]
    return results, report


def _to_result(record: Mapping[str, Any]):
    """A GenerationResult from a Spark or Dask output record (NaN log-probability: none)."""
    from llm_operator.results import GenerationResult

    logprob, choice_logprobs = record["logprob"], record["choice_logprobs"]
    return GenerationResult(
        text=record["text"] or "",
        token_ids=(),
        finish_reason=record["finish_reason"],
        prompt_tokens=int(record["prompt_tokens"] or 0),
        completion_tokens=int(record["completion_tokens"] or 0),
        error=record["error"] if isinstance(record["error"], str) else None,
        logprob=None if logprob is None or logprob != logprob else float(logprob),
        choice_logprobs=dict(choice_logprobs) if isinstance(choice_logprobs, Mapping) else None,
    )


def _spark(
    prompts: Sequence[Any],
    infer_kwargs: Mapping[str, Any],
    partitions: int,
    master: str | None = None,
    constraints: Sequence[Any] | None = None,
) -> tuple[list, str | None]:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from llm_operator.integrations.spark import co_locate_if_it_helps, llm_infer
    from llm_operator.integrations.spark_session import session

    spark = session(partitions, master)  # local[partitions], a master URL or sc://
    chat = any(isinstance(p, list) for p in prompts)
    message = T.StructType([T.StructField(key, T.StringType()) for key in ("role", "content")])
    prompt_type = T.ArrayType(message) if chat else T.StringType()
    # one Spark column holds one type: other values go in as nulls (_restore_type_errors)
    data = [
        (row, p if isinstance(p, list if chat else str) else None) for row, p in enumerate(prompts)
    ]
    fields = [T.StructField("row", T.LongType()), T.StructField("prompt", prompt_type)]
    if constraints is not None:  # each row's constraint, in a column named as the option says
        infer_kwargs, name = _constraint_column(infer_kwargs)
        cells, cell_type = _spark_cells(constraints)
        fields.append(T.StructField(name, cell_type))
        data = [(*row, cell) for row, cell in zip(data, cells)]
    frame = spark.createDataFrame(data, T.StructType(fields)).repartition(partitions)
    report = None
    if infer_kwargs.get("co_locate", True):
        # chat rows co-locate by their messages as JSON (system and shared turns come first)
        key = F.to_json("prompt") if chat else "prompt"
        frame, decision = co_locate_if_it_helps(frame, key, partitions)
        report = decision.report()
    # the table keeps the JSON text: no typed value (so any schema the engine compiles works)
    out = frame.select("row", llm_infer("prompt", value=False, **infer_kwargs).alias("out"))
    rows = sorted(out.collect(), key=lambda r: r["row"])
    results = [_to_result(r["out"].asDict()) for r in rows]
    return _restore_type_errors(prompts, results, chat=chat), report


def dask_client(scheduler: str | None = None):
    """The ``distributed.Client`` a Dask run uses, or None for the local threads scheduler.

    ``scheduler``: a scheduler address (``tcp://host:8786``) to connect to. Without one, a
    client already made in this process is used, else the address Dask's config gives
    (``DASK_SCHEDULER_ADDRESS`` or ``scheduler-address``); with none of them the job runs
    on local threads. Returns (client, whether this call made it, so should close it).
    """
    import dask

    if scheduler is None:
        try:
            from distributed import default_client

            return default_client(), False
        except (ImportError, ValueError):  # no distributed, or no client yet
            pass
        scheduler = dask.config.get("scheduler-address", None)
        if not scheduler:
            return None, False
    try:
        from distributed import Client
    except ImportError:
        raise ValueError(
            f"a Dask scheduler ({scheduler}) needs the distributed package: "
            "pip install 'dask[distributed]'"
        ) from None
    try:
        return Client(scheduler, timeout="20s"), True
    except OSError as error:
        raise ValueError(
            f"cannot reach the Dask scheduler at {scheduler} ({error}); start one with "
            "`dask scheduler` and workers with `dask worker ADDRESS`, or leave out "
            "--scheduler (and DASK_SCHEDULER_ADDRESS) to run on local threads"
        ) from None


def _dask(
    prompts: Sequence[Any],
    infer_kwargs: Mapping[str, Any],
    partitions: int,
    scheduler: str | None = None,
    progress: bool = False,
    constraints: Sequence[Any] | None = None,
) -> tuple[list, str | None]:
    import dask
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations.dask import co_locate_if_it_helps, llm_infer

    values = [p if isinstance(p, (str, list)) else None for p in prompts]
    frame = pd.DataFrame({"row": range(len(prompts)), "prompt": pd.Series(values, dtype=object)})
    if constraints is not None:  # each row's constraint, in a column named as the option says
        infer_kwargs, name = _constraint_column(infer_kwargs)
        frame[name] = pd.Series(list(constraints), dtype=object)
    client, owned = dask_client(scheduler)
    # keep message lists as Python objects (dask would turn object columns into strings)
    settings: dict[str, Any] = {"dataframe.convert-string": False}
    if client is None:
        settings["scheduler"] = "threads"
    try:
        with dask.config.set(settings):
            ddf = dd.from_pandas(frame, npartitions=partitions)
            report = None
            if infer_kwargs.get("co_locate", True):  # the rows are put back in order below
                ddf, decision = co_locate_if_it_helps(ddf, "prompt", partitions)
                report = decision.report()
            infer_kwargs = {**infer_kwargs, "co_locate": False}
            ddf = llm_infer(ddf, "prompt", output="out", value=False, **infer_kwargs)
            computed = _compute_with_progress(ddf, client, progress)
    finally:
        if owned:
            client.close()
    names = "finish_reason prompt_tokens completion_tokens error logprob choice_logprobs".split()
    results = [
        _to_result({"text": r["out"], **{name: r[f"out_{name}"] for name in names}})
        for r in computed.sort_values("row").to_dict("records")
    ]
    return _restore_type_errors(prompts, results), report


def _compute_with_progress(ddf, client, progress: bool):
    """``ddf.compute()``, with a bar of finished tasks when ``progress`` (the local
    scheduler's ``dask.diagnostics.ProgressBar``, or ``distributed.progress`` on a
    cluster) and each worker's per-partition log lines shown here."""
    if client is None:
        if not progress:
            return ddf.compute()
        from dask.diagnostics import ProgressBar

        with ProgressBar(dt=1.0):
            return ddf.compute()
    from llm_operator.integrations.worker import logger

    client.forward_logging(logger.name)  # the workers' partition lines, here
    future = client.compute(ddf)
    if progress:
        from distributed import progress as show_progress

        show_progress(future)
    return future.result()


def _constraint_column(infer_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(the options, the constraint column's name in the job's table): the name the option
    gives (so row errors name it), unless the job's own columns use it."""
    kwargs = dict(infer_kwargs)
    option = next(name for name in CONSTRAINT_OPTIONS if kwargs.get(name) is not None)
    if kwargs[option] in _TABLE_COLUMNS:
        kwargs[option] = f"__{kwargs[option]}"
    return kwargs, kwargs[option]


def constraint_cells(kind: str, values: Sequence[Any]) -> list[Any]:
    """A table's constraint cells as the engines take them: None, text, a list of labels
    (choices) or a dict (json_schema; a struct read from Parquet or JSONL keeps only the keys
    that hold a value, as pyarrow fills every row's struct with every key). Other values
    (numbers: a CSV column of one-label rows) become their text."""
    cells: list[Any] = []
    for value in values:
        if value is None or isinstance(value, str):
            cells.append(value)
        elif kind == "choices" and isinstance(value, (list, tuple)):
            cells.append(list(value))
        elif kind == "json_schema" and isinstance(value, Mapping):
            cells.append(_without_nulls(value))
        else:
            cells.append(str(value))
    return cells


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _spark_cells(cells: Sequence[Any]):
    """(the cells, their Spark type): array<string> when every label list holds strings,
    else strings (lists and dicts as JSON text; each is checked per row on the workers)."""
    from pyspark.sql import types as T

    given = [cell for cell in cells if cell is not None]
    if given and all(
        isinstance(cell, list) and all(isinstance(item, str) for item in cell) for cell in given
    ):
        return list(cells), T.ArrayType(T.StringType())
    text = [cell if cell is None or isinstance(cell, str) else json.dumps(cell) for cell in cells]
    return text, T.StringType()


def _restore_type_errors(prompts: Sequence[Any], results: list, chat: bool = False) -> list:
    """Values a column cannot hold (wrong types; with ``chat``, plain strings in Spark's
    column of message lists) went in as nulls; say what they were."""
    from llm_operator.results import GenerationResult

    for i, prompt in enumerate(prompts):
        if prompt is not None and not isinstance(prompt, (str, list)):
            results[i] = GenerationResult.failed(
                f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
            )
        elif chat and isinstance(prompt, str):
            results[i] = GenerationResult.failed(
                "this Spark column holds chat message lists; a plain string cannot join it"
            )
    return results
