"""Probes for tests/test_artifact_proof.py, run by ``artifact_proof`` in child processes
(importable there: the child sees the parent's sys.path, tests/ included). No torch import,
so a child costs tens of milliseconds; each takes and ignores the real probes' arguments."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path


def _count(marker: str | None) -> None:
    if marker:
        with Path(marker).open("a") as file:
            file.write("ran\n")


def passes(marker: str | None = None, sleep: float = 0.0, **_: object) -> None:
    """Appends a line to ``marker`` (a count of the runs), sleeps, passes."""
    _count(marker)
    time.sleep(sleep)


def segfaults(marker: str | None = None, **_: object) -> None:
    _count(marker)
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def hangs(**_: object) -> None:
    time.sleep(600)


def disagrees(**_: object) -> str:
    return "output 0 differs from eager by up to 0.5"


def raises(**_: object) -> None:
    raise ValueError("bad probe input\nsecond line")


def no_compiler(**_: object) -> None:
    """A build that fails as one without a C++ compiler does (raises)."""
    raise RuntimeError("no C++ compiler found")


def builds(
    staged: str,
    marker: str | None = None,
    sleep: float = 0.0,
    reason: str | None = None,
    write: bool = True,
    **_: object,
) -> str | None:
    """A build: counts, sleeps, writes ``staged`` (unless not ``write``), returns ``reason``."""
    _count(marker)
    time.sleep(sleep)
    if write:
        Path(staged).write_text("built")
    return reason


def records_pid(marker: str, **_: object) -> None:
    """Appends this process's id to ``marker``."""
    with Path(marker).open("a") as file:
        file.write(f"{os.getpid()}\n")
