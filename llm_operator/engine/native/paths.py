"""How the native engine runs a step: one frozen description, resolved once.

``engine.factory.native_paths`` resolves it when the engine starts, from the
``EngineConfig``, the device, the dtype and the model (loading and self-checking the
kernels it picks, falling back with a warning where they fail), and hands it to
``NativeBackend``. Nothing below chooses again: the backend, the step builder, the model
and the decode graphs read these fields.

    attention    the attention kernels: "cpp" (compiled CPU kernels), "triton", "torch"
    forward      "compiled": the C++ decoder runs whole steps (``models/cpu_decoder.py``);
                 "eager": the Python forward, layer by layer
    elementwise  the layers' norms, RoPE and SiLU between the GEMMs: "triton" or "eager"
    gemm         the projections and the LM head: "packed" (the compiled CPU kernel,
                 batch-invariant) or "aten" (``F.linear``); ``onednn_rows``: on CPUs with
                 AMX in bf16, steps of at least that many rows take oneDNN's linear (and
                 the eager forward)
    graphs       decode steps as CUDA graphs: "capture" (CUDA), "replay" (the graphs'
                 static buffers run eagerly: the CPU test of that path), "off"
    overlap      the next iteration scheduled while the device runs this one (greedy runs)
    quantization the projections' weights: "none" (float, the model dtype), "gguf" (the GGUF
                 file's blocks kept), "int8" (quantized at load); ``models/quant.py``
    invariant    batch-invariant attention (fixed key steps through block-aligned
                 segments) and GEMM: a row's tokens do not depend on its batch
    profile_ops  each iteration's seconds by kind of work (``op_profile.py``)
    fallbacks    what was asked for or preferred but does not run here, and why
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePaths:
    """The native engine's paths (module docstring)."""

    device: str
    dtype: str
    attention: str
    forward: str
    elementwise: str
    gemm: str
    onednn_rows: int | None
    graphs: str
    overlap: bool
    invariant: bool
    profile_ops: bool = False
    quantization: str = "none"
    fallbacks: tuple[str, ...] = ()

    @property
    def fused_store(self) -> bool:
        """Whether a layer stores K/V in the launch that rotates them (Triton regions and
        Triton attention, which share the cache layout)."""
        return self.attention == "triton" and self.elementwise == "triton"

    def describe(self) -> str:
        """One line for logs, the run profile and the CLI summary."""
        gemm = self.gemm if self.onednn_rows is None else f"{self.gemm}+onednn>={self.onednn_rows}"
        parts = [
            f"{self.device} {self.dtype}",
            f"attention={self.attention}",
            f"forward={self.forward}",
            f"elementwise={self.elementwise}",
            f"gemm={gemm}",
            f"graphs={self.graphs}",
            f"overlap={'on' if self.overlap else 'off'}",
            f"deterministic={'on' if self.invariant else 'off'}",
        ]
        if self.quantization != "none":
            parts.append(f"quantization={self.quantization}")
        if self.profile_ops:
            parts.append("profile_ops=on")
        text = ", ".join(parts)
        if self.fallbacks:
            text += " (" + "; ".join(self.fallbacks) + ")"
        return text
