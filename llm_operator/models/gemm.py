"""The native forward's linear layers: one GEMM per engine, chosen when the engine starts.

    packed  the compiled CPU kernel (``kernels/cpu_kernels.cpp``, ``packed_linear``) on a
            weight packed once at load time (``pack_weight``) as one stream per 16 output
            columns. It reduces each output over k in the same order at every row count,
            so a row gets the same bits alone or among 1,000 (the batch-invariant mode
            relies on it).
    aten    ``F.linear``: GPUs, and the torch path on the CPU.

On a CPU with AMX and bf16 weights, outside the batch-invariant mode, steps of at least
``onednn_rows`` rows take oneDNN's linear (AMX tiles, which the packed kernel does not
use). ``engine.factory.native_paths`` decides all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

CPU_GEMM_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: Tensor) -> Tensor | None:
    """``weight`` [out, in] packed for the compiled kernel (``cpu_ops.pack_linear_weight``),
    or None where that kernel cannot run it (not loaded in this process, not a CPU tensor,
    not fp32/bf16)."""
    from llm_operator.kernels import cpu_extension, cpu_ops

    if (
        weight.device.type != "cpu"
        or weight.dtype not in CPU_GEMM_DTYPES
        or weight.dim() != 2
        or cpu_extension.loaded() is None
    ):
        return None
    return cpu_ops.pack_linear_weight(cpu_extension.loaded(), weight)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's linear (``torch.ops.mkldnn``): AMX tiles for bf16 where the CPU has them."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Gemm(NamedTuple):
    """How every projection and the LM head of one engine multiply (module docstring).

    ``__call__(x [rows, in], weight [out, in], bias, packed)`` equals
    ``F.linear(x, weight, bias)`` up to rounding; ``packed`` is ``pack_weight(weight)``,
    which the packed kind needs. Build the packed kind with ``packed_gemm``.
    """

    kind: str = "aten"  # "packed" | "aten"
    onednn_rows: int | None = None  # AMX bf16: steps of at least this many rows on oneDNN
    packed_linear: Callable | None = None  # the compiled kernel (the packed kind)

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None
    ) -> Tensor:
        if self.onednn_rows is not None and x.shape[0] >= self.onednn_rows:
            return onednn_linear(x, weight, bias)
        if self.packed_linear is not None:
            assert packed is not None, f"no packed copy of a {tuple(weight.shape)} weight"
            return self.packed_linear(x, packed, bias, weight.shape[0])
        return nn.functional.linear(x, weight, bias)


ATEN_GEMM = Gemm("aten")


def packed_gemm(onednn_rows: int | None = None) -> Gemm:
    """The packed kind; the compiled CPU kernels must be loaded (``cpu_extension.load``)."""
    from llm_operator.kernels import cpu_extension

    module = cpu_extension.loaded()
    assert module is not None, "the packed GEMM needs the compiled CPU kernels loaded"
    return Gemm("packed", onednn_rows, module.packed_linear)
