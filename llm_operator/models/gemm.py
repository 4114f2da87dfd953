"""The native forward's linear layers on the CPU: aten's GEMM, oneDNN's or our packed
kernel, chosen by measurement.

Which one multiplies faster depends on the processor and the shape: on one 2-core AMD
EPYC oneDNN's linear ran 1.2-1.6x aten's on prefill shapes; on a 2-core Intel Xeon with
AMX, aten ran 1.1-1.3x oneDNN's at 3,566 rows and oneDNN 1.5x aten's on some decode shapes
and 0.6x on others. The compiled kernel (``kernels/cpu_kernels.cpp``, ``packed_linear``)
reads a weight packed once at load time (``pack_weight``) as one stream per 16 output
columns: on that AMD EPYC it streams SmolLM2's fp32 weights at ~29 GB/s for one decode row
where oneDNN reached ~14, and ran 1.2-1.5x oneDNN's at 16-1,024 rows. So the first time a
shape is seen on a machine kind, ``GemmChoice`` times each candidate on that very input
and keeps the fastest for every later call of that shape: rows are bucketed by powers of
two, so a job tunes a dozen or so shapes once, in milliseconds (``tune`` does it when an
engine starts). The choice is stored for the machine kind (``gemm_store``): later
processes of that kind read it instead of timing again, so they all round alike.

All compute the same products; their rounding differs at the 1e-6 relative level (fp32).
``LLM_OPERATOR_GEMM=aten|onednn|packed`` forces one (``auto``, the default, measures;
``packed`` falls back to aten for a weight that has no packed copy).

Batch invariance (``InvariantGemm``, the engine's ``deterministic`` mode): aten's and
oneDNN's fp32 GEMMs round a row differently at one row (a matrix-vector product) than beside
others, and the choice itself depends on the row count. The packed kernel reduces each
output over k in the same order for every row whatever the row count (rows only share the
weight loads), so a row gets the same bits alone or among 1,000: ``InvariantGemm`` takes it
at every row count.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from llm_operator.models.gemm_store import GemmStore, default_store

GEMM_ENV = "LLM_OPERATOR_GEMM"
_CHOICES = ("auto", "aten", "onednn", "packed")
# Products smaller than this many multiply-adds are not worth timing (tiny test models):
# they take oneDNN's path when it exists.
MIN_TIMED_MACS = 1 << 22
# Row counts up to this stream the weight from memory (decode steps): tuned over all of a
# shape's weights in turn (see ``GemmChoice.tune``).
STREAM_ROWS = 64

LinearFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


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


def pack_weight(weight: Tensor) -> Tensor | None:
    """``weight`` [out, in] packed for the compiled kernel (``cpu_ops.pack_linear_weight``),
    or None where that kernel cannot run it (not loaded in this process, not a CPU tensor,
    not fp32/bf16)."""
    from llm_operator.kernels import cpu_extension, cpu_ops

    if (
        weight.device.type != "cpu"
        or weight.dtype not in cpu_ops.CPU_DTYPES
        or weight.dim() != 2
        or cpu_extension.loaded() is None
    ):
        return None
    return cpu_ops.pack_linear_weight(cpu_extension.loaded(), weight)


def _packed_kernel():
    from llm_operator.kernels import cpu_extension

    module = cpu_extension.loaded()
    return None if module is None else module.packed_linear


def forced_choice() -> str:
    """``LLM_OPERATOR_GEMM`` (``auto`` when unset); ValueError for another value."""
    value = os.environ.get(GEMM_ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(_CHOICES)}, got {value!r}")
    return value


class GemmChoice:
    """Per CPU shape, the fastest of aten's, oneDNN's and the packed linear, measured on
    first use.

    Contract: ``__call__(x, weight, bias, packed)`` equals ``F.linear(x, weight, bias)`` up
    to rounding; ``packed`` is ``pack_weight(weight)`` or None (then the packed kernel is no
    candidate). Non-CPU tensors, other dtypes and inputs that are not 2-D always take
    aten's. A shape is (dtype, rows.bit_length(), out features, in features, bias or not,
    packed or not); its first call runs each candidate twice (the first round warms them
    up) and keeps the fastest (``choices`` shows what was chosen). Products too small to
    time take the packed kernel, else oneDNN's where they exist. Thread-safe.
    """

    def __init__(
        self, onednn: bool | None = None, store: GemmStore | None | str = "default"
    ) -> None:
        """store: where choices are kept across processes; "default": this machine kind's
        (``gemm_store.default_store``, resolved at each first measurement of a shape, as
        the cache folder and the loaded kernels say then); None: this process only."""
        self.onednn = _onednn_available() if onednn is None else onednn
        self.choices: dict[tuple, str] = {}
        self.store = store
        self._lock = threading.Lock()

    def _stored(self) -> GemmStore | None:
        if self.store != "default":
            return self.store
        return default_store(self.onednn)

    def _choose(self, key: tuple, measure: Callable[[], str]) -> str:
        """``key``'s choice: the one stored for this machine kind, else measured now and
        stored (or, when another process stored one meanwhile, that one)."""
        store = self._stored()
        name = store.get(key) if store is not None else None
        if name is None:
            name = measure()
            if store is not None:
                name = store.record(key, name)
        self.choices[key] = name
        return name

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if not (x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dim() == 2):
            return _aten(x, weight, bias)
        kernel = None
        if packed is not None and packed.dtype == x.dtype:
            kernel = _packed_kernel()
        forced = forced_choice()
        if forced != "auto":
            return self._run(forced, x, weight, bias, packed, kernel)
        rows, (out_features, in_features) = x.shape[0], weight.shape
        if rows * out_features * in_features < MIN_TIMED_MACS:
            name = "packed" if kernel is not None else "onednn"
            return self._run(name, x, weight, bias, packed, kernel)
        key = (x.dtype, rows.bit_length(), out_features, in_features, bias is not None,
               kernel is not None)  # fmt: skip
        name = self.choices.get(key)
        if name is None:
            with self._lock:
                name = self.choices.get(key) or self._choose(
                    key, partial(self._measure_one, x, weight, bias, packed, kernel)
                )
        return self._run(name, x, weight, bias, packed, kernel)

    def prefers_packed(
        self, rows: int, weight: Tensor, packed: Tensor | None, bias: bool
    ) -> bool | None:
        """Whether ``__call__`` would take the packed kernel for ``rows`` rows of this
        weight (with a bias or not): True or False, or None while that shape is unmeasured."""
        if packed is None or packed.dtype != weight.dtype or _packed_kernel() is None:
            return False
        forced = forced_choice()
        if forced != "auto":
            return forced == "packed"
        out_features, in_features = weight.shape
        if rows * out_features * in_features < MIN_TIMED_MACS:
            return True
        name = self.choices.get(
            (weight.dtype, rows.bit_length(), out_features, in_features, bias, True)
        )
        return None if name is None else name == "packed"

    def _run(self, name: str, x, weight, bias, packed, kernel) -> Tensor:
        """Candidate ``name``; aten's where that one is not available for this call."""
        if name == "packed" and kernel is not None:
            return kernel(x, packed, bias, weight.shape[0])
        if name == "onednn" and self.onednn:
            return _onednn(x, weight, bias)
        return _aten(x, weight, bias)

    def tune(self, weights: list[tuple[Tensor, Tensor | None]], max_rows: int) -> None:
        """Measure every power-of-two row count up to ``max_rows`` for these (weight
        [out, in], packed or None) pairs, so a job's first iterations don't pay for it (an
        engine calls this when it starts).

        Up to ``STREAM_ROWS`` rows a linear streams its weight from memory (a decode step
        reads each layer's once), so those counts are timed over every weight of a shape in
        turn, as a step reads them; a larger count reuses each weight from cache for many
        rows and is timed on one weight, as ``__call__`` times a shape it has not seen.
        """
        groups: dict[tuple, list[tuple[Tensor, Tensor | None]]] = {}
        for weight, packed in weights:
            if weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES:
                key = (tuple(weight.shape), weight.dtype, packed is not None)
                groups.setdefault(key, []).append((weight, packed))
        for pairs in groups.values():
            weight, packed = pairs[0]
            kernel = (
                _packed_kernel() if packed is not None and packed.dtype == weight.dtype else None
            )
            out_features, in_features = weight.shape
            for power in range(max(1, max_rows).bit_length()):
                rows = 1 << power
                x = torch.randn(rows, in_features, dtype=weight.dtype)
                key = (weight.dtype, rows.bit_length(), out_features, in_features, False,
                       kernel is not None)  # fmt: skip
                if rows > STREAM_ROWS or len(pairs) == 1:
                    self(x, weight, None, packed)
                elif rows * out_features * in_features >= MIN_TIMED_MACS:
                    with self._lock:
                        self._choose(key, partial(self._measure, x, pairs, kernel))

    def _measure_one(self, x, weight, bias, packed, kernel) -> str:
        names = ["aten"] + ["onednn"] * self.onednn + ["packed"] * (kernel is not None)
        best: dict[str, float] = {}
        # the first round also warms each up; a product of 2**30 multiply-adds or more
        # (about 10 ms) is timed once: set-up costs are lost in it
        rounds = 2 if x.shape[0] * weight.shape[0] * weight.shape[1] < 1 << 30 else 1
        for _ in range(rounds):
            for name in names:
                started = time.perf_counter()
                self._run(name, x, weight, bias, packed, kernel)
                elapsed = time.perf_counter() - started
                best[name] = min(best.get(name, elapsed), elapsed)
        return min(best, key=best.__getitem__)

    def _measure(self, x: Tensor, pairs, kernel) -> str:
        """Time each candidate on x against every (weight, packed) of ``pairs`` in turn (the
        first round also warms each up); returns the fastest's name."""
        names = ["aten"] + ["onednn"] * self.onednn + ["packed"] * (kernel is not None)
        best: dict[str, float] = {}
        for _ in range(2):
            for name in names:
                started = time.perf_counter()
                for weight, packed in pairs:
                    self._run(name, x, weight, None, packed, kernel)
                elapsed = time.perf_counter() - started
                best[name] = min(best.get(name, elapsed), elapsed)
        return min(best, key=best.__getitem__)


class InvariantGemm(GemmChoice):
    """Batch-invariant: the packed kernel at every row count wherever the weight has a packed
    copy of the input's dtype and the compiled kernels are loaded (else aten's, which is
    batch-invariant only where it runs alone: not on the CPU). Nothing is timed;
    ``LLM_OPERATOR_GEMM`` does not apply."""

    def __init__(self) -> None:
        super().__init__(onednn=False, store=None)

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and self.packs(weight, packed):
            return _packed_kernel()(x, packed, bias, weight.shape[0])
        return _aten(x, weight, bias)

    @staticmethod
    def packs(weight: Tensor, packed: Tensor | None) -> bool:
        """Whether this weight's products run on the packed kernel."""
        return packed is not None and packed.dtype == weight.dtype and _packed_kernel() is not None

    def prefers_packed(
        self, rows: int, weight: Tensor, packed: Tensor | None, bias: bool
    ) -> bool | None:
        return self.packs(weight, packed)

    def tune(self, weights: list[tuple[Tensor, Tensor | None]], max_rows: int) -> None:
        """Nothing to measure."""


# One per process: the measurements describe this machine, not a model or a job.
DEFAULT_GEMM = GemmChoice()
INVARIANT_GEMM = InvariantGemm()


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
) -> Tensor:
    """``F.linear`` on the CPU GEMM measured fastest for this shape (``DEFAULT_GEMM``);
    ``packed``: ``pack_weight(weight)``, which makes the packed kernel a candidate."""
    return DEFAULT_GEMM(x, weight, bias, packed)
