"""The CPU GEMM choices of a machine kind, stored so that every process of that kind
uses the same kernel for the same shape (issue 30).

``GemmChoice`` (``gemm.py``) times aten's, oneDNN's and the packed linear per shape and
keeps the fastest. The candidates round differently, so two processes that time a shape
differently (a busy neighbour, a cold cache) gave different greedy bf16 tokens for the
same row: a Spark retry, a resumed checkpoint or a second executor could change a column.
Here the first choice made on a machine kind is written down and every later process of
that kind reads it instead of timing again:

    <cache>/gemm/<digest>.json    {"machine": {...}, "choices": {"float32|1|576|576|0|1": "packed", ...}}

``<cache>`` is ``$LLM_OPERATOR_CACHE`` (default ``~/.cache/llm-operator``); the digest and
the ``machine`` record are the machine kind: the CPU model and flags, torch's version, the
threads, whether oneDNN runs and the compiled CPU kernels' library (their code is a
candidate). A file of another kind is never read (another digest; the record is compared
too). A choice is recorded under a file lock: a process that measured a shape another one
recorded meanwhile takes the recorded one, so the workers of a node agree. Writes are a
temporary file renamed into place. ``LLM_OPERATOR_GEMM_STORE=off`` keeps the choices in
the process only (the old behaviour).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

STORE_ENV = "LLM_OPERATOR_GEMM_STORE"
LOCK_TIMEOUT = 120.0  # seconds a process waits for another one writing the file


def store_enabled() -> bool:
    """``LLM_OPERATOR_GEMM_STORE``: on (default) or off; ValueError for another value."""
    value = os.environ.get(STORE_ENV, "").strip().lower() or "on"
    if value not in ("on", "off", "1", "0"):
        raise ValueError(f"{STORE_ENV} must be on or off, got {value!r}")
    return value in ("on", "1")


def machine_record(onednn: bool) -> dict[str, Any]:
    """What a GEMM choice depends on besides the shape."""
    import torch

    from llm_operator.kernels import artifact_proof, cpu_extension

    library = cpu_extension.library_name() if cpu_extension.loaded() is not None else ""
    return {
        "cpu": artifact_proof.cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "onednn": onednn,
        "packed_kernel": library,
    }


def key_text(key: tuple) -> str:
    """A shape key (dtype, rows' bit length, out, in, bias, packed) as the file spells it."""
    dtype, *rest = key
    return "|".join([str(dtype).removeprefix("torch."), *(str(int(v)) for v in rest)])


class GemmStore:
    """The stored choices of one machine kind (``machine``) in ``directory``.

    Contract: ``get(key)`` is the recorded choice or None; ``record(key, name)`` returns the
    choice that holds for ``key`` from now on on this machine kind: the one already in the
    file if another process recorded it first, else ``name``, now written. Thread-safe."""

    def __init__(self, directory: Path, machine: dict[str, Any]) -> None:
        self.machine = machine
        digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()
        self.path = directory / f"{digest[:24]}.json"
        self._choices: dict[str, str] | None = None
        self._lock = threading.Lock()

    def get(self, key: tuple) -> str | None:
        with self._lock:
            if self._choices is None:
                self._choices = self._read()
            return self._choices.get(key_text(key))

    def record(self, key: tuple, name: str) -> str:
        from filelock import FileLock

        text = key_text(key)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT):
                choices = self._read()
                if text not in choices:
                    choices[text] = name
                    self._write(choices)
                self._choices = choices
                return choices[text]

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("machine") != self.machine:
            return {}  # another machine kind under the same name, or a damaged file
        choices = data.get("choices")
        return dict(choices) if isinstance(choices, dict) else {}

    def _write(self, choices: dict[str, str]) -> None:
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"machine": self.machine, "choices": choices}, indent=1))
        os.replace(temporary, self.path)


def default_store(onednn: bool) -> GemmStore | None:
    """This machine kind's store in ``$LLM_OPERATOR_CACHE/gemm``; None when turned off."""
    if not store_enabled():
        return None
    from llm_operator.models.registry import default_cache_dir

    return GemmStore(default_cache_dir() / "gemm", machine_record(onednn))
