"""The Triton self-check, proven in a child process before it runs in this one.

``check_triton`` compiles and launches every Triton kernel: a kernel (or a driver, or a
Triton build) that crashes takes the process with it. ``proven_check_triton`` runs the same
check in a child process first (``artifact_proof.prove``), and in this process only when
the child passed. The child's verdict is cached on disk, in ``$LLM_OPERATOR_CACHE/proofs``
(default ``~/.cache/llm-operator/proofs``), per machine kind (GPU model, compute
capability, driver), check arguments, kernel sources, Triton, torch and Python.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from llm_operator.kernels import artifact_proof, self_check

__all__ = ["PROBE", "prove_triton", "proven_check_triton"]

# The child's entry point; tests point it at a crashing probe.
PROBE = "llm_operator.kernels.triton_proof:prove_triton"
# What the check's outcome depends on besides the machine: these sources and Triton.
_SOURCES = ("triton_attention.py", "self_check.py", "torch_attention.py", "metadata.py")


def proven_check_triton(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
) -> str | None:
    """``self_check.check_triton``'s result, run first in a child process (``PROBE``,
    cached): the child's failure (a crash, a hang, a disagreement) when it failed there,
    else ``check_triton`` run in this process. ValueError for a bad dtype or head shape."""
    device = torch.device(device)
    if dtype not in self_check.OUT_TOLERANCE:
        raise ValueError(
            f"dtype must be one of {sorted(map(str, self_check.OUT_TOLERANCE))}, got {dtype}"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    arguments = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    verdict = artifact_proof.prove(
        "Triton self-check",
        PROBE,
        arguments,
        directory=artifact_proof.default_directory(),
        identity=_identity(),
        device=str(device) if device.type == "cuda" else "cpu",
    )
    if not verdict.passed:
        return self_check._clip(f"it failed in a child process: {verdict.reason}")
    artifact_proof.announce_load("the Triton attention kernels (self-check) on", device)
    return self_check.check_triton(
        device, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )


def prove_triton(
    device: str, dtype: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """The child's side of ``proven_check_triton``: ``check_triton`` on JSON-able arguments."""
    return self_check.check_triton(
        device,
        getattr(torch, dtype),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _identity() -> str:
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update(Path(__file__).with_name(name).read_bytes())
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = "none"
    return f"sources {digest.hexdigest()} triton {version}"
