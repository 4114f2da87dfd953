"""Runs a probe in a child Python process and says how it ended (``artifact_proof``'s runner).

A probe is a module-level function named ``"module:function"``, called with JSON-able
keyword arguments; it returns None (passed) or a one-line reason (failed), or raises. The
child (``sys.executable``) runs with ``faulthandler`` on, so a crash prints its Python
frames to its stderr, and reports the probe's outcome on one marker line of its stdout.
The ``Verdict`` names what ended it otherwise: the signal (``killed by SIGSEGV``), the exit
code, or the timeout (then the child's process group gets SIGABRT, which makes
faulthandler print where it hung, and SIGKILL 5 s later), with its last stderr lines.

``run_child`` starts one child per probe. A ``ProbeWorker`` keeps one child for probe after
probe (one request a line on its stdin), so a run of proofs pays Python's and torch's
imports once: a probe that kills it fails as in ``run_child``, and the next one starts a
fresh child. It exits when its parent closes its stdin (or exits) and after
``IDLE_SECONDS`` without a request. For probes that leave nothing behind that could change
a later probe's outcome.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["IDLE_SECONDS", "ProbeWorker", "Verdict", "run_child"]

_MARKER = "@@llm_operator_proof@@"
_TAIL_LINES = 8
_MAX_REASON = 1200
IDLE_SECONDS = 120.0  # a ProbeWorker's child exits after this long without a request
_IDLE_EXIT = 75  # its exit code then (EX_TEMPFAIL): the parent retries in a fresh child

# Runs `probe` on `arguments` (set before), then prints one marker line on stdout.
_RUN = f"""
module_name, _, function_name = probe.partition(":")
try:
    reason = getattr(importlib.import_module(module_name), function_name)(**arguments)
    reason = None if reason is None else str(reason)
except BaseException as error:
    traceback.print_exc()
    lines = str(error).strip().splitlines()
    reason = type(error).__name__ + ": " + (lines[0][:300] if lines else "")
print("\\n{_MARKER}" + json.dumps({{"reason": reason}}), flush=True)
"""
# The child: faulthandler on (a crash prints its frames), a watchdog a little after the
# parent's timeout (so an orphaned child exits), the probe, then one marker line.
_CHILD = f"""
import faulthandler, importlib, json, sys, traceback
faulthandler.enable(all_threads=True)
faulthandler.dump_traceback_later(float(sys.argv[3]) + 5.0, exit=True)
probe, arguments = sys.argv[1], json.loads(sys.argv[2])
{_RUN}"""
# The worker: the same for each request line ({{"probe", "arguments", "timeout"}}) until
# stdin closes, or exit code _IDLE_EXIT after sys.argv[1] seconds without one.
_WORKER = f"""
import faulthandler, importlib, json, select, sys, traceback
faulthandler.enable(all_threads=True)
while True:
    if not select.select([sys.stdin], [], [], float(sys.argv[1]))[0]:
        sys.exit({_IDLE_EXIT})
    line = sys.stdin.readline()
    if not line:
        break
    request = json.loads(line)
    probe, arguments = request["probe"], request["arguments"]
    faulthandler.dump_traceback_later(request["timeout"] + 5.0, exit=True)
{textwrap.indent(_RUN, "    ")}
    faulthandler.cancel_dump_traceback_later()
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


def child_environment(environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this process's, updated with ``environment``, and a
    ``PYTHONPATH`` that gives it this process's ``sys.path``."""
    environment = {**os.environ, **(environment or {})}
    paths = [entry or os.getcwd() for entry in sys.path]
    if environment.get("PYTHONPATH"):
        paths.append(environment["PYTHONPATH"])
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


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
    command = [sys.executable, "-c", _CHILD, probe, json.dumps(dict(arguments)), str(timeout)]
    started = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_environment(environment),
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
    returned = _returned(stdout.splitlines())
    seconds = time.perf_counter() - started
    return _verdict(probe, returned, child.returncode, timed_out, timeout, stderr, seconds)


class ProbeWorker:
    """One child process that runs probes one after another (module docstring).

    Contract: ``run(probe, arguments, timeout=...)`` returns what ``run_child`` would (the
    same ``Verdict``s), but in this worker's child, started on first use (and again after
    one died, timed out or idled out) with the environment ``environment`` (a full one:
    ``child_environment``'s). Calls are serialized. ``close()`` ends the child (also at
    exit). A worker used from a forked process starts its own child.
    """

    def __init__(self, environment: Mapping[str, str], idle_seconds: float = IDLE_SECONDS):
        self.environment = dict(environment)
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._owner = 0  # the pid that started the child
        self._last_used = 0.0
        self._stdout: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._readers: list[threading.Thread] = []

    def run(self, probe: str, arguments: Mapping[str, Any], *, timeout: float) -> Verdict:
        request = json.dumps({"probe": probe, "arguments": dict(arguments), "timeout": timeout})
        with self._lock:
            for attempt in (1, 2):  # a child that idled out as the request came: once more
                child = self._ready()
                started = time.perf_counter()
                self._stderr.clear()
                try:
                    assert child.stdin is not None, "the worker's stdin is a pipe"
                    child.stdin.write(request + "\n")
                    child.stdin.flush()
                except OSError:
                    pass  # it died: the reader says how
                returned, timed_out = self._wait(child, timeout)
                if returned or timed_out:
                    break
                child.wait()
                if child.returncode != _IDLE_EXIT or attempt == 2:
                    break
            self._last_used = time.monotonic()
            if returned and not timed_out:
                return _verdict(
                    probe, returned, 0, False, timeout, "", time.perf_counter() - started
                )
            self._stop(child)
            stderr = "".join(self._stderr)
            seconds = time.perf_counter() - started
            return _verdict(probe, returned, child.returncode, timed_out, timeout, stderr, seconds)

    def close(self) -> None:
        """End the child (closing its stdin; killed if it does not exit within 5 s)."""
        with self._lock:
            if self._child is not None and self._owner == os.getpid():
                self._stop(self._child, gently=True)
            self._child = None
            _live_workers.discard(self)

    # -- the child --------------------------------------------------------------------
    def _ready(self) -> subprocess.Popen:
        """The running child, or a fresh one (none yet, it exited, it is about to idle out,
        or this is a forked process whose parent started it)."""
        child = self._child
        fresh = time.monotonic() - self._last_used < self.idle_seconds / 2
        alive = child is not None and child.returncode is None and child.poll() is None
        if child is not None and self._owner == os.getpid() and fresh and alive:
            return child
        if child is not None and self._owner == os.getpid():
            self._stop(child, gently=True)
        command = [sys.executable, "-c", _WORKER, str(self.idle_seconds)]
        child = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.environment,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self._child, self._owner, self._last_used = child, os.getpid(), time.monotonic()
        # This child's own queue and list: a late line of the last one lands in its own.
        lines: queue.Queue[str | None] = queue.Queue()
        self._stdout, self._stderr = lines, []
        self._readers = [
            threading.Thread(
                target=_pump, args=(child.stdout, lines.put, lambda: lines.put(None)), daemon=True
            ),
            threading.Thread(target=_pump, args=(child.stderr, self._stderr.append), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        _live_workers.add(self)
        return child

    def _wait(self, child: subprocess.Popen, timeout: float) -> tuple[list[str | None], bool]:
        """([the probe's reason], False) once the child reports; ([], False) when it exits
        first; ([], True) after ``timeout`` s (then the child's group gets SIGABRT, and
        SIGKILL 5 s later)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._stdout.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                _kill(child, signal.SIGABRT)
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _kill(child, signal.SIGKILL)
                return [], True
            if line is None:  # stdout closed: the child is gone
                return [], False
            returned = _returned([line])
            if returned:
                return returned, False

    def _stop(self, child: subprocess.Popen, gently: bool = False) -> None:
        """Make sure ``child`` is gone and reaped, its readers done."""
        if gently and child.poll() is None and child.stdin is not None:
            try:
                child.stdin.close()
                child.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if child.poll() is None:
            _kill(child, signal.SIGKILL)
        child.wait()
        for reader in self._readers:
            reader.join(timeout=5)  # the rest of its stderr: where it crashed
        for stream in (child.stdin, child.stdout, child.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if child is self._child:
            self._child = None


_live_workers: set[ProbeWorker] = set()  # closed at exit


@atexit.register
def _close_workers() -> None:
    for worker in list(_live_workers):
        worker.close()


def _forget_workers() -> None:
    """In a forked process: its parent's children and locks are not its own."""
    for worker in _live_workers:
        worker._lock, worker._child = threading.Lock(), None
    _live_workers.clear()


os.register_at_fork(after_in_child=_forget_workers)


def _pump(stream: Any, put: Callable[[str], None], end: Callable[[], None] | None = None) -> None:
    """Each line of ``stream`` to ``put`` (a reader thread), then ``end()``."""
    try:
        for line in stream:
            put(line)
    except (OSError, ValueError):
        pass  # closed under it
    if end is not None:
        end()


def _verdict(
    probe: str,
    returned: list[str | None],
    returncode: int | None,
    timed_out: bool,
    timeout: float,
    stderr: str,
    seconds: float,
) -> Verdict:
    """The ``Verdict`` of a child that reported ``returned`` (see ``_returned``), exited
    with ``returncode`` (negative: a signal) or timed out, leaving ``stderr``."""
    if timed_out:
        summary = f"timed out after {timeout:g} s"
    elif returncode is not None and returncode < 0:
        summary = f"killed by {_signal_name(-returncode)}"
    elif returned == [None] and returncode == 0:
        return Verdict(True, None, "child", None, seconds)
    elif returned and returned[0] is not None:
        summary = returned[0]
    else:
        summary = f"exited with code {returncode}"
    if returned == [None] and not timed_out:
        summary = f"passed, then {summary}"
    reason = f"{summary} (a child process running {probe})"
    tail = _tail(stderr)
    if tail and (timed_out or returncode != 0 or not returned):
        reason += f"; stderr: {tail}"  # it did not report: say where it was
    return Verdict(False, reason[:_MAX_REASON], "child", None, seconds)


def _kill(child: subprocess.Popen, number: signal.Signals) -> None:
    """Send ``number`` to ``child``'s process group (call it before the child is reaped:
    its pid, the group's id, cannot be reused until then)."""
    try:
        os.killpg(child.pid, number)
    except (ProcessLookupError, PermissionError):
        child.send_signal(number)


def _returned(lines: list[str]) -> list[str | None]:
    """[the probe's reason] from the child's marker line; [] when it printed none."""
    for line in reversed(lines):
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
