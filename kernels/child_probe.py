"""Runs a probe in a child Python process and says how it ended (``artifact_proof``'s runner).

A probe is a module-level function named ``"module:function"``, called with JSON-able
keyword arguments; it returns None (passed) or a one-line reason (failed), or raises. The
child (``sys.executable``) runs with ``faulthandler`` on, so a crash prints its Python
frames to its stderr, and reports the probe's outcome on one marker line of its stdout.
The ``Verdict`` names what ended it otherwise: the signal (``killed by SIGSEGV``), the exit
code, or the timeout (then the child's process group gets SIGABRT, which makes
faulthandler print where it hung, and SIGKILL 5 s later), with its last stderr lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Verdict", "run_child"]

_MARKER = "@@llm_operator_proof@@"
_TAIL_LINES = 8
_MAX_REASON = 1200

# The child: faulthandler on (a crash prints its frames), a watchdog a little after the
# parent's timeout (so an orphaned child exits), the probe, then one marker line.
_CHILD = f"""
import faulthandler, importlib, json, sys
faulthandler.enable(all_threads=True)
faulthandler.dump_traceback_later(float(sys.argv[3]) + 5.0, exit=True)
module_name, _, function_name = sys.argv[1].partition(":")
try:
    reason = getattr(importlib.import_module(module_name), function_name)(**json.loads(sys.argv[2]))
    reason = None if reason is None else str(reason)
except BaseException as error:
    import traceback
    traceback.print_exc()
    lines = str(error).strip().splitlines()
    reason = type(error).__name__ + ": " + (lines[0][:300] if lines else "")
print("\\n{_MARKER}" + json.dumps({{"reason": reason}}), flush=True)
"""


class Verdict(NamedTuple):
    """A proof's outcome: ``passed``; ``reason`` (None when passed, else one line: what
    killed the child or what failed, then its last stderr lines); ``source``: "child"
    (proved by this call), "disk", "memory" (cached) or "trusted" (``LLM_OPERATOR_PROVE=off``);
    ``path``: the verdict's file (None when not stored); ``seconds``: the child's run time."""

    passed: bool
    reason: str | None
    source: str
    path: Path | None = None
    seconds: float = 0.0


def run_child(
    probe: str,
    arguments: Mapping[str, Any],
    *,
    timeout: float,
    environment: Mapping[str, str] | None = None,
) -> Verdict:
    """Run ``probe(**arguments)`` in a child process now; its ``Verdict`` (source "child").
    The child sees this process's ``sys.path`` and environment updated with ``environment``;
    it is stopped (with its process group) after ``timeout`` s."""
    environment = {**os.environ, **(environment or {})}
    paths = [entry or os.getcwd() for entry in sys.path]
    if environment.get("PYTHONPATH"):
        paths.append(environment["PYTHONPATH"])
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    command = [sys.executable, "-c", _CHILD, probe, json.dumps(dict(arguments)), str(timeout)]
    started = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment,
        start_new_session=True,  # its own process group: a timeout kills all of it
        text=True,
        errors="replace",
    )
    timed_out = False
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        # The whole group (it is not reaped yet): faulthandler prints where the child hung
        # and it dies, and so does whatever it started (a compiler).
        _kill(child, signal.SIGABRT)
        try:
            stdout, stderr = child.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            _kill(child, signal.SIGKILL)
            stdout, stderr = child.communicate()
    finally:
        if child.poll() is None:  # interrupted (KeyboardInterrupt): leave no child behind
            _kill(child, signal.SIGKILL)
            child.wait()
    seconds = time.perf_counter() - started
    returned = _returned(stdout)
    if timed_out:
        summary = f"timed out after {timeout:g} s"
    elif child.returncode < 0:
        summary = f"killed by {_signal_name(-child.returncode)}"
    elif returned == [None] and child.returncode == 0:
        return Verdict(True, None, "child", None, seconds)
    elif returned and returned[0] is not None:
        summary = returned[0]
    else:
        summary = f"exited with code {child.returncode}"
    if returned == [None] and not timed_out:
        summary = f"passed, then {summary}"
    reason = f"{summary} (a child process running {probe})"
    tail = _tail(stderr)
    if tail and (timed_out or child.returncode != 0 or not returned):
        reason += f"; stderr: {tail}"  # it did not report: say where it was
    return Verdict(False, reason[:_MAX_REASON], "child", None, seconds)


def _kill(child: subprocess.Popen, number: signal.Signals) -> None:
    """Send ``number`` to ``child``'s process group (call it before the child is reaped:
    its pid, the group's id, cannot be reused until then)."""
    try:
        os.killpg(child.pid, number)
    except (ProcessLookupError, PermissionError):
        child.send_signal(number)


def _returned(stdout: str) -> list[str | None]:
    """[the probe's reason] from the child's marker line; [] when it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARKER):
            try:
                return [json.loads(line[len(_MARKER) :])["reason"]]
            except (ValueError, KeyError, TypeError):
                return []
    return []


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(stderr: str) -> str:
    """The frames under faulthandler's "Fatal Python error" (where it crashed), else the
    last lines, joined by " | "."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip(" ^~\n")]
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return " | ".join(lines[index : index + _TAIL_LINES])
    return " | ".join(lines[-_TAIL_LINES:])
