"""AOTInductor packages of small tensor functions, built once per machine, cached on disk.

``torch.export`` traces a module's forward (the first axis of its 2-D inputs dynamic, at
least 1), inductor compiles it to a shared library (``aoti_compile_and_package``) and the
package's C++ runner executes it: no dynamo guards, no Python wrapper around the kernels.
Packages live in ``<inductor cache dir>/llm_operator_fused`` (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``), named by a hash of their key, torch's version, the
machine (CPU vector ISA or GPU model) and the source files they are built from.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# A package's runner: the module's tensor inputs, in order -> its outputs, flattened.
Runner = Callable[[list[Tensor]], list[Tensor]]


class PackageCache:
    """Runners of AOTInductor packages by key, loaded from ``directory`` or built into it.

    Contract: ``runners.get(key)`` is the runner built for ``key`` (None before ``build``).
    ``build(key, module, args, threads)`` exports ``module`` on random inputs shaped like
    ``args`` (same dtype and device; 2-D inputs get a dynamic token axis: the runner takes
    any number of rows >= 1; every other size is fixed), compiles it with
    ``emulate_precision_casts`` (bf16/fp16 rounded where eager rounds) and, on the CPU,
    ``threads`` OpenMP threads (1: no parallel region), unless the directory already holds
    the package. Runners trust their inputs: contiguous, of the built dtype, device and
    fixed sizes; callers check. ``log``: (key, "compiled" or "loaded", seconds). Builds
    are serialized in a process; across processes a package is written to a temporary
    name and renamed, so readers see whole files.
    """

    def __init__(self, directory: Path | None = None, sources: Sequence[Path] = ()) -> None:
        self.directory = directory
        self.sources = tuple(sources)
        self.runners: dict[tuple, Runner] = {}
        self.log: list[tuple[tuple, str, float]] = []
        self._lock = threading.Lock()
        self._digest: str | None = None

    def build(self, key: tuple, module: nn.Module, args: Sequence[Tensor], threads: int) -> Runner:
        """The runner for ``key``: loaded, or built first (see the class docstring)."""
        import torch._inductor

        with self._lock:
            if key in self.runners:
                return self.runners[key]
            started = time.perf_counter()
            device = args[0].device
            path = self._path(key, device)
            action = "loaded"
            if not path.is_file():
                self._compile(path, module, args, threads)
                action = "compiled"
            index = device.index if device.type == "cuda" and device.index is not None else -1
            runner = torch._inductor.aoti_load_package(str(path), device_index=index).loader.run
            self.runners[key] = runner
            self.log.append((key, action, time.perf_counter() - started))
            return runner

    def _compile(self, path: Path, module: nn.Module, args: Sequence[Tensor], threads: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {"emulate_precision_casts": True}
        if args[0].device.type == "cpu":
            options["cpp.threads"] = threads
        temporary = path.with_name(f"{path.stem}.{os.getpid()}-{threading.get_ident()}.pt2")
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations
            # Example rows: their count steers inductor's choice to parallelize loops.
            examples, dynamic_shapes = _examples(args, tokens=7 if threads == 1 else 257)
            exported = torch.export.export(module, examples, dynamic_shapes=dynamic_shapes)
            try:
                torch._inductor.aoti_compile_and_package(
                    exported, package_path=str(temporary), inductor_configs=options
                )
                os.replace(temporary, path)
            finally:
                temporary.unlink(missing_ok=True)

    def _path(self, key: tuple, device: torch.device) -> Path:
        from torch._inductor.runtime.runtime_utils import cache_dir

        if self._digest is None:
            digest = hashlib.sha256()
            for source in self.sources:
                digest.update(Path(source).read_bytes())
            self._digest = digest.hexdigest()
        root = self.directory or Path(cache_dir()) / "llm_operator_fused"
        identity = repr((key, torch.__version__, self._digest, _machine(device)))
        return root / f"{key[0]}-{hashlib.sha256(identity.encode()).hexdigest()[:24]}.pt2"


def _examples(args: Sequence[Tensor], tokens: int) -> tuple[tuple[Tensor, ...], tuple]:
    """Random stand-ins for ``args``, ``tokens`` rows for the 2-D ones, and export's
    dynamic shapes: their first axis, one shared Dim."""
    dim = torch.export.Dim("tokens", min=1)
    examples = tuple(
        torch.randn(tokens, a.shape[1], device=a.device).to(a.dtype)
        if a.dim() == 2
        else torch.randn(a.shape, device=a.device).to(a.dtype)
        for a in args
    )
    return examples, tuple({0: dim} if a.dim() == 2 else None for a in args)


def _machine(device: torch.device) -> str:
    """What generated code depends on besides torch: the CPU's vector ISA, the GPU model."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return f"{platform.machine()} {pick_vec_isa()}"
    except Exception:  # noqa: BLE001 - an internal API: the key only gets coarser
        return platform.machine()
