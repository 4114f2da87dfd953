"""The machine's matmul rate on the model's own shapes, measured at the start of each run.

``measure_matmul_rate`` times ``torch.nn.functional.linear`` on one layer's projections (the
fused qkv, o_proj, gate_up and down weights) for a prefill-sized batch of tokens, per dtype,
on this process's torch threads. The benchmark divides each system's GFLOP/s by the rate of
its dtype ("% rate"): how close the system comes to what plain PyTorch matmuls reach here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from llm_operator_bench.core.flops import ModelShape

RATE_TOKENS = 1024
RATE_DTYPES = ("float32", "bfloat16")
WARMUP = 3
WARMUP_SECONDS = 0.1  # warm-up calls continue (past WARMUP) until a shape has run this long
REPEATS = 9
SECONDS_PER_SHAPE = 2.0  # fewer repetitions (at least one) once a shape has taken this long


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_linear(x, weight, device, *, warmup: int, repeats: int, linear=None) -> list[float]:
    """Seconds of ``repeats`` calls of linear(x, weight) (torch's, unless given) after at
    least ``warmup`` untimed ones (and WARMUP_SECONDS of them); fewer repeats once
    SECONDS_PER_SHAPE have passed."""
    import torch

    linear = linear or torch.nn.functional.linear
    started, calls = time.perf_counter(), 0
    while calls < warmup or (warmup and time.perf_counter() - started < WARMUP_SECONDS):
        linear(x, weight)  # first calls: oneDNN/AMX set-up, caches
        _synchronize(device)
        calls += 1
    seconds: list[float] = []
    while len(seconds) < repeats and (not seconds or sum(seconds) < SECONDS_PER_SHAPE):
        started = time.perf_counter()
        linear(x, weight)
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def measure_matmul_rate(
    shape: ModelShape,
    *,
    tokens: int = RATE_TOKENS,
    dtypes: Sequence[str] = RATE_DTYPES,
    device: str = "auto",
    warmup: int = WARMUP,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """GFLOP/s of torch linear on ``shape``'s projections at M = ``tokens``, per dtype.

    Each projection is timed on its own (median of ``repeats`` after ``warmup``); a dtype's
    rate is the FLOP of all four over the sum of their medians. Returns ``{"tokens",
    "threads", "device", "shapes": [[name, in, out]], <dtype>: {"gflops", "by_shape":
    {name: gflops}} or {"error": why}}``; a dtype this machine cannot multiply in gets
    its error instead of a rate.
    """
    import torch

    from llm_operator.models import resolve_device

    if tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need tokens >= 1, repeats >= 1, warmup >= 0; got {tokens=}, {repeats=}, {warmup=}"
        )
    where = resolve_device(device)
    shapes = shape.linear_shapes()
    result: dict[str, Any] = {
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "device": str(where),
        "shapes": [list(item) for item in shapes],
    }
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype {name!r} is not a torch dtype")
            try:

                def operands(rows, cols, dtype=dtype):
                    x = torch.randn(tokens, rows, generator=generator).to(where, dtype)
                    return x, torch.randn(cols, rows, generator=generator).to(where, dtype), None

                result[name] = _rate_on_shapes(shapes, tokens, where, warmup, repeats, operands)
            except (RuntimeError, TypeError) as error:  # e.g. no kernel for this dtype here
                result[name] = {"error": f"{type(error).__name__}: {error}"}
        if where.type == "cpu":
            result.update(_quantized_rates(shapes, tokens, warmup, repeats, generator))
    return result


QUANTIZED_RATES = ("int8-q4", "int8-q8")  # our quantized kernel: 4- and 8-bit weights


def _quantized_rates(shapes, tokens: int, warmup: int, repeats: int, generator) -> dict:
    """GOP/s of the compiled kernel's quantized linear (int8 dot products, fp32 activations
    quantized per row) on the same shapes, with 4-bit and 8-bit weights; {} without the
    compiled kernels or where the input features are not groups of 32."""
    import torch

    from llm_operator.kernels import cpu_extension
    from llm_operator.models import quant

    module = cpu_extension.load()
    if module is None or any(rows % quant.GROUP for _, rows, _ in shapes):
        return {}
    result = {}
    for name, bits in zip(QUANTIZED_RATES, (4, 8), strict=True):

        def operands(rows, cols, bits=bits):
            weight = quant.quantize_int8(torch.randn(cols, rows, generator=generator))
            if bits == 4:
                weight = weight._replace(q=weight.q >> 4, bits=4)

            def linear(x, packed):
                return module.packed_linear(x, packed, None, cols)

            return torch.randn(tokens, rows, generator=generator), quant.pack(weight), linear

        result[name] = _rate_on_shapes(
            shapes, tokens, torch.device("cpu"), warmup, repeats, operands
        )
    return result


def _rate_on_shapes(shapes, tokens: int, device, warmup: int, repeats: int, operands) -> dict:
    """{"gflops", "by_shape"}: each projection timed on its own (the median of
    ``_time_linear``) with ``operands(in, out)`` -> (x, weight, linear or None for torch's);
    the rate is the FLOP of all over the sum of their medians."""
    by_shape: dict[str, float] = {}
    total_flop, total_seconds = 0.0, 0.0
    for projection, rows, cols in shapes:
        x, weight, linear = operands(rows, cols)
        seconds = statistics.median(
            _time_linear(x, weight, device, warmup=warmup, repeats=repeats, linear=linear)
        )
        flop = 2.0 * tokens * rows * cols
        by_shape[projection] = flop / seconds / 1e9
        total_flop += flop
        total_seconds += seconds
    return {"gflops": total_flop / total_seconds / 1e9, "by_shape": by_shape}


def rate_for(rates: dict[str, Any] | None, dtype: str | None) -> float | None:
    """The measured GFLOP/s for ``dtype`` (e.g. "bfloat16" or "torch.bfloat16"), or None."""
    if not rates or not dtype:
        return None
    entry = rates.get(str(dtype).removeprefix("torch."))
    return entry.get("gflops") if isinstance(entry, dict) else None


def describe_rate(rates: dict[str, Any] | None, unit: str = "GFLOP/s") -> str:
    """One line for the report header, e.g. "float32 160 GFLOP/s, bfloat16 402 GFLOP/s"."""
    if not rates:
        return "not measured"
    parts = []
    for key, entry in rates.items():
        if isinstance(entry, dict) and "gflops" in entry:
            parts.append(f"{key} {entry['gflops']:.0f} {unit}")
        elif isinstance(entry, dict) and "error" in entry:
            parts.append(f"{key} unavailable ({entry['error'].splitlines()[0][:60]})")
    return ", ".join(parts) or "not measured"


def describe_rates(rates: dict[str, Any] | None) -> str:
    """torch's linear per dtype, then the compiled quantized kernel's where it was measured,
    e.g. "torch linear float32 74 GFLOP/s, ...; the compiled quantized kernel int8-q4 91 GOP/s"."""
    if not rates:
        return "not measured"
    line = f"torch linear {describe_rate({k: rates[k] for k in RATE_DTYPES if k in rates})}"
    quantized = {k: rates[k] for k in QUANTIZED_RATES if k in rates}
    if quantized:
        line += f"; the compiled quantized kernel {describe_rate(quantized, unit='GOP/s')}"
    return line
