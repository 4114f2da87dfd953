"""The Triton self-checks, proven in a child process before they run in this one.

``self_check.check_triton`` (attention) and ``self_check_fused.check_triton_fused`` (the
elementwise kernels) compile and launch Triton kernels: a kernel (or a driver, or a Triton
build) that crashes takes the process with it. ``proven_check_triton`` and
``proven_check_triton_fused`` run the same check in a child process first
(``artifact_proof.prove``; a one-shot child, which frees its CUDA context before the engine
sizes its KV cache), and in this process only when the child passed. The child's verdict
is cached on disk, in ``$LLM_OPERATOR_CACHE/proofs`` (default
``~/.cache/llm-operator/proofs``), per machine kind (GPU model, compute capability,
driver), check arguments, kernel sources (``_SOURCES``: editing one proves again),
Triton, torch and Python.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from llm_operator.kernels import artifact_proof, self_check, self_check_fused

__all__ = [
    "FUSED_PROBE",
    "PROBE",
    "prove_triton",
    "prove_triton_fused",
    "proven_check_triton",
    "proven_check_triton_fused",
]

# The children's entry points; tests point them at a crashing probe.
PROBE = "llm_operator.kernels.triton_proof:prove_triton"
FUSED_PROBE = "llm_operator.kernels.triton_proof:prove_triton_fused"
# What the checks' outcomes depend on besides the machine: these sources and Triton.
_SOURCES = (
    "triton_attention.py", "self_check.py", "torch_attention.py", "metadata.py",
    "triton_fused.py", "triton_fused_kernels.py", "self_check_fused.py",
)  # fmt: skip


def proven_check_triton(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    windowed: bool = False,
) -> str | None:
    """``self_check.check_triton``'s result, run first in a child process (``PROBE``,
    cached): the child's failure (a crash, a hang, a disagreement) when it failed there,
    else ``check_triton`` run in this process. ValueError for a bad dtype or head shape.
    ``windowed``: also the sliding-window kernel (``check_triton``'s)."""
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
    if windowed:  # absent otherwise: the window-less proofs keep their arguments
        arguments["windowed"] = True
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
        device, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        **_windowed(windowed),
    )  # fmt: skip


def prove_triton(
    device: str, dtype: str, num_heads: int, num_kv_heads: int, head_dim: int,
    windowed: bool = False,
) -> str | None:  # fmt: skip
    """The child's side of ``proven_check_triton``: ``check_triton`` on JSON-able arguments."""
    return self_check.check_triton(
        device,
        getattr(torch, dtype),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        **_windowed(windowed),
    )


def _windowed(windowed: bool) -> dict:
    """``check_triton``'s windowed argument, passed only when set (a window-less call keeps
    the arguments it always had)."""
    return {"windowed": True} if windowed else {}


def proven_check_triton_fused(
    device: torch.device | str,
    dtype: torch.dtype,
    reference: str,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    eps: float = 1e-6,
    identity: str = "",
) -> str | None:
    """``self_check_fused.check_triton_fused``'s result, run first in a child process
    (``FUSED_PROBE``, cached): the child's failure (a crash, a hang, a disagreement) when it
    failed there, else the check run in this process. ``reference``: "module:attribute"
    naming the eager regions; ``identity``: what else the outcome depends on (the
    reference's sources). ValueError for a bad dtype or size."""
    device = torch.device(device)
    sizes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
             "hidden_size": hidden_size, "intermediate_size": intermediate_size}  # fmt: skip
    self_check_fused.check_arguments(dtype, **sizes)
    arguments = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "reference": reference,
        "eps": float(eps),
        **sizes,
    }
    verdict = artifact_proof.prove(
        "Triton fused self-check",
        FUSED_PROBE,
        arguments,
        directory=artifact_proof.default_directory(),
        identity=f"{_identity()} {identity}".strip(),
        device=str(device) if device.type == "cuda" else "cpu",
    )
    if not verdict.passed:
        return self_check._clip(f"it failed in a child process: {verdict.reason}")
    artifact_proof.announce_load("the Triton elementwise kernels (self-check) on", device)
    return self_check_fused.check_triton_fused(device, dtype, reference, eps=eps, **sizes)


def prove_triton_fused(device: str, dtype: str, reference: str, **sizes: Any) -> str | None:
    """The child's side of ``proven_check_triton_fused``: ``check_triton_fused`` on
    JSON-able arguments (the sizes and ``eps``)."""
    return self_check_fused.check_triton_fused(device, getattr(torch, dtype), reference, **sizes)


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
