"""Proves a native artifact in a child process before this process loads it.

A native artifact (an AOTInductor package, the compiled CPU kernels, the Triton kernels)
that crashes takes its process down with it: on Spark a lost executor, a retry, the same
crash. So before the first in-process load, ``prove`` runs a *probe* (a module-level
function, named ``"module:function"``, called with JSON-able keyword arguments) in a child
Python process (``sys.executable``, with a timeout). The probe loads the artifact and runs
it on a small case; it returns None when the artifact works, else a one-line reason (or
raises). The ``Verdict``: passed, or failed with a reason: the signal that killed the
child (``killed by SIGSEGV``), its exit code, the timeout, the exception the probe raised
or the reason it returned, with the child's last stderr lines (the child runs with
``faulthandler`` on, so a crash shows its Python frames there).

Verdicts are cached in the process and on disk, as JSON: next to the artifact when there
is one (``<artifact>.<digest>.proof.json``, so in ``TORCHINDUCTOR_CACHE_DIR`` for packages
and ``TORCH_EXTENSIONS_DIR`` for the CPU kernels), else in the caller's ``directory``
(``default_directory()``: ``$LLM_OPERATOR_CACHE/proofs``, default
``~/.cache/llm-operator/proofs``, for the Triton self-check).
The key: the probe and its arguments, the artifact's path and sha256, the caller's
``identity`` (source digests, versions), the machine kind (CPU model and flags; for a
CUDA device also the GPU's name, compute capability and driver), torch's and Python's
versions. A verdict written under another key (another machine kind, a rebuilt artifact,
a new torch) is never used. Files are written to a temporary name and renamed, under a
file lock per verdict, so concurrent workers of one node run one child and read one
verdict. Failed verdicts are cached too (delete the file to prove it again).

``prove_build`` proves an artifact that does not exist yet in the child that builds it:
the child writes it to a temporary name and checks it; on a pass this process writes the
verdict ``prove`` will find for those bytes and renames the file into place (so it loads a
proven artifact at once, and never builds one itself); a failed build is cached as a
verdict too. ``shared=True`` runs the child in this process's ``ProbeWorker`` (one child
for proof after proof, which pays Python's and torch's imports once: for artifacts whose
proofs leave nothing behind that could change a later one's outcome).

``LLM_OPERATOR_PROVE``: ``auto`` (default; also ``on``, ``1``) proves as above; ``off``
(or ``0``) trusts every artifact unproven, for experts who know their machines.

``enable_fault_handler`` turns on ``faulthandler`` (stderr, all threads) so a crash in
native code prints a Python traceback to the task's log; ``announce_load`` prints one
line (``llm_operator: loading <what> <path>``) before a first in-process load, so the log
names the suspect. Thread-safe.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llm_operator.kernels.child_probe import ProbeWorker, Verdict, child_environment, run_child

__all__ = [
    "PROVE_ENV",
    "Verdict",
    "announce_load",
    "cpu_identity",
    "default_directory",
    "enable_fault_handler",
    "machine_identity",
    "prove",
    "prove_build",
    "prove_mode",
    "reset",
    "run_probe",
]

PROVE_ENV = "LLM_OPERATOR_PROVE"
_MODES = {"": "auto", "auto": "auto", "on": "auto", "1": "auto", "off": "off", "0": "off"}
DEFAULT_TIMEOUT = 300.0  # seconds: importing torch, a CUDA context, a first Triton compile

_lock = threading.Lock()
_worker_lock = threading.Lock()
_verdicts: dict[str, Verdict] = {}  # by key digest, this process's proofs and reads
_hashes: dict[tuple, str] = {}  # artifact sha256 by (path, size, mtime)
_VOLATILE_ENVIRONMENT = ("PYTEST_CURRENT_TEST",)
_worker: list[ProbeWorker] = []  # the shared proving child (run_probe(shared=True)), if any


def prove_mode() -> str:
    """``LLM_OPERATOR_PROVE`` as "auto" or "off"; ValueError naming it for another value."""
    value = os.environ.get(PROVE_ENV, "").strip().lower()
    if value not in _MODES:
        raise ValueError(f"{PROVE_ENV} must be one of auto, on, 1, off, 0; got {value!r}")
    return _MODES[value]


def default_directory() -> Path:
    """Where verdicts without an artifact go: ``$LLM_OPERATOR_CACHE/proofs`` when that is
    set and non-empty, else ``~/.cache/llm-operator/proofs`` (the converted models' cache)."""
    root = os.environ.get("LLM_OPERATOR_CACHE", "").strip()
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "llm-operator") / "proofs"


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


def machine_identity(device: str = "cpu") -> str:
    """The machine kind a verdict holds for: ``cpu_identity()``, and for a CUDA ``device``
    ("cuda", "cuda:N") the GPU's name, compute capability and the driver's version."""
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    identity = cpu_identity()
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        identity += f" | {torch.cuda.get_device_name(index)} sm_{major}{minor} {_driver()}"
    return identity


def _driver() -> str:
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        import torch

        get_version = getattr(torch._C, "_cuda_getDriverVersion", None)
        return f"driver {get_version() if get_version else '?'} cuda {torch.version.cuda}"


def prove(
    name: str,
    probe: str,
    arguments: Mapping[str, Any],
    *,
    artifact: Path | str | None = None,
    directory: Path | str | None = None,
    identity: str = "",
    device: str = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    shared: bool = False,
) -> Verdict:
    """The verdict on ``probe(**arguments)`` run in a child process, cached (see the module
    docstring). ``name``: what is proved, for the verdict's file name; ``artifact``: the
    file under proof (its path and bytes enter the key; the verdict is stored beside it);
    ``directory``: where the verdict is stored without an artifact; ``identity``: anything
    else the outcome depends on; ``device``: whose machine kind enters the key;
    ``shared``: run the child in the shared ``ProbeWorker``.
    ValueError/TypeError for bad arguments, FileNotFoundError for a missing artifact;
    never raises for what the child does."""
    _check_probe(probe, timeout)
    if artifact is None and directory is None:
        raise ValueError("prove needs an artifact or a directory to store its verdict in")
    arguments_json = _json(arguments, "arguments")
    if prove_mode() == "off":
        return Verdict(True, None, "trusted")
    with _lock:
        key = _key(name, probe, arguments_json, artifact, identity, device)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        if digest in _verdicts:
            return _verdicts[digest]._replace(source="memory")
        if artifact is not None:
            path = Path(artifact).with_name(f"{Path(artifact).name}.{digest}.proof.json")
        else:
            path = Path(directory) / f"{_file_stem(name)}.{digest}.proof.json"  # type: ignore[arg-type]
        verdict = _locked_prove(path, key, probe, arguments_json, timeout, shared)
        _verdicts[digest] = verdict
        return verdict


def prove_build(
    name: str,
    probe: str,
    arguments: Mapping[str, Any],
    *,
    artifact: Path | str,
    build: str,
    build_arguments: Mapping[str, Any],
    identity: str = "",
    device: str = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    shared: bool = False,
) -> Verdict:
    """``prove(name, probe, arguments, artifact=artifact, ...)``'s verdict, building
    ``artifact`` first, in the same child, when it does not exist.

    ``build`` ("module:function") runs in the child as ``build(**build_arguments,
    staged=<path>)``: it writes the artifact to ``staged`` (a temporary name beside
    ``artifact``) and checks it as ``probe`` would check ``artifact`` (None or a reason).
    When it passes, this process hashes the staged bytes, writes the verdict ``prove`` finds
    for ``artifact`` holding them, then renames the file to ``artifact``, to be loaded at
    once. When it fails, the staged file is removed and the failure cached beside
    ``artifact`` (``<artifact>.<digest>.proof.json``, keyed like a proof of ``build`` with
    the artifact absent; delete it to build again), so later processes fall back at once.
    Under a file lock per build: concurrent processes build once, the others then find the
    artifact and its verdict. With ``LLM_OPERATOR_PROVE=off`` the child builds all the
    same, and the verdict is "trusted" and not stored. Errors as ``prove``."""
    _check_probe(probe, timeout)
    _check_probe(build, timeout)
    arguments_json = _json(arguments, "arguments")
    build_json = _json(build_arguments, "build_arguments")
    artifact = Path(artifact)
    with _lock:
        verdict = _build_unless_present(
            name, probe, arguments_json, artifact, build, build_json, identity, device, timeout,
            shared,
        )  # fmt: skip
    if verdict is not None:
        return verdict
    return prove(
        name, probe, arguments, artifact=artifact, identity=identity, device=device,
        timeout=timeout, shared=shared,
    )  # fmt: skip


def _build_unless_present(
    name: str,
    probe: str,
    arguments_json: str,
    artifact: Path,
    build: str,
    build_json: str,
    identity: str,
    device: str,
    timeout: float,
    shared: bool,
) -> Verdict | None:
    """``prove_build``'s verdict when it built ``artifact`` (or a cached failure to), None
    when the artifact exists (``prove`` it then); under ``_lock``."""
    from filelock import FileLock, Timeout

    if artifact.is_file():
        return None
    if prove_mode() == "off":
        verdict, staged = _run_build(artifact, build, build_json, timeout, shared)
        if verdict.passed:
            os.replace(staged, artifact)
        staged.unlink(missing_ok=True)
        return verdict._replace(source="trusted") if verdict.passed else verdict
    key = _key(name, build, build_json, None, identity, device)
    key["artifact"] = str(artifact.resolve())  # absent: no bytes to key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    if digest in _verdicts:
        return _verdicts[digest]._replace(source="memory")  # a failed build
    path = artifact.with_name(f"{artifact.name}.{digest}.proof.json")
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path.with_suffix(".lock")), timeout=2 * timeout + 60)
        lock.acquire()
    except (OSError, Timeout):
        lock = None  # an unusable folder: build without the lock (and without caching)
    try:
        if artifact.is_file():
            return None  # another process built it while this one waited
        failed = _read(path, key)
        if failed is None:
            verdict, staged = _run_build(artifact, build, build_json, timeout, shared)
            try:
                if verdict.passed:
                    proof = _key(name, probe, arguments_json, artifact, identity, device, staged)
                    proof_digest = hashlib.sha256(
                        json.dumps(proof, sort_keys=True).encode()
                    ).hexdigest()[:20]
                    proof_path = artifact.with_name(f"{artifact.name}.{proof_digest}.proof.json")
                    verdict = _write(proof_path, proof, verdict)
                    os.replace(staged, artifact)
                    _verdicts[proof_digest] = verdict
                    return verdict
                failed = _write(path, key, verdict)
            finally:
                staged.unlink(missing_ok=True)
        _verdicts[digest] = failed
        return failed
    finally:
        if lock is not None:
            lock.release()


def _run_build(
    artifact: Path, build: str, build_json: str, timeout: float, shared: bool
) -> tuple[Verdict, Path]:
    """``build`` run in a child onto a temporary name beside ``artifact``: (its verdict,
    failed when it passed without writing the file; that name)."""
    staged = artifact.with_name(
        f"{artifact.stem}.{os.getpid()}-{threading.get_ident()}.staged{artifact.suffix}"
    )
    arguments = {**json.loads(build_json), "staged": str(staged)}
    verdict = run_probe(build, arguments, timeout=timeout, shared=shared)
    if verdict.passed and not staged.is_file():
        reason = f"it passed without writing {staged.name} (a child process running {build})"
        verdict = Verdict(False, reason, "child", None, verdict.seconds)
    return verdict, staged


def _check_probe(probe: str, timeout: float) -> None:
    if not isinstance(probe, str) or ":" not in probe:
        raise ValueError(f"probe must be 'module:function', got {probe!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")


def _json(arguments: Mapping[str, Any], what: str) -> str:
    try:
        return json.dumps(dict(arguments), sort_keys=True)
    except TypeError as error:
        raise TypeError(f"{what} must be JSON-able: {error}") from error


def _key(
    name: str,
    probe: str,
    arguments_json: str,
    artifact: Path | str | None,
    identity: str,
    device: str,
    content: Path | None = None,
) -> dict[str, Any]:
    """What a verdict holds for (stored in its file, compared on reading); ``content``: the
    file whose bytes ``artifact`` holds (default: itself)."""
    import torch

    return {
        "name": name,
        "probe": probe,
        "arguments": json.loads(arguments_json),
        "artifact": None if artifact is None else str(Path(artifact).resolve()),
        "artifact_sha256": None if artifact is None else _sha256(Path(content or artifact)),
        "identity": identity,
        "machine": machine_identity(device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def _locked_prove(
    path: Path, key: dict, probe: str, arguments_json: str, timeout: float, shared: bool
) -> Verdict:
    """The verdict in ``path`` when it holds ``key``'s, else a fresh one written there, all
    under ``path``'s file lock (without the lock or the file when the folder is unusable)."""
    from filelock import FileLock, Timeout

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path.with_suffix(".lock")), timeout=2 * timeout + 60)
        lock.acquire()
    except (OSError, Timeout):
        return _run_and_write(path, key, probe, arguments_json, timeout, shared)
    try:
        return _read(path, key) or _run_and_write(path, key, probe, arguments_json, timeout, shared)
    finally:
        lock.release()


def _read(path: Path, key: dict) -> Verdict | None:
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            return None  # another machine kind, artifact or version (or a hash collision)
        return Verdict(bool(stored["passed"]), stored["reason"], "disk", path, stored["seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: prove again


def _run_and_write(
    path: Path, key: dict, probe: str, arguments_json: str, timeout: float, shared: bool
) -> Verdict:
    verdict = run_probe(probe, json.loads(arguments_json), timeout=timeout, shared=shared)
    return _write(path, key, verdict)


def _write(path: Path, key: dict, verdict: Verdict) -> Verdict:
    """``verdict`` written to ``path`` under ``key`` (a temporary file, renamed), with its
    path; without it when the folder is unwritable."""
    record = {"key": key, "passed": verdict.passed, "reason": verdict.reason}
    record.update(seconds=verdict.seconds, written=time.time(), pid=os.getpid())
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        temporary.write_text(json.dumps(record, indent=1))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        return verdict  # an unwritable folder: proved again by the next process
    return verdict._replace(path=path)


def run_probe(
    probe: str, arguments: Mapping[str, Any], *, timeout: float, shared: bool = False
) -> Verdict:
    """Run ``probe(**arguments)`` in a child process now, uncached (``child_probe``), with
    ``LLM_OPERATOR_PROVE=off`` there; its ``Verdict`` (source "child"). ``shared``: in this
    process's ``ProbeWorker`` (started again when this process's environment or
    ``sys.path`` changed since it started)."""
    environment = {PROVE_ENV: "off"}
    if not shared:
        return run_child(probe, arguments, timeout=timeout, environment=environment)
    environment = child_environment(environment)
    with _worker_lock:
        if _worker and _settings(_worker[0].environment) != _settings(environment):
            _worker.pop().close()
        if not _worker:
            _worker.append(ProbeWorker(environment))
        worker = _worker[0]
    return worker.run(probe, arguments, timeout=timeout)


def _settings(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` less what changes without changing a probe's outcome (pytest's
    ``PYTEST_CURRENT_TEST``, set per test)."""
    return {k: v for k, v in environment.items() if k not in _VOLATILE_ENVIRONMENT}


def _file_stem(name: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    return stem[:80] or "proof"


def _sha256(path: Path) -> str:
    """``path``'s sha256, hashed once a process per (path, size, mtime); under ``_lock``."""
    stat = path.stat()
    cache_key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if cache_key not in _hashes:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        _hashes[cache_key] = digest.hexdigest()
    return _hashes[cache_key]


def enable_fault_handler() -> bool:
    """Turn on ``faulthandler`` (all threads) on stderr unless it is on already, so a
    crash in native code prints the Python frames to the task's log. True when this call
    turned it on; False when it was on, or no stream with a file descriptor exists."""
    if faulthandler.is_enabled():
        return False
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:
            continue
        try:
            stream.fileno()
            faulthandler.enable(file=stream, all_threads=True)
            return True
        except (AttributeError, OSError, ValueError):
            continue  # a replaced stderr without a descriptor (a notebook): try the real one
    return False


def announce_load(what: str, where: object) -> None:
    """One stderr line before a first in-process load, so a crash's log names the suspect:
    ``llm_operator: loading <what> <where>`` (a path, a device)."""
    print(f"llm_operator: loading {what} {where}", file=sys.stderr, flush=True)


def reset() -> None:
    """Forget this process's verdicts (tests); files on disk stay."""
    with _lock:
        _verdicts.clear()
