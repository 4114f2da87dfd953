"""Builds, caches, loads and self-checks the compiled CPU kernels (``cpu_kernels.cpp``).

``load()`` returns the compiled module, or None when it cannot be had on this machine. The
first call in a process compiles ``cpu_kernels.cpp`` with the machine's C++ compiler
(``-O3 -march=native -fopenmp``: AVX-512 or AVX2 code, whatever this CPU runs) through
``torch.utils.cpp_extension`` (about a minute, once per machine), or imports the library an
earlier process built: libraries live in ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under a name hashed from the source, the flags, torch's and
Python's versions and the CPU model and flags, and are written under a temporary name,
then renamed, so concurrent processes (Spark or Dask workers) never load half a file. A
file lock keeps them from compiling the same library twice at once. The compiler runs in a
child process, because torch's entry point also imports what it built.

Once imported, ``cpu_ops.self_check`` runs each operation on small seeded cases against its
torch reference (``F.linear``, ``torch_attention``'s operations), once per process. A
missing compiler or ninja, a failed build or a failed check warns once (RuntimeWarning
naming the reason) and ``load()`` returns None for the rest of the process: the engine
then runs the torch path (correct, slower). Thread-safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "SOURCE",
    "build_flags",
    "compile_library",
    "cpu_identity",
    "failure",
    "library_path",
    "load",
    "loaded",
    "reset",
]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# Seconds a process waits for another one compiling the same library before it gives up.
BUILD_LOCK_TIMEOUT = 900.0

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the module or None, "failure": the reason


def build_flags() -> list[str]:
    """Compiler flags: optimized for this CPU's vector ISA, OpenMP for the thread split."""
    flags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # ignored where there is no AVX-512
    return flags


def cpu_identity() -> str:
    """What generated CPU code depends on: the architecture, the CPU model and its flags."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.strip()
            if model and flags:
                break
    except OSError:
        pass
    return f"{platform.machine()} {model} {flags or platform.processor()}"


def library_name() -> str:
    parts = (SOURCE.read_text(), " ".join(build_flags()), torch.__version__, sys.version.split()[0])
    identity = "\n".join([*parts, cpu_identity()])
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
            command = (
                "from llm_operator.kernels.cpu_extension import compile_library; "
                f"compile_library({name!r}, {build_dir!r})"
            )
            built = subprocess.run(
                [sys.executable, "-c", command],
                capture_output=True,
                text=True,
                timeout=BUILD_LOCK_TIMEOUT,
            )
            if built.returncode != 0:
                tail = " | ".join((built.stderr or built.stdout).strip().splitlines()[-3:])
                raise RuntimeError(f"building the CPU kernels failed: {tail[-500:]}")
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
            from llm_operator.kernels import cpu_ops

            module = _import(name, path)
            reason = cpu_ops.self_check(module)
            if reason is not None:
                reason = f"they disagree with the torch reference: {reason}"
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
