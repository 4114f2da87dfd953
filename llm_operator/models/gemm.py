"""The native forward's linear layers on the CPU: aten's GEMM or oneDNN's, chosen by measurement.

Which library multiplies faster depends on the processor and the shape: on one 2-core
AMD EPYC oneDNN's linear ran 1.2-1.6x aten's on prefill shapes; on a 2-core Intel Xeon
with AMX, aten ran 1.1-1.3x oneDNN's at 3,566 rows and oneDNN 1.5x aten's on some decode
shapes and 0.6x on others. So the first time a shape is seen, ``GemmChoice`` times both
on that very input and keeps the faster for every later call of that shape: rows are
bucketed by powers of two, so a job tunes a dozen or so shapes once, in milliseconds.

Both compute the same products; their rounding differs at the 1e-6 relative level (fp32).
``LLM_OPERATOR_GEMM=aten|onednn`` forces one (``auto``, the default, measures).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

GEMM_ENV = "LLM_OPERATOR_GEMM"
_CHOICES = ("auto", "aten", "onednn")
# Products smaller than this many multiply-adds are not worth timing (tiny test models):
# they take oneDNN's path when it exists.
MIN_TIMED_MACS = 1 << 22

LinearFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def _aten(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return nn.functional.linear(x, weight, bias)


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _onednn(torch.ones(2, 3), torch.ones(4, 3), None)
    except (AttributeError, RuntimeError):
        return False
    return True


_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def forced_choice() -> str:
    """``LLM_OPERATOR_GEMM`` (``auto`` when unset); ValueError for another value."""
    value = os.environ.get(GEMM_ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(_CHOICES)}, got {value!r}")
    return value


class GemmChoice:
    """Per CPU shape, the faster of aten's and oneDNN's linear, measured on first use.

    Contract: ``__call__(x, weight, bias)`` equals ``F.linear(x, weight, bias)`` up to
    rounding. Non-CPU tensors, other dtypes, inputs that are not 2-D, and machines without
    oneDNN always take aten's. A shape is (dtype, rows.bit_length(), out features, in
    features, bias or not); its first call runs each candidate twice (the first round
    warms them up) and keeps the faster (``choices`` shows what was chosen). Thread-safe.
    """

    def __init__(self, onednn: bool | None = None) -> None:
        self.onednn = _onednn_available() if onednn is None else onednn
        self.choices: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not (
            self.onednn and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dim() == 2
        ):
            return _aten(x, weight, bias)
        forced = forced_choice()
        if forced != "auto":
            return (_onednn if forced == "onednn" else _aten)(x, weight, bias)
        rows, (out_features, in_features) = x.shape[0], weight.shape
        if rows * out_features * in_features < MIN_TIMED_MACS:
            return _onednn(x, weight, bias)
        key = (x.dtype, rows.bit_length(), out_features, in_features, bias is not None)
        name = self.choices.get(key)
        if name is None:
            with self._lock:
                name = self.choices.get(key) or self._measure(key, x, weight, bias)
        return (_onednn if name == "onednn" else _aten)(x, weight, bias)

    def tune(self, weights: list[Tensor], max_rows: int) -> None:
        """Measure every power-of-two row count up to ``max_rows`` for these weights
        ([out, in], as the model holds them) on random inputs, so a job's first
        iterations don't pay for it (an engine calls this when it starts)."""
        shapes = {(tuple(w.shape), w.dtype): w for w in weights}  # one weight per shape
        for weight in shapes.values():
            if weight.device.type != "cpu" or weight.dtype not in _ONEDNN_DTYPES:
                continue
            for power in range(max(1, max_rows).bit_length()):
                x = torch.randn(1 << power, weight.shape[1], dtype=weight.dtype)
                self(x, weight)

    def _measure(self, key: tuple, x: Tensor, weight: Tensor, bias: Tensor | None) -> str:
        best: dict[str, float] = {}
        for _ in range(2):  # the first round also warms both up
            for name, fn in (("aten", _aten), ("onednn", _onednn)):
                started = time.perf_counter()
                fn(x, weight, bias)
                elapsed = time.perf_counter() - started
                best[name] = min(best.get(name, elapsed), elapsed)
        name = min(best, key=best.__getitem__)
        self.choices[key] = name
        return name


# One per process: the measurements describe this machine, not a model or a job.
DEFAULT_GEMM = GemmChoice()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` on the CPU GEMM measured fastest for this shape (``DEFAULT_GEMM``)."""
    return DEFAULT_GEMM(x, weight, bias)
