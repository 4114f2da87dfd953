"""Run a list of prompts through the local operator, Spark (local mode) or Dask, for the CLI.

Every engine returns one GenerationResult per prompt, in input order: the rows carry
their position through co-location and are put back in order at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

ENGINES = ("local", "spark", "dask")


class Generated(NamedTuple):
    results: list  # GenerationResult per prompt, in input order
    seconds: float
    stats: Any  # the operator's RunStats on the local engine; None on spark and dask


def generate(
    prompts: Sequence[Any],
    *,
    engine: str,
    model: str,
    partitions: int = 2,
    **options: Any,
) -> Generated:
    """Results in input order. ``options``: any engine, sampling or prompt option
    (``llm_operator.options``), passed the same way to every engine (``progress`` shows a
    bar on the local engine; Spark and Dask workers log a line per partition instead)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    from llm_operator.integrations.partition import get_operator, make_options

    checked = make_options(model=model, **options)  # every option checked before any work
    started = time.perf_counter()
    stats = None
    if engine == "local":
        operator = get_operator(checked)
        results = operator.generate(checked.prompts(list(prompts)), checked.sampling)
        stats = operator.last_stats
    else:
        # workers report one log line per partition; their progress bars would interleave
        worker_options = {"model": model, **options, "progress": False}
        run = _spark if engine == "spark" else _dask
        results = run(prompts, worker_options, partitions)
    return Generated(results, time.perf_counter() - started, stats)


def _to_result(record: Mapping[str, Any]):
    from llm_operator.results import GenerationResult

    logprob = record["logprob"]
    choice_logprobs = record["choice_logprobs"]
    return GenerationResult(
        text=record["text"] or "",
        token_ids=(),
        finish_reason=record["finish_reason"],
        prompt_tokens=int(record["prompt_tokens"] or 0),
        completion_tokens=int(record["completion_tokens"] or 0),
        error=record["error"] if isinstance(record["error"], str) else None,
        logprob=None if logprob is None or logprob != logprob else float(logprob),  # NaN: none
        choice_logprobs=dict(choice_logprobs) if isinstance(choice_logprobs, Mapping) else None,
    )


def _spark(prompts: Sequence[Any], infer_kwargs: Mapping[str, Any], partitions: int) -> list:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from llm_operator.integrations.spark import co_locate, llm_infer
    from llm_operator.integrations.spark_session import local_session

    spark = local_session(partitions)
    chat = any(isinstance(p, list) for p in prompts)
    if chat:
        message = T.StructType(
            [T.StructField("role", T.StringType()), T.StructField("content", T.StringType())]
        )
        prompt_type: T.DataType = T.ArrayType(message)
        values = [p if isinstance(p, list) or p is None else None for p in prompts]
    else:
        prompt_type = T.StringType()
        values = [p if isinstance(p, str) or p is None else None for p in prompts]
    schema = T.StructType(
        [T.StructField("row", T.LongType()), T.StructField("prompt", prompt_type)]
    )
    frame = spark.createDataFrame(list(enumerate(values)), schema).repartition(partitions)
    # chat rows co-locate by their messages as JSON (system and shared turns come first)
    frame = co_locate(frame, F.to_json("prompt") if chat else "prompt", partitions)
    # the table keeps the JSON text: no typed value (so any schema the engine compiles works)
    out = frame.select("row", llm_infer("prompt", value=False, **infer_kwargs).alias("out"))
    rows = sorted(out.collect(), key=lambda r: r["row"])
    results = [_to_result(r["out"].asDict()) for r in rows]
    if chat:  # one Spark column holds one type: plain strings went in as nulls
        from llm_operator.results import GenerationResult

        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                message = (
                    "this Spark column holds chat message lists; a plain string cannot join it"
                )
                results[i] = GenerationResult.failed(message)
    return _restore_type_errors(prompts, results)


def _dask(prompts: Sequence[Any], infer_kwargs: Mapping[str, Any], partitions: int) -> list:
    import dask
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.integrations.dask import co_locate, llm_infer

    values = [p if isinstance(p, (str, list)) else None for p in prompts]
    # chat rows co-locate by their messages as JSON (system and shared turns come first)
    keys = [json.dumps(p) if isinstance(p, list) else p for p in values]
    frame = pd.DataFrame(
        {
            "row": range(len(prompts)),
            "prompt": pd.Series(values, dtype=object),
            "key": pd.Series(keys, dtype=object),
        }
    )
    # keep message lists as Python objects (dask would turn object columns into strings)
    with dask.config.set({"dataframe.convert-string": False, "scheduler": "threads"}):
        ddf = dd.from_pandas(frame, npartitions=partitions)
        ddf = co_locate(ddf, "key", partitions)
        ddf = llm_infer(ddf, "prompt", output="out", value=False, **infer_kwargs)
        computed = ddf.compute().sort_values("row")
    results = [
        _to_result(
            {
                "text": r["out"],
                "finish_reason": r["out_finish_reason"],
                "prompt_tokens": r["out_prompt_tokens"],
                "completion_tokens": r["out_completion_tokens"],
                "error": r["out_error"],
                "logprob": r["out_logprob"],
                "choice_logprobs": r["out_choice_logprobs"],
            }
        )
        for r in computed.to_dict("records")
    ]
    return _restore_type_errors(prompts, results)


def _restore_type_errors(prompts: Sequence[Any], results: list) -> list:
    """Values a column cannot hold (wrong types) went in as nulls; say what they were."""
    from llm_operator.results import GenerationResult

    for i, prompt in enumerate(prompts):
        if prompt is not None and not isinstance(prompt, (str, list)):
            results[i] = GenerationResult.failed(
                f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
            )
    return results
