"""``estimate``: a job's time and machine-hours, predicted before it runs.

    prompts --prepare, plan------------------------> the exact prefill after sharing
            --calibration (cached, calibration.py)-> seconds per iteration feature
            --a small sample of rows, generated----> output lengths per prefix group
            --replay of the plan's schedule--------> iterations -> seconds (range)
            --groups split over N executors--------> the slowest executor, machine-hours

The estimate names its inputs (``Estimate.assumptions``, the calibration's figures,
the sample) so a reader can judge it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llm_operator.estimate.calibration import Calibration, load_or_calibrate, schedule_settings
from llm_operator.estimate.cost import CostModel
from llm_operator.estimate.lengths import LengthModel, Observed, group_key, observed
from llm_operator.estimate.replay import ScheduleSettings, replay

SAMPLE_FRACTION = 0.02
"""``sample_rows="auto"``: at most this part of the rows (at least ``MIN_SAMPLE``, at most
``MAX_SAMPLE``), and only as many as ``SAMPLE_BUDGET`` allows."""
MIN_SAMPLE, MAX_SAMPLE = 4, 64
SAMPLE_BUDGET = 0.05
"""``sample_rows="auto"``: past its first ``MIN_SAMPLE`` rows (one per prefix group in
turn), the sample grows while it costs at most this part of the job (both predicted, the
sample at its rows' max_tokens, the job at one output token a row)."""
LENGTHS_MATTER = 0.1
"""Below this spread between every row at max_tokens and every row at one token, output
lengths barely move the job's time (prefill dominates, or EOS is ignored): ``auto``
samples nothing and the estimate takes the middle of the two."""


@dataclass
class Estimate:
    """A job's predicted cost (``report()`` prints it; ``as_dict()`` is JSON-ready)."""

    backend: str
    dtype: str
    device: str
    rows: int
    error_rows: int  # rows that would fail before the model (null, empty, too long)
    requests: int
    prompt_tokens: int
    prefill_tokens: int  # computed, after sharing (the backend's reuse granularity included)
    output_tokens: int  # predicted
    iterations: int
    seconds: float  # predicted wall time of the job on one machine like this one
    low_seconds: float
    high_seconds: float
    executors: int
    executor_seconds: float  # the slowest of ``executors`` machines when the job is split
    machine_hours: float  # all executors' time together
    prepare_seconds: float  # tokenizing and planning (measured here, part of ``seconds``)
    sample_rows: int
    sample_seconds: float  # measured: generating the sample
    sample_predicted_seconds: float  # what the cost model says the sample takes
    sample_output_tokens: float  # mean output tokens of the sampled rows
    calibration: dict[str, Any]
    estimate_seconds: float  # this estimate's own wall time (model load excluded)
    load_seconds: float  # loading the model for the estimate (0 when already loaded)
    assumptions: list[str] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def sample_check(self) -> float:
        """Measured over predicted seconds of the sample run (1.0: the model fits now)."""
        predicted = self.sample_predicted_seconds
        return self.sample_seconds / predicted if predicted > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        extra = {"rows_per_second": self.rows_per_second, "sample_check": self.sample_check}
        return {**asdict(self), **extra}

    def report(self) -> str:
        """The estimate as lines a person reads."""
        c = self.calibration
        rows = self.sample_rows
        sampled = f"  (predicted from {rows} sampled row{'s' if rows != 1 else ''})" if rows else ""
        lines = [
            f"estimate ({self.backend}, {self.dtype}, {self.device}; {c.get('cpu', '')})",
            f"  rows               {self.rows:>12,}  ({self.error_rows:,} would fail before the model)",
            f"  prompt tokens      {self.prompt_tokens:>12,}",
            f"  prefill computed   {self.prefill_tokens:>12,}",
            f"  output tokens      {self.output_tokens:>12,}{sampled}",
            f"  iterations         {self.iterations:>12,}",
            f"  time, one machine  {_duration(self.seconds):>12}  "
            f"(range {_duration(self.low_seconds)} - {_duration(self.high_seconds)}), "
            f"{self.rows_per_second:,.2f} rows/s",
        ]
        if self.executors > 1:
            lines.append(
                f"  {f'on {self.executors} executors':<19}{_duration(self.executor_seconds):>12}  "
                f"(the slowest; {self.machine_hours:.3f} machine-hours)"
            )
        else:
            lines.append(f"  machine-hours      {self.machine_hours:>12.4f}")
        calibrated = "cached" if c.get("cached") else f"{c.get('seconds', 0.0):.1f} s"
        load = f", model load {self.load_seconds:.1f} s" if self.load_seconds else ""
        lines.append(
            f"  this estimate      {_duration(self.estimate_seconds):>12}  "
            f"(calibration {calibrated}, sample {self.sample_seconds:.1f} s{load})"
        )
        if self.sample_rows and self.sample_predicted_seconds > 0:
            lines.append(
                f"  sample check       {self.sample_check:>12.2f}  "
                "(measured / predicted seconds of the sample run)"
            )
        if rates := c.get("rates", {}):
            prefill = rates.get("prefill_tokens_per_s_chunk_4096", 0)
            steps = [rates.get(f"decode_step_ms_{n}_rows_512_context", 0) for n in (1, 32, 128)]
            lines.append(
                f"  calibration        prefill {prefill:,.0f} tokens/s (4096-token chunks), decode "
                f"{' / '.join(f'{ms:.1f}' for ms in steps)} ms a step (1 / 32 / 128 rows)"
            )
        lines.extend(f"  assumes: {assumption}" for assumption in self.assumptions)
        return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


@dataclass(frozen=True)
class CostInputs:
    """Everything a replay needs, without the model (picklable: Spark and Dask ship it to
    workers that only tokenize and plan their partition)."""

    backend: str
    cost: CostModel
    settings: ScheduleSettings
    pool_seconds_per_block: float
    lengths: LengthModel


@dataclass(frozen=True)
class Prediction:
    """A plan's replayed run and its predicted seconds."""

    seconds: float
    iterations: int
    prefill_tokens: int
    output_tokens: int


def predict(plan, ignore_eos: Sequence[bool], inputs: CostInputs, *, scale: float = 1.0,
            known: dict[int, int] | None = None) -> Prediction:  # fmt: skip
    """The plan replayed with lengths from ``inputs.lengths`` (``scale`` moves them)."""
    if not plan.requests:
        return Prediction(0.0, 0, 0, 0)
    samples = inputs.lengths.samples(plan, ignore_eos, scale=scale, known=known)
    replayed = replay(plan, samples, inputs.settings)
    seconds = inputs.cost.seconds(replayed.totals)
    if inputs.settings.fit_to_plan:  # the run allocates its KV pool
        seconds += replayed.num_blocks * inputs.pool_seconds_per_block
    output_tokens = sum(n * len(r.rows) for r, n in zip(plan.requests, samples))
    return Prediction(seconds, replayed.iterations, replayed.prefill_tokens, output_tokens)


@dataclass(frozen=True)
class PartitionPrediction:
    """One batch of prompts (a partition) predicted on a worker that only tokenizes."""

    rows: int
    error_rows: int
    requests: int
    prompt_tokens: int
    prefill_tokens: int
    output_tokens: int
    iterations: int
    prepare_seconds: float  # measured: tokenizing and planning it here
    seconds: float  # predicted: generating it (``prepare_seconds`` included)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_prompts(op, prompts: Sequence[Any], sampling):
    """(prepared prompts, their plan, each plan row's input row, each planned request's
    ignore_eos, seconds tokenizing and planning took), as ``generate`` plans them."""
    started = time.perf_counter()
    prepared = op.prepare(prompts, sampling)
    plan, valid = op._plan(prepared.token_ids, prepared.params)
    ignore_eos = [prepared.params[valid[r.rows[0]]].ignore_eos for r in plan.requests]
    return prepared, plan, valid, ignore_eos, time.perf_counter() - started


def start_backend(op) -> float:
    """Load ``op``'s model (and start vLLM's engine): the seconds it took, 0 when loaded."""
    if op._backend is not None:
        return 0.0
    started = time.perf_counter()
    backend = op.backend()
    if callable(getattr(backend, "engine", None)):
        backend.engine()  # vLLM starts here
    return time.perf_counter() - started


def check_options(sample_rows: Any, executors: Any = 1) -> int | None:
    """ValueError naming ``sample_rows`` or ``executors``; the sample size (None: auto)."""
    if isinstance(executors, bool) or not isinstance(executors, int) or executors < 1:
        raise ValueError(f"executors must be an int >= 1, got {executors!r}")
    if sample_rows == "auto":
        return None
    if isinstance(sample_rows, bool) or not isinstance(sample_rows, int) or sample_rows < 0:
        raise ValueError(f'sample_rows must be "auto" or an int >= 0, got {sample_rows!r}')
    return sample_rows


def predict_prompts(
    op, prompts: Sequence[Any], sampling, inputs: CostInputs
) -> PartitionPrediction:
    """Tokenize and plan ``prompts`` with ``op`` (its model is not loaded) and predict
    their run from ``inputs`` (``cost_inputs``, measured elsewhere on a machine like the
    one that will run them)."""
    prepared, plan, _, ignore_eos, prepare_seconds = plan_prompts(op, prompts, sampling)
    predicted = predict(plan, ignore_eos, inputs)
    return PartitionPrediction(
        **_counts(prepared, plan, predicted),
        prepare_seconds=prepare_seconds,
        seconds=prepare_seconds + predicted.seconds,
    )


def _counts(prepared, plan, predicted: Prediction) -> dict[str, int]:
    """The rows, requests and tokens ``Estimate`` and ``PartitionPrediction`` both give."""
    return {
        "rows": len(prepared.token_ids),
        "error_rows": len(prepared.errors),
        "requests": len(plan.requests),
        "prompt_tokens": plan.stats.prompt_tokens,
        "prefill_tokens": predicted.prefill_tokens,
        "output_tokens": predicted.output_tokens,
        "iterations": predicted.iterations,
    }


def cost_inputs(
    op,
    prompts: Sequence[Any],
    sampling=None,
    *,
    sample_rows: int | str = "auto",
    seed: int = 0,
    recalibrate: bool = False,
    log=None,
    planned=None,
) -> tuple[CostInputs, dict[str, Any]]:
    """Calibrate ``op``'s backend (cached) and generate a sample of ``prompts`` for the
    output lengths: (the inputs of every later ``predict``, what the sample measured).
    ``planned``: ``plan_prompts``' result when the caller has it already."""
    size = check_options(sample_rows)
    prepared, plan, valid, ignore_eos, _ = planned or plan_prompts(op, prompts, sampling)
    start_backend(op)
    backend = op.backend()
    calibration = load_or_calibrate(op, recalibrate=recalibrate, log=log)
    unknown = [r.request_id for r in plan.requests if not ignore_eos[r.request_id]]
    settings = schedule_settings(op, backend)
    bounds = CostInputs(
        backend.name, calibration.cost, settings, calibration.pool_seconds_per_block, LengthModel()
    )
    upper = predict(plan, ignore_eos, bounds).seconds
    lower = predict(plan, ignore_eos, bounds, known=dict.fromkeys(unknown, 1)).seconds
    lengths_matter = upper > lower * (1 + LENGTHS_MATTER)
    if size is not None:
        chosen = _choose_sample(plan, unknown, size, seed)
    elif lengths_matter:  # auto: a few rows over the groups, then more while the budget lasts
        order = _choose_sample(plan, unknown, auto_sample_size(len(unknown)), seed)
        chosen = order[:MIN_SAMPLE]
        for request_id in order[MIN_SAMPLE:]:
            if _sample_cost(op, plan, [*chosen, request_id], bounds) > SAMPLE_BUDGET * lower:
                break
            chosen.append(request_id)
    else:  # auto, and lengths barely matter: no sample
        chosen = []
    chosen.sort()
    sample = {
        "rows": len(chosen),
        "seconds": 0.0,
        "predicted_seconds": 0.0,
        "known": {},
        "lower_seconds": lower,
        "upper_seconds": upper,
        "lengths_matter": lengths_matter,
        "calibration": calibration,
        "unknown": len(unknown),
    }
    sampled: list[tuple[str, Observed]] = []
    if chosen:
        rows = [valid[plan.requests[i].rows[0]] for i in chosen]
        sample_params = [prepared.params[row] for row in rows]
        results = op.generate([prompts[row] for row in rows], sample_params)
        stats = op.last_stats
        known = sample["known"]
        for request_id, result, p in zip(chosen, results, sample_params):
            if result.finish_reason != "error":
                o = observed(result.completion_tokens, result.finish_reason, p.max_tokens)
                sampled.append((group_key(plan.requests[request_id]), o))
                known[request_id] = o.samples
        # the sample's own run, predicted: how well the calibration fits now
        sample_plan, sample_valid = op._plan(
            [prepared.token_ids[row] for row in rows], sample_params
        )
        sample_known = {
            r.request_id: known.get(chosen[sample_valid[r.rows[0]]], 1)
            for r in sample_plan.requests
        }
        predicted = predict(
            sample_plan, [False] * len(sample_plan.requests), bounds, known=sample_known
        )
        sample["seconds"] = stats.seconds
        sample["predicted_seconds"] = (
            predicted.seconds + stats.tokenize_seconds + stats.plan_seconds
        )
    return dataclasses.replace(bounds, lengths=LengthModel.of(sampled)), sample


def estimate(
    op,
    prompts: Sequence[Any],
    sampling=None,
    *,
    sample_rows: int | str = "auto",
    executors: int = 1,
    seed: int = 0,
    recalibrate: bool = False,
    log=None,
) -> Estimate:
    """Predict what ``op.generate(prompts, sampling)`` costs (``LLMOperator.estimate``)."""
    if op.backend_name == "openai":
        raise ValueError(
            'estimate calibrates the engine on this machine; backend="openai" runs on a '
            "model server whose speed it cannot measure here: time a sample of rows instead"
        )
    check_options(sample_rows, executors)
    started = time.perf_counter()
    planned = plan_prompts(op, prompts, sampling)
    prepared, plan, valid, ignore_eos, prepare_seconds = planned
    load_seconds = start_backend(op)
    inputs, sample = cost_inputs(
        op,
        prompts,
        sampling,
        sample_rows=sample_rows,
        seed=seed,
        recalibrate=recalibrate,
        log=log,
        planned=planned,
    )
    calibration: Calibration = sample["calibration"]
    params = [prepared.params[valid[r.rows[0]]] for r in plan.requests]
    known = sample["known"]
    lengths = inputs.lengths

    assumptions: list[str] = []
    if sample["unknown"] and not lengths.everything:
        assumptions.append("no sampled row: every row runs to its max_tokens (an upper bound)")
    elif sample["unknown"]:
        groups = {group_key(r) for r in plan.requests if not ignore_eos[r.request_id]}
        if missing := groups - set(lengths.by_group):
            assumptions.append(
                f"{len(missing)} of {len(groups)} prefix groups had no sampled row: their "
                "lengths are drawn from all sampled rows"
            )
    if any(p.choices is not None and p.logprobs for p in params):
        assumptions.append("choices with logprobs: the scoring requests are not counted")
    if any(p.constraint is not None for p in params):
        assumptions.append(
            "constrained rows: tokens appended by jump-forward count as decode steps"
        )
    if inputs.settings.fit_to_plan:
        assumptions.append("a fresh process: the run allocates its KV pool")

    middle = predict(plan, ignore_eos, inputs, known=known)
    sampled = len(lengths.everything)
    margin = _t90(sampled - 1) * lengths.spread if sampled > 1 else 0.0
    low_seconds = high_seconds = middle.seconds
    if sampled == 1 and sample["unknown"] > 1:  # one row says little: one token to max_tokens
        low_seconds = min(middle.seconds, sample["lower_seconds"])
        high_seconds = max(middle.seconds, sample["upper_seconds"])
    elif margin:  # the sampled mean length's uncertainty
        low_seconds = predict(
            plan, ignore_eos, inputs, scale=max(0.0, 1 - margin), known=known
        ).seconds
        high_seconds = predict(plan, ignore_eos, inputs, scale=1 + margin, known=known).seconds
    elif sample["unknown"] and not lengths.everything:  # nothing sampled: one token to max_tokens
        low_seconds, high_seconds = sample["lower_seconds"], sample["upper_seconds"]
        if not sample["lengths_matter"]:  # they barely matter: take the middle
            every_one = predict(
                plan, ignore_eos, inputs, known=dict.fromkeys(range(len(plan.requests)), 1)
            )
            middle = Prediction(
                (middle.seconds + every_one.seconds) / 2,
                (middle.iterations + every_one.iterations) // 2,
                middle.prefill_tokens,
                (middle.output_tokens + every_one.output_tokens) // 2,
            )
            assumptions[:] = [a for a in assumptions if "upper bound" not in a] + [
                f"output lengths move this job's time by under {LENGTHS_MATTER:.0%}: no row "
                "sampled, the middle of one output token and max_tokens a row"
            ]
    error = max(calibration.cost.relative_error, 0.05)
    seconds = prepare_seconds + middle.seconds
    low = prepare_seconds + low_seconds * (1 - error)
    high = prepare_seconds + high_seconds * (1 + error)

    executor_seconds, machine_seconds = seconds, seconds
    if executors > 1 and plan.requests:
        executor_seconds, machine_seconds = _split(op, plan, ignore_eos, inputs, executors, known)
        executor_seconds += prepare_seconds / executors
        machine_seconds += prepare_seconds
    return Estimate(
        backend=inputs.backend,
        dtype=calibration.key.get("dtype", ""),
        device=calibration.key.get("device", ""),
        **_counts(prepared, plan, middle),
        seconds=seconds,
        low_seconds=min(low, seconds),
        high_seconds=max(high, seconds),
        executors=executors,
        executor_seconds=executor_seconds,
        machine_hours=machine_seconds / 3600,
        prepare_seconds=prepare_seconds,
        **sample_fields(sample, lengths),
        estimate_seconds=time.perf_counter() - started - load_seconds,
        load_seconds=load_seconds,
        assumptions=assumptions,
    )


def auto_sample_size(requests: int) -> int:
    """The most rows ``sample_rows="auto"`` generates (see ``SAMPLE_FRACTION``)."""
    return min(requests, max(MIN_SAMPLE, min(MAX_SAMPLE, math.ceil(SAMPLE_FRACTION * requests))))


_T90 = ((1, 6.31), (2, 2.92), (3, 2.35), (4, 2.13), (5, 2.02), (6, 1.94), (7, 1.89), (8, 1.86),
        (9, 1.83), (10, 1.81), (15, 1.75), (20, 1.72), (30, 1.70))  # fmt: skip


def _t90(degrees: int) -> float:
    """Student's t for a two-sided 90% interval (1.645 past 30 degrees of freedom)."""
    return next((t for limit, t in _T90 if degrees <= limit), 1.645)


def _sample_cost(op, plan, request_ids: list[int], bounds: CostInputs) -> float:
    """Predicted seconds of generating these requests alone, each to its max_tokens."""
    from llm_operator.sampling import SamplingParams

    requests = [plan.requests[i] for i in request_ids]
    sub, _ = op._plan(
        [list(r.token_ids) for r in requests],
        [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
    )
    return predict(sub, [True] * len(sub.requests), bounds).seconds


def _choose_sample(plan, candidates: list[int], size: int, seed: int) -> list[int]:
    """Up to ``size`` requests to generate, in the order drawn: spread over the prefix groups
    (largest first, round-robin), each group's members in a seeded random order."""
    rng = random.Random(seed)
    by_group: dict[int, list[int]] = {}
    for request_id in candidates:
        by_group.setdefault(plan.requests[request_id].group_id, []).append(request_id)
    queues = sorted(by_group.values(), key=len, reverse=True)
    for members in queues:
        rng.shuffle(members)
    rounds = itertools.zip_longest(*(reversed(members) for members in queues))  # round-robin
    drawn = [request_id for turn in rounds for request_id in turn if request_id is not None]
    return drawn[:size]


def _split(op, plan, ignore_eos, inputs: CostInputs, executors: int, known) -> tuple[float, float]:
    """The job spread over ``executors`` as ``co_locate`` spreads it: whole prefix groups,
    longest first onto the least loaded, but a group larger than an even share is cut in
    pieces (each then prefills the group's prefix again). Returns (the slowest
    executor's seconds, all executors' seconds together)."""
    from llm_operator.planner import build_plan

    samples = inputs.lengths.samples(plan, ignore_eos, known=known)

    def weight(requests) -> float:  # prefill tokens + decode steps, a rough cost
        prefix = requests[0].group_prefix_length if requests else 0
        return prefix + sum(len(r.token_ids) - prefix + samples[r.request_id] for r in requests)

    units = [[plan.requests[i] for i in group.request_ids] for group in plan.groups]
    share = sum(weight(unit) for unit in units) / executors
    pieces = []
    for unit in units:
        count = min(len(unit), max(1, math.ceil(weight(unit) / share)))
        size = math.ceil(len(unit) / count)
        pieces.extend(unit[k : k + size] for k in range(0, len(unit), size))
    bins: list[list] = [[] for _ in range(executors)]
    loads = [0.0] * executors
    for piece in sorted(pieces, key=weight, reverse=True):
        target = loads.index(min(loads))
        bins[target].extend(piece)
        loads[target] += weight(piece)
    times = []
    for requests in bins:
        if not requests:
            continue
        sub = build_plan(
            [list(r.token_ids) for r in requests],
            [r.max_tokens for r in requests],
            min_shared_tokens=op.config.min_shared_tokens,
            decode_first=op.config.decode_first,
            share_prefixes=op.config.share_prefixes,
        )
        sub_known = {r.request_id: samples[requests[r.rows[0]].request_id] for r in sub.requests}
        times.append(predict(sub, [False] * len(sub.requests), inputs, known=sub_known).seconds)
    return max(times), sum(times)


def sample_fields(sample: dict[str, Any], lengths: LengthModel) -> dict[str, Any]:
    """``Estimate``'s sample and calibration fields from ``cost_inputs``' sample record."""
    calibration: Calibration = sample["calibration"]
    return {
        "sample_rows": sample["rows"],
        "sample_seconds": sample["seconds"],
        "sample_predicted_seconds": sample["predicted_seconds"],
        "sample_output_tokens": statistics.fmean([o.samples for o in lengths.everything] or [0]),
        "calibration": {
            "cached": calibration.cached,
            "seconds": calibration.seconds,
            "path": calibration.path,
            "cpu": calibration.key.get("cpu"),
            "threads": calibration.key.get("threads"),
            "per_iteration": calibration.per_iteration,
            "relative_error": calibration.cost.relative_error,
            "coefficients": calibration.cost.as_dict(),
            "rates": calibration.rates,
            "jobs": calibration.measured,
        },
    }
