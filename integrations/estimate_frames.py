"""What Spark's and Dask's ``llm_estimate`` share: a DataFrame job's cost, predicted
without running it whole (``llm_operator.estimate`` does the predicting).

    driver:   count the rows; collect a seeded sample of them; render its prompts as
              ``llm_infer`` would; ``cost_inputs`` on them (the model loads here: the
              backend's calibration, cached on disk, and the sample generated for
              output lengths)
    workers:  each partition's prompts rendered the same way and predicted
              (``predict_prompts``) by an operator that only tokenizes and plans; the
              ``CostInputs`` travel in the task; one row per partition comes back
    driver:   the partitions summed into an ``Estimate``; for ``executors`` machines,
              the partitions packed longest first (the slowest machine's seconds)

Nothing here imports pyspark or dask; the heavy modules load inside the functions.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llm_operator.integrations.infer_options import InferOptions
from llm_operator.integrations.worker import _partition_lock, get_operator, partition_prompts

if TYPE_CHECKING:
    from llm_operator.estimate import CostInputs, Estimate

# One row per partition: its number, then PartitionPrediction's fields.
PREDICTION_FIELDS: tuple[tuple[str, type], ...] = (
    ("partition", int),
    ("rows", int),
    ("error_rows", int),
    ("requests", int),
    ("prompt_tokens", int),
    ("prefill_tokens", int),
    ("output_tokens", int),
    ("iterations", int),
    ("prepare_seconds", float),
    ("seconds", float),
)
_COUNTS = [name for name, kind in PREDICTION_FIELDS if kind is int and name != "partition"]


def check_estimate_options(sample_rows: Any, executors: Any, seed: Any) -> None:
    """ValueError naming ``sample_rows`` or ``executors``; TypeError for a seed that is
    not an int (before any job runs or model loads)."""
    from llm_operator.estimate.estimate import check_options

    check_options(sample_rows, executors)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")


def sample_size(sample_rows: int | str, rows: int) -> int:
    """Rows to sample of ``rows``: "auto" as ``LLMOperator.estimate`` (2%, 4 to 64)."""
    from llm_operator.estimate.estimate import auto_sample_size

    if sample_rows == "auto":
        return auto_sample_size(rows)
    return min(int(sample_rows), rows)


def oversampled_fraction(wanted: int, rows: int) -> float:
    """A Bernoulli sampling fraction that gives at least ``wanted`` of ``rows`` rows but
    for a chance well under 1 in 1000 (the caller retries with more when it does not)."""
    if rows <= 0:
        return 1.0
    return min(1.0, (wanted + 4 * wanted**0.5 + 16) / rows)


def predict_partition(
    values: Sequence[Any],
    options: InferOptions,
    inputs: CostInputs,
    constraints: Sequence[Any] | None = None,
    partition: int = 0,
) -> dict[str, Any]:
    """One partition predicted on a worker (PREDICTION_FIELDS). The worker's operator
    (``get_operator``) only tokenizes and plans: its model is not loaded here. With
    ``dedupe`` the distinct prompts are predicted, as the job computes them, and
    ``rows`` and ``error_rows`` count every row."""
    from llm_operator.estimate import predict_prompts

    result: dict[str, Any] = {name: kind() for name, kind in PREDICTION_FIELDS}
    result["partition"] = int(partition)
    if not len(values):
        return result
    operator = get_operator(options)
    prompts, sampling, positions, _ = partition_prompts(
        values, options, operator.has_chat_template, constraints
    )
    with _partition_lock(operator):  # one tokenizer user at a time (threaded workers)
        predicted = predict_prompts(operator, prompts, sampling, inputs).as_dict()
        if positions is not None and predicted["error_rows"]:
            errors = operator.prepare(prompts, sampling).errors
            predicted["error_rows"] = sum(1 for p in positions if p in errors)
    if positions is not None:
        predicted["rows"] = len(positions)
    result.update(predicted)
    return result


def driver_inputs(
    values: Sequence[Any],
    options: InferOptions,
    constraints: Sequence[Any] | None = None,
    *,
    seed: int = 0,
    recalibrate: bool = False,
) -> tuple[CostInputs, dict[str, Any], float]:
    """On the driver, with the sampled rows' values: (``cost_inputs``, what the sample
    measured, seconds spent loading the model: 0 when this process had it loaded). Every
    sampled row is generated. The operator is ``get_operator``'s, so it stays loaded for
    the next estimate (or an in-process job) with these options."""
    from llm_operator.estimate import cost_inputs
    from llm_operator.estimate.estimate import start_backend

    operator = get_operator(options)
    prompts, sampling, _, _ = partition_prompts(
        values, options, operator.has_chat_template, constraints
    )
    with _partition_lock(operator):
        load_seconds = start_backend(operator)
        inputs, sample = cost_inputs(
            operator,
            prompts,
            sampling,
            sample_rows=len(prompts),
            seed=seed,
            recalibrate=recalibrate,
        )
    return inputs, sample, load_seconds


def makespan(seconds: Sequence[float], executors: int) -> float:
    """The busiest of ``executors`` machines when the partitions go longest first to the
    least loaded one (a partition is never split)."""
    if not seconds:
        return 0.0
    loads = [0.0] * min(executors, len(seconds))
    heapq.heapify(loads)
    for s in sorted(seconds, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + s)
    return max(loads)


def frame_estimate(
    partitions: Sequence[dict[str, Any]],
    inputs: CostInputs,
    sample: dict[str, Any],
    options: InferOptions,
    *,
    executors: int,
    started: float,
    load_seconds: float,
    engine: str,
) -> Estimate:
    """The partitions' predictions summed into an ``Estimate`` (``started``: when the
    call began, ``time.perf_counter()``; ``engine``: "Spark" or "Dask", for the
    assumptions).

    seconds: every partition one after the other on one machine like the driver.
    executor_seconds: the partitions packed longest first onto ``executors`` machines.
    The range: the calibration's error (at least 5%) and, for rows whose length is drawn
    from the sample, the sampled lengths' spread (Student's t for 90%) applied to all
    of the generating time (prefill included, so a little wider than
    ``LLMOperator.estimate``'s, which replays the plan at both ends)."""
    from llm_operator.estimate import Estimate
    from llm_operator.estimate.estimate import _t90, sample_fields

    calibration = sample["calibration"]
    totals = {name: int(sum(p[name] for p in partitions)) for name in _COUNTS}
    times = [float(p["seconds"]) for p in partitions]
    seconds = sum(times)
    prepare_seconds = float(sum(p["prepare_seconds"] for p in partitions))
    lengths = inputs.lengths
    everything = lengths.everything
    params = options.sampling
    drawn = not params.ignore_eos and totals["requests"] > 0  # lengths come from the sample
    margin = _t90(len(everything) - 1) * lengths.spread if drawn and len(everything) > 1 else 0.0
    error = max(calibration.cost.relative_error, 0.05)
    generating = max(0.0, seconds - prepare_seconds)
    low = prepare_seconds + generating * max(0.0, 1 - margin) * (1 - error)
    high = prepare_seconds + generating * (1 + margin) * (1 + error)

    assumptions = [
        f"the {len(partitions)} {engine} partitions run as they are now, each one batch "
        "(co_locate first to estimate rows grouped by their shared prefix)",
        "every executor is a machine like the driver, where the calibration ran",
    ]
    if drawn and not everything:
        assumptions.append("no sampled row: every row runs to its max_tokens (an upper bound)")
    elif drawn:
        assumptions.append(f"output lengths come from {sample['rows']} sampled rows")
    if params.choices is not None and params.logprobs:
        assumptions.append("choices with logprobs: the scoring requests are not counted")
    if params.constraint is not None or options.constraint_col is not None:
        assumptions.append(
            "constrained rows: tokens appended by jump-forward count as decode steps"
        )
    if inputs.settings.fit_to_plan:
        assumptions.append("each partition's run allocates its KV pool")
    if executors > 1:
        assumptions.append(
            f"partitions packed longest first onto {executors} executors, one at a time each"
        )
    return Estimate(
        backend=inputs.backend,
        dtype=calibration.key.get("dtype", ""),
        device=calibration.key.get("device", ""),
        rows=totals["rows"],
        error_rows=totals["error_rows"],
        requests=totals["requests"],
        prompt_tokens=totals["prompt_tokens"],
        prefill_tokens=totals["prefill_tokens"],
        output_tokens=totals["output_tokens"],
        iterations=totals["iterations"],
        seconds=seconds,
        low_seconds=min(low, seconds),
        high_seconds=max(high, seconds),
        executors=executors,
        executor_seconds=makespan(times, executors),
        machine_hours=seconds / 3600,
        prepare_seconds=prepare_seconds,
        **sample_fields(sample, inputs.lengths),
        estimate_seconds=time.perf_counter() - started - load_seconds,
        load_seconds=load_seconds,
        assumptions=assumptions,
    )
