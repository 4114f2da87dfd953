"""The floor of a ``bench gpu`` job (DESIGN.md, "Knowing the limit") and the device's copy
bandwidth it is measured with (the matmul rate comes from ``bench.core.rate``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from llm_operator_bench.core.flops import ModelShape, attention_keys, work_flop

BANDWIDTH_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


def measure_copy_bandwidth(
    device: str, *, size_bytes: int | None = None, repeats: int = 9
) -> float:
    """Bytes per second a device-to-device copy moves (read plus written), median of
    ``repeats`` after one untimed copy; ``size_bytes`` per buffer (1 GiB on CUDA)."""
    import torch

    where = torch.device(device)
    size = size_bytes or BANDWIDTH_BYTES.get(where.type, BANDWIDTH_BYTES["cpu"])
    source = torch.ones(size, dtype=torch.uint8, device=where)
    target = torch.empty_like(source)
    seconds = []
    for index in range(repeats + 1):
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        started = time.perf_counter()
        target.copy_(source)
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        if index:
            seconds.append(time.perf_counter() - started)
    del source, target
    if where.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size / statistics.median(seconds)


def job_floor(
    shape: ModelShape, job: dict[str, Any], *, dtype: str, rate_gflops: float, bandwidth: float
) -> dict[str, float]:
    """The job's floor (DESIGN.md, "Knowing the limit"): its work (the plan's minimum
    prefill tokens and every output token, ``flops.work_flop``) at the measured matmul rate,
    plus every decode step reading the weights once (the head included) at the measured
    bandwidth. Every row decodes at once, so the steps are the output tokens a row."""
    import torch

    prefill_keys, output_keys = attention_keys(
        [len(ids) for ids in job["token_ids"]], [job["output_tokens"]] * job["rows"]
    )
    flop = work_flop(
        shape,
        prefill_tokens=job["min_prefill_tokens"],
        output_tokens=job["rows"] * job["output_tokens"],
        prefill_keys=prefill_keys,
        output_keys=output_keys,
    )
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    weight_bytes = (shape.linear_weights() + shape.vocab_size * shape.hidden_size) * element
    compute, memory = flop / (rate_gflops * 1e9), job["output_tokens"] * weight_bytes / bandwidth
    return {
        "work_gflop": flop / 1e9,
        "rate_gflops": rate_gflops,
        "weight_bytes": weight_bytes,
        "decode_steps": job["output_tokens"],
        "compute_seconds": compute,
        "memory_seconds": memory,
        "floor_seconds": compute + memory,
    }
