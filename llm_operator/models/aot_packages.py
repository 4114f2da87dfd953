"""AOTInductor packages of small tensor functions, built once per machine, cached on disk.

``torch.export`` traces a module's forward (the first axis of its 2-D inputs dynamic, at
least 1), inductor compiles it to a shared library (``aoti_compile_and_package``) and the
package's C++ runner executes it: no dynamo guards, no Python wrapper around the kernels.
Packages live in ``<inductor cache dir>/llm_operator_fused`` (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``), named by a hash of their key, torch's version, the
machine (CPU vector ISA or GPU model) and the source files they are built from.

No package is loaded into this process before it is proven in a child process
(``llm_operator.kernels.artifact_proof``): the child loads it, runs it on random inputs
shaped like the build's (1 and 7 rows), and compares its outputs with the eager module's;
the verdict is cached beside the package, once per machine kind. A package that crashes,
hangs or disagrees there raises ``PackageProofError`` here instead of taking the process
down (``fused.CompiledOps`` then runs every region eagerly, after one RuntimeWarning).
A package not yet on disk is built by that child too (``build_package``: export, compile
to a temporary name, then the proof; ``artifact_proof.prove_build`` renames it into place
and records the verdict), so this process only loads; and on the CPU the children
are one ``ProbeWorker``, which imports torch and inductor once for all of a process's
packages (on CUDA one child each: a CUDA context must not outlive its proof). With
``LLM_OPERATOR_PROVE=off`` packages are built and loaded here, unproven.
"""

from __future__ import annotations

import hashlib
import importlib
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

from llm_operator.kernels import artifact_proof

# A package's runner: the module's tensor inputs, in order -> its outputs, flattened.
Runner = Callable[[list[Tensor]], list[Tensor]]
# The eager module a package is checked against in its proof: ("module:Class", init args).
Reference = tuple[str, Sequence[Any]]
PROBE = "llm_operator.models.aot_packages:prove_package"
BUILD_PROBE = "llm_operator.models.aot_packages:build_package"  # builds, then PROBE's checks
# A package's outputs against its eager module's on the proof's random inputs: rounding
# apart (bf16/fp16: a couple of ulp), they agree.
PROOF_TOLERANCE: dict[str, dict[str, float]] = {
    "float32": {"atol": 1e-4, "rtol": 1e-4},
    "float16": {"atol": 4e-3, "rtol": 4e-3},
    "bfloat16": {"atol": 3.2e-2, "rtol": 3.2e-2},
}


class PackageProofError(RuntimeError):
    """A package failed its proof in a child process, so it was not loaded here."""


class PackageCache:
    """Runners of AOTInductor packages by key, loaded from ``directory`` or built into it.

    Contract: ``runners.get(key)`` is the runner built for ``key`` (None before ``build``).
    ``build(key, module, args, threads)`` exports ``module`` on random inputs shaped like
    ``args`` (same dtype and device; 2-D inputs get a dynamic token axis: the runner takes
    any number of rows >= 1; every other size is fixed), compiles it with
    ``emulate_precision_casts`` (bf16/fp16 rounded where eager rounds) and, on the CPU,
    ``threads`` OpenMP threads (1: no parallel region), unless the directory already holds
    the package. Before loading it, proves it in a child process (module docstring;
    ``reference``: the eager module to compare with there, else it only has to run) and
    raises ``PackageProofError`` when that fails. With a ``reference`` (and proofs on) that
    child also builds the package (``build_package``), so this process only loads it.
    Runners trust their inputs: contiguous, of the built dtype, device and fixed sizes;
    callers check. ``log``: (key, "compiled" or "loaded", seconds). Builds are serialized
    in a process, and across processes under a file lock; a package is written to a
    temporary name and renamed, so readers see whole files.
    """

    def __init__(self, directory: Path | None = None, sources: Sequence[Path] = ()) -> None:
        self.directory = directory
        self.sources = tuple(sources)
        self.runners: dict[tuple, Runner] = {}
        self.log: list[tuple[tuple, str, float]] = []
        self._lock = threading.Lock()
        self._digest: str | None = None

    def build(
        self,
        key: tuple,
        module: nn.Module,
        args: Sequence[Tensor],
        threads: int,
        reference: Reference | None = None,
    ) -> Runner:
        """The runner for ``key``: loaded, or built first (see the class docstring)."""
        import torch._inductor

        with self._lock:
            if key in self.runners:
                return self.runners[key]
            started = time.perf_counter()
            device = args[0].device
            path = self._path(key, device)
            action = "loaded" if path.is_file() else "compiled"
            proven_build = reference is not None and artifact_proof.prove_mode() != "off"
            if action == "compiled" and not proven_build:  # trusted, or proved below
                self._compile(path, module, args, threads)
            index = device.index if device.type == "cuda" and device.index is not None else -1
            _prove(path, args, reference, device, index, threads)  # a child builds it if absent
            artifact_proof.announce_load("the AOTInductor package", path)
            runner = torch._inductor.aoti_load_package(str(path), device_index=index).loader.run
            self.runners[key] = runner
            self.log.append((key, action, time.perf_counter() - started))
            return runner

    def _compile(self, path: Path, module: nn.Module, args: Sequence[Tensor], threads: int) -> None:
        """Build the package in this process (unproven: with proofs off, or no reference)."""
        temporary = path.with_name(f"{path.stem}.{os.getpid()}-{threading.get_ident()}.pt2")
        try:
            compile_package(temporary, module, args, threads)
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


def compile_package(path: Path, module: nn.Module, args: Sequence[Tensor], threads: int) -> None:
    """Export ``module`` (2-D inputs' first axis dynamic) and compile it to the package
    ``path`` (``PackageCache``'s options: ``emulate_precision_casts``, ``threads`` on the
    CPU); ``args``: inputs of the build's dtypes, devices and fixed sizes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"emulate_precision_casts": True}
    if args[0].device.type == "cpu":
        options["cpp.threads"] = threads
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations
        # Example rows: their count steers inductor's choice to parallelize loops.
        examples, dynamic_shapes = _examples(args, tokens=7 if threads == 1 else 257)
        exported = torch.export.export(module, examples, dynamic_shapes=dynamic_shapes)
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(path), inductor_configs=options
        )


def _prove(
    path: Path,
    args: Sequence[Tensor],
    reference: Reference | None,
    device: torch.device,
    index: int,
    threads: int = 1,
) -> None:
    """Raise PackageProofError unless ``path`` passed ``prove_package`` in a child process;
    when ``path`` is absent, that child builds it first (``build_package``: ``reference``
    compiled with ``threads``)."""
    where = "cpu" if device.type == "cpu" else (f"cuda:{index}" if index >= 0 else "cuda")
    arguments = {
        "path": str(path),
        "inputs": [_input_spec(a) for a in args],
        "reference": None if reference is None else reference[0],
        "init": [] if reference is None else list(reference[1]),
        "device": where,
        "device_index": index,
    }
    name = f"AOTInductor package {path.name}"
    shared = device.type == "cpu"  # one child for all; a CUDA context must not outlive its proof
    if path.is_file() or reference is None:
        verdict = artifact_proof.prove(
            name, PROBE, arguments, artifact=path, device=where, shared=shared
        )
    else:
        build_arguments = {**arguments, "threads": threads}
        del build_arguments["path"]
        verdict = artifact_proof.prove_build(
            name, PROBE, arguments, artifact=path, build=BUILD_PROBE,
            build_arguments=build_arguments, device=where, shared=shared,
        )  # fmt: skip
    if not verdict.passed:
        raise PackageProofError(
            f"{path.name} failed its proof, so it is not loaded: {verdict.reason} "
            f"(verdict in {verdict.path}; delete it to prove the package again)"
        )


def _input_spec(arg: Tensor) -> dict[str, Any]:
    """What the proof makes an input of: its shape (a 2-D input's rows None: the package
    takes any count, and the verdict must not depend on the first call's) and dtype."""
    shape: list[int | None] = list(arg.shape)
    if arg.dim() == 2:
        shape[0] = None
    return {"shape": shape, "dtype": str(arg.dtype).removeprefix("torch.")}


def build_package(
    staged: str,
    inputs: list[dict[str, Any]],
    reference: str,
    init: list[Any],
    threads: int,
    device: str,
    device_index: int,
) -> str | None:
    """A build in a child process (``artifact_proof.prove_build``): ``reference``'s module
    ("module:Class", built from ``init``) compiled for inputs like ``inputs`` on ``device``
    with ``threads`` (``compile_package``) to ``staged``, then ``prove_package``'s checks
    there. None when it agrees, else the first disagreement."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target)
    args = [
        torch.zeros([1 if size is None else size for size in spec["shape"]],
                    dtype=getattr(torch, spec["dtype"]), device=target)
        for spec in inputs
    ]  # fmt: skip
    compile_package(Path(staged), _eager_module(reference, init), args, threads)
    return prove_package(staged, inputs, reference, init, device, device_index)


def prove_package(
    path: str,
    inputs: list[dict[str, Any]],
    reference: str | None,
    init: list[Any],
    device: str,
    device_index: int,
) -> str | None:
    """The proof of one package, run in a child process (``artifact_proof``): load it, run
    it on random inputs shaped like ``inputs`` ({"shape", "dtype"}; 2-D ones with 1 and 7
    rows) on ``device``, and compare with ``reference``'s module ("module:Class", built
    from ``init``) within ``PROOF_TOLERANCE``. None when it agrees, else the first
    disagreement."""
    import torch._inductor

    target = torch.device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target)
    runner = torch._inductor.aoti_load_package(path, device_index=device_index).loader.run
    eager = None if reference is None else _eager_module(reference, init)
    generator = torch.Generator().manual_seed(20240917)
    for rows in (1, 7):
        tensors = []
        for spec in inputs:
            shape = [rows, *spec["shape"][1:]] if len(spec["shape"]) == 2 else spec["shape"]
            dtype = getattr(torch, spec["dtype"])
            tensors.append(torch.randn(shape, generator=generator).to(dtype).to(target))
        with torch.inference_mode():
            got = list(runner(tensors))
            want = None if eager is None else eager(*tensors)
            if target.type == "cuda":
                torch.cuda.synchronize(target)
        if want is None:
            continue
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        if len(got) != len(want):
            return f"{len(got)} outputs on {rows} rows, the eager module has {len(want)}"
        for number, (actual, expected) in enumerate(zip(got, want)):
            if actual.shape != expected.shape or actual.dtype != expected.dtype:
                return (
                    f"output {number} on {rows} rows is {actual.dtype} {list(actual.shape)}, "
                    f"eager's {expected.dtype} {list(expected.shape)}"
                )
            tolerance = PROOF_TOLERANCE.get(str(expected.dtype).split(".")[-1], {})
            if not torch.allclose(actual, expected, equal_nan=True, **tolerance):
                error = (actual.float() - expected.float()).abs().nan_to_num(float("inf")).max()
                return f"output {number} on {rows} rows differs from eager by up to {error:.3g}"
    return None


def _eager_module(reference: str, init: Sequence[Any]) -> nn.Module:
    """The module ``reference`` names ("module:Class"), built from ``init``."""
    module_name, _, class_name = reference.partition(":")
    return getattr(importlib.import_module(module_name), class_name)(*init)


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
