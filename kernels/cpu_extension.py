"""Builds, caches and self-checks the compiled CPU kernels (``cpu_kernels.cpp``).

``load()`` returns the compiled module, or None when it cannot be had on this machine. The
first call in a process compiles ``cpu_kernels.cpp`` with the machine's C++ compiler
(``-O3 -march=native -fopenmp``: AVX-512 or AVX2 code, whatever this CPU runs) through
``torch.utils.cpp_extension`` (about a minute, once per machine), or imports the library an
earlier process built: libraries live in ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under a name hashed from the source, the flags, torch's and
Python's versions and the CPU model, and are written under a temporary name, then renamed,
so concurrent processes (Spark or Dask workers) never load half a file. A file lock keeps
them from compiling the same library twice at once. The compiler runs in a child process
(torch's entry point imports what it built, and this process imports nothing unproven).

Before this process imports the library, a child process proves it
(``artifact_proof.prove``: it imports the library and runs ``cpu_ops.self_check``, each
operation on small seeded cases against its torch reference: ``F.linear``,
``torch_attention``'s operations), once per library, machine kind, torch and Python (the
verdict is cached beside the library, so later processes import it at once). With
``LLM_OPERATOR_PROVE=off`` the self-check runs in this process instead. A missing compiler
or ninja, a failed build, a crash or a failed check warns once (RuntimeWarning naming the
reason) and ``load()`` returns None for the rest of the process: the engine then runs the
torch path (correct, slower). Thread-safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from llm_operator.kernels import artifact_proof

__all__ = [
    "PROBE",
    "SOURCE",
    "build_flags",
    "compile_library",
    "failure",
    "library_path",
    "load",
    "loaded",
    "prove_library",
    "reset",
]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# Seconds a process waits for another one compiling the same library before it gives up.
BUILD_LOCK_TIMEOUT = 900.0
# The proof's entry point in the child process (tests point it at a crashing probe).
PROBE = "llm_operator.kernels.cpu_extension:prove_library"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the module or None, "failure": the reason


def build_flags() -> list[str]:
    """Compiler flags: optimized for this CPU's vector ISA, OpenMP for the thread split."""
    flags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # ignored where there is no AVX-512
    return flags


_cpu_identity = artifact_proof.cpu_identity  # what the generated code depends on


def library_name() -> str:
    identity = "\n".join(
        [
            SOURCE.read_text(),
            " ".join(build_flags()),
            torch.__version__,
            sys.version.split()[0],
            _cpu_identity(),
        ]
    )
    return "llm_operator_cpu_" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def library_path() -> Path:
    """Where this machine's build of the kernels lives (it may not exist yet)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = library_name()
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_ninja() -> None:
    """Put the ninja of the ``ninja`` package (a dependency) on PATH when it is not there:
    ``torch.utils.cpp_extension`` runs ``ninja`` by name, and a venv's scripts are on PATH
    only when the venv is activated."""
    if shutil.which("ninja"):
        return
    folders = [str(Path(sys.executable).parent)]
    try:
        import ninja

        folders.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*folders, os.environ.get("PATH", "")])


def compile_library(name: str, build_directory: str) -> None:
    """Compile the kernels as ``name`` into ``build_directory``. Run in a child process
    (``_build``): torch's entry point also imports the library it built."""
    from torch.utils.cpp_extension import load as compile_extension

    _find_ninja()
    compile_extension(
        name,
        [str(SOURCE)],
        extra_cflags=build_flags(),
        build_directory=build_directory,
        verbose=False,
    )


def prove_library(name: str, path: str) -> str | None:
    """The proof of a built library, run in a child process (``artifact_proof``): import
    it and self-check it (None, or the first operation that disagreed)."""
    from llm_operator.kernels import cpu_ops

    return cpu_ops.self_check(_import(name, Path(path)))


def _prove(name: str, path: Path) -> artifact_proof.Verdict:
    """``prove_library``'s verdict on ``path`` (cached; "trusted" with the proofs off)."""
    return artifact_proof.prove(
        "compiled CPU kernels",
        PROBE,
        {"name": name, "path": str(path)},
        artifact=path,
        identity=hashlib.sha256(Path(__file__).with_name("cpu_ops.py").read_bytes()).hexdigest(),
    )


def _build(name: str, path: Path) -> None:
    """Compile (in a child process) into a temporary folder beside ``path``, then rename the
    library into place; RuntimeError naming the reason when the build fails."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    _find_ninja()
    with FileLock(str(path) + ".lock", timeout=BUILD_LOCK_TIMEOUT):
        if path.is_file():  # another process built it while this one waited
            return
        print(
            "llm_operator: compiling the CPU kernels for this machine (once, about a minute)",
            file=sys.stderr,
        )
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=path.parent, prefix="build-") as build_dir:
            built = artifact_proof.run_probe(
                "llm_operator.kernels.cpu_extension:compile_library",
                {"name": name, "build_directory": build_dir},
                timeout=BUILD_LOCK_TIMEOUT,
            )
            if not built.passed:
                raise RuntimeError(f"building the CPU kernels failed: {built.reason}")
            library = Path(build_dir) / f"{name}.so"
            temporary = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
            temporary.write_bytes(library.read_bytes())
            os.replace(temporary, path)
        print(
            f"llm_operator: CPU kernels compiled in {time.perf_counter() - started:.0f} s ({path})",
            file=sys.stderr,
        )


def load() -> ModuleType | None:
    """The compiled, self-checked kernels; None where they cannot run (see the docstring)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module: ModuleType | None = None
        try:
            name = library_name()
            path = library_path()
            if not path.is_file():
                _build(name, path)
            verdict = _prove(name, path)
            reason = None
            if not verdict.passed:
                reason = f"they failed their proof in a child process: {verdict.reason}"
            else:
                artifact_proof.announce_load("the compiled CPU kernels", path)
                module = _import(name, path)
                if verdict.source == "trusted":  # LLM_OPERATOR_PROVE=off: check them here
                    from llm_operator.kernels import cpu_ops

                    reason = cpu_ops.self_check(module)
        except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a failed build
            text = str(error).strip().splitlines()
            reason = f"{type(error).__name__}: {text[-1][:300] if text else ''}"
        if reason is not None:
            module = None
            _state["failure"] = reason
            warnings.warn(
                f"llm_operator: the compiled CPU kernels are not used ({reason}); the native "
                "engine runs its torch path on the CPU instead (correct, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
        _state["module"] = module
        return module


def loaded() -> ModuleType | None:
    """The module ``load()`` returned in this process (None before it ran or on failure)."""
    return _state.get("module")  # type: ignore[return-value]


def failure() -> str | None:
    """Why ``load()`` returned None in this process (None if it did not, or was not called)."""
    return _state.get("failure")  # type: ignore[return-value]


def reset() -> None:
    """Forget this process's outcome, so the next ``load()`` tries again (tests)."""
    with _lock:
        _state.clear()
