"""Calibration: what an iteration costs on this machine, measured once and cached.

``calibrate(op)`` runs synthetic jobs (``calibration_jobs``: random token ids, EOS ignored, so
every row's length is known) on the operator's backend and replays each to get its
iterations' features; a ``CostModel`` is fitted to the measured seconds: per iteration on the
native backend (its profile lists every step), per job elsewhere. The result is cached as
JSON under ``<cache_dir>/calibration/``, keyed by what it depends on (``calibration_key``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from llm_operator.estimate.cost import FEATURES, CostModel, chunk_features, iteration_total
from llm_operator.estimate.replay import ScheduleSettings, replay

CALIBRATION_VERSION = 8
"""Raise when the features, the jobs or the fit change (cached calibrations then rerun)."""
JOB_FEATURES = tuple(name for name in FEATURES if name not in ("first_tokens", "chunks"))
"""The features fitted to whole jobs' seconds (no per-chunk cost: too few totals)."""


@dataclass(frozen=True)
class CalibrationJob:
    """A synthetic job: token-id prompts, each decoding exactly its ``max_tokens``."""

    name: str
    token_ids: list[list[int]]
    max_tokens: list[int]


@dataclass
class Calibration:
    """A fitted cost model and the measurements it came from."""

    key: dict[str, Any]
    cost: CostModel
    measured: list[dict[str, Any]]  # per job: name, rows, tokens, seconds measured and predicted
    rates: dict[str, float]  # prefill tokens/s by chunk size, decode step ms by rows and context
    seconds: float  # wall time the calibration took (its jobs and the fit)
    per_iteration: bool  # fitted to every iteration's seconds (native) rather than to each job's
    # native: allocating (zeroing) one KV block when a run sizes its pool; 0 elsewhere
    pool_seconds_per_block: float = 0.0
    cached: bool = False  # read from the cache rather than measured in this process
    path: str | None = None
    created: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        cost = {"coefficients": self.cost.as_dict(), "relative_error": self.cost.relative_error}
        return {**asdict(self), "cost": cost}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """``as_dict``'s output read back (``cached``); KeyError or TypeError when it is not."""
        cost = CostModel.from_dict(data["cost"]["coefficients"], data["cost"]["relative_error"])
        names = {f.name for f in fields(cls)} - {"cost", "cached"}
        return cls(**{k: v for k, v in data.items() if k in names}, cost=cost, cached=True)


# -- the backend's schedule ----------------------------------------------------------------


def schedule_settings(op, backend) -> ScheduleSettings:
    """How ``backend`` (the operator's, loaded) batches a plan: its token budget,
    running-row limit and KV blocks (native and hf: the budget, cut to each plan's need;
    vLLM: its engine's pool, reusing whole cached blocks)."""
    config = backend.engine_config  # its batch sizes resolved for the device
    if backend.name == "vllm":
        engine = backend.engine()
        options = backend.engine_options()
        block = int(engine.block_size or 16)
        batched = options.get("max_num_batched_tokens") or config.prefill_batch_tokens
        return ScheduleSettings(
            max_batched_tokens=int(batched),
            max_running=int(options.get("max_num_seqs") or config.max_batch_size),
            block_size=block,
            num_blocks=max(1, int(engine.kv_blocks or 1) - 1),
            reuse_block_size=block,
        )
    block = int(getattr(backend, "block_size", None) or config.kv_block_size)
    budget = max(1, int(backend.kv_cache_bytes) // _bytes_per_block(backend, block))
    paths = getattr(backend, "paths", None)  # native's
    return ScheduleSettings(
        max_batched_tokens=config.prefill_batch_tokens,
        max_running=config.max_batch_size,
        block_size=block,
        num_blocks=budget,
        fit_to_plan=True,
        share_prefixes=config.share_prefixes,
        token_batching=config.token_batching if backend.name == "native" else True,
        copy_tails=bool(paths and paths.invariant),
    )


def _bytes_per_block(backend, block: int) -> int:
    """K and V bytes of one KV block: the native backend's own figure, else (hf) the model's."""
    if hasattr(backend, "bytes_per_block"):
        return int(backend.bytes_per_block())
    from llm_operator.engine.hf.prefix_store import kv_bytes_per_token

    return kv_bytes_per_token(backend.model) * block


# -- the cache -----------------------------------------------------------------------------


def calibration_key(op, backend) -> dict[str, Any]:
    """What a calibration depends on (equal keys: the cached one applies)."""
    from importlib.metadata import version

    import torch

    config = backend.engine_config  # its batch sizes resolved for the device
    model_path = Path(op.model.path)
    config_file = model_path / "config.json"
    try:
        model_config = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]
    except OSError:
        model_config = ""
    return {
        "version": CALIBRATION_VERSION,
        "library": version("llm-operator"),
        "model": str(model_path.resolve()),
        "model_config": model_config,
        "backend": backend.name,
        "dtype": backend_dtype_name(backend),
        "device": str(getattr(backend, "device", "cpu")),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "prefill_batch_tokens": config.prefill_batch_tokens,
        "max_batch_size": config.max_batch_size,
        "kv_block_size": config.kv_block_size,
        # the native engine's kernels, forward and invariance cost differently
        "paths": paths.describe() if (paths := getattr(backend, "paths", None)) else "",
        "vllm_options": [list(item) for item in config.vllm_options],
    }


def backend_dtype_name(backend) -> str:
    try:  # vLLM: its model config's
        dtype = backend.llm.llm_engine.vllm_config.model_config.dtype
    except AttributeError:
        dtype = getattr(backend, "dtype", "")
    return str(dtype).removeprefix("torch.")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(op, key: dict[str, Any]) -> Path:
    from llm_operator.models.registry import default_cache_dir

    root = Path(op.config.cache_dir) if op.config.cache_dir else default_cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / "calibration" / f"{key['backend']}-{key['dtype']}-{digest}.json"


def load_cached(path: Path, key: dict[str, Any]) -> Calibration | None:
    """The calibration cached at ``path`` for ``key``; None when missing, stale or unreadable."""
    try:
        data = json.loads(path.read_text())
        return Calibration.from_dict({**data, "path": str(path)}) if data["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(calibration: Calibration, path: Path) -> None:
    """Write atomically; a cache that cannot be written is skipped (the estimate still runs)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        calibration.path = str(path)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(calibration.as_dict(), indent=1))
        os.replace(temporary, path)
    except OSError:
        calibration.path = None


def load_or_calibrate(op, *, recalibrate: bool = False, log=None) -> Calibration:
    """The cached calibration of ``op``'s backend on this machine, measured when missing."""
    backend = op.backend()
    key = calibration_key(op, backend)
    path = cache_path(op, key)
    if not recalibrate and (cached := load_cached(path, key)) is not None:
        return cached
    if log is not None:
        log(
            f"calibrating {backend.name} ({key['dtype']}) on this machine, once (cached in {path.parent})"
        )
    calibration = calibrate(op, key)
    save(calibration, path)
    return calibration


# -- the measurements ----------------------------------------------------------------------


def calibration_jobs(max_context: int, vocab_size: int, seed: int = 0) -> list[CalibrationJob]:
    """The synthetic jobs, sized to fit ``max_context`` (random ids below ``vocab_size``):
    prefill chunks of two sizes, decode steps of 1 to 128 rows over short, long-own and
    long-shared contexts (and one iteration of 128 short prefill chunks)."""
    rng = random.Random(seed)
    low = min(100, max(0, vocab_size // 4))

    def ids(count: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(count)]

    room = max(48, min(max_context, 2048))
    short = max(8, min(384, room // 2 - 8))
    long = max(16, min(1536, room - 16))
    context = max(16, min(1024, room - 64))
    own = max(16, min(256, room // 2 - 32))
    shared = ids(min(128, room // 4))
    long_shared = ids(context)
    decode = max(4, min(24, room // 8))

    def job(name: str, rows: int, prompt, max_tokens: int = decode) -> CalibrationJob:
        return CalibrationJob(name, [prompt() for _ in range(rows)], [max_tokens] * rows)

    return [
        job("prefill", 2, lambda: ids(short), 1),
        job("long prefill", 2, lambda: ids(long), 1),
        job("decode 1 row", 1, lambda: ids(16)),
        job("decode 8 rows", 8, lambda: ids(24)),
        job("decode 32 rows", 32, lambda: shared + ids(8)),
        job("decode 16 rows, long shared prefix", 16, lambda: long_shared + ids(8)),
        job("decode 4 rows, long own prompts", 4, lambda: ids(own)),
        job("decode 128 rows", 128, lambda: ids(8), max(4, decode // 2)),
    ]


def run_token_ids(op, token_ids: Sequence[Sequence[int]], max_tokens: Sequence[int]):
    """Run token-id prompts (EOS ignored) on the operator's backend: (plan, seconds)."""
    from llm_operator.engine.run import Run, run_plan
    from llm_operator.sampling import SamplingParams

    params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in max_tokens]
    plan, _ = op._plan([list(ids) for ids in token_ids], params)  # greedy: equal rows merge
    backend = op.backend()
    if (llm := getattr(backend, "llm", None)) is not None:
        llm.reset_prefix_cache()
    run = Run(
        plan,
        [params[r.rows[0]] for r in plan.requests],
        tokenizer=op.tokenizer,
        eos_token_ids=op.model_info.eos_token_ids,
        max_context=op.max_context,
    )
    started = time.perf_counter()
    run_plan(backend, run)
    return plan, time.perf_counter() - started


def calibrate(op, key: dict[str, Any] | None = None) -> Calibration:
    """Measure the calibration jobs on ``op``'s backend and fit the cost model."""
    started = time.perf_counter()
    backend = op.backend()
    key = key if key is not None else calibration_key(op, backend)
    vocab = _vocab_size(op)
    jobs = calibration_jobs(op.max_context, vocab)
    run_token_ids(op, [[101 % vocab] * 12, [102 % vocab] * 12], [3, 3])  # warm-up
    settings = schedule_settings(op, backend)
    native = per_iteration = backend.name == "native"
    rows: list[tuple[float, ...]] = []
    seconds: list[float] = []
    runs = []  # (job, its replay, its seconds)
    for job in jobs:
        # native warms its kernels when it starts; vLLM and hf compile or allocate for each
        # new shape on first sight: their jobs run twice and the second, warm run counts
        for _ in range(1 if native else 2):
            plan, wall = run_token_ids(op, job.token_ids, job.max_tokens)
        replayed = replay(plan, [r.max_tokens for r in plan.requests], settings, keep_steps=True)
        steps = getattr(getattr(backend, "last_profile", None), "steps", None)
        if per_iteration and steps is not None and len(steps) == len(replayed.steps):
            rows.extend(replayed.steps)
            seconds.extend(float(step_seconds) for _, _, step_seconds in steps)
        else:
            per_iteration = False
        runs.append((job, replayed, wall))
    if not per_iteration:  # fit each job's total instead: few totals, so fewer features
        rows = [tuple(replayed.totals) for _, replayed, _ in runs]
        seconds = [wall for _, _, wall in runs]
    cost = CostModel.fit(rows, seconds, features=None if per_iteration else JOB_FEATURES)
    measured = [
        {
            "job": job.name,
            "rows": len(job.token_ids),
            "prompt_tokens": sum(map(len, job.token_ids)),
            "output_tokens": sum(job.max_tokens),
            "iterations": replayed.iterations,
            "seconds": wall,
            "predicted_seconds": cost.seconds(replayed.totals),
        }
        for job, replayed, wall in runs
    ]
    per_byte = pool_seconds_per_byte() if native else 0.0
    return Calibration(
        key=key,
        cost=cost,
        measured=measured,
        rates={**readable_rates(cost, jobs), "kv_pool_seconds_per_gib": per_byte * 2**30},
        seconds=time.perf_counter() - started,
        per_iteration=per_iteration,
        pool_seconds_per_block=per_byte * backend.bytes_per_block() if native else 0.0,
    )


def pool_seconds_per_byte(size: int = 256 << 20) -> float:
    """Seconds to allocate and zero a fresh buffer, per byte (the native KV pool's cost:
    mostly page faults), the faster of two tries."""
    import torch

    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        buffer = torch.zeros(size // 4, dtype=torch.float32)
        best = min(best, time.perf_counter() - started)
        del buffer
    return best / size


def readable_rates(cost: CostModel, jobs: Sequence[CalibrationJob]) -> dict[str, float]:
    """What the fitted model says in a reader's units: prefill tokens/s of a 512- and a
    4096-token chunk, and decode step milliseconds at 1, 32 and 128 rows over 512 keys."""
    rates: dict[str, float] = {}
    for chunk in (512, 4096):
        features = iteration_total([chunk_features(0, chunk, 0, sample=True, decode=False)])
        rates[f"prefill_tokens_per_s_chunk_{chunk}"] = chunk / max(cost.seconds(features), 1e-9)
    for rows in (1, 32, 128):
        features = iteration_total([chunk_features(511, 1, 0, sample=True, decode=True)] * rows)
        rates[f"decode_step_ms_{rows}_rows_512_context"] = cost.seconds(features) * 1e3
    return rates


def _vocab_size(op) -> int:
    config = op.model_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", None) or len(op.tokenizer))
