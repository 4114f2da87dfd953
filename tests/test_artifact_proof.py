"""Proving native artifacts in a child process (llm_operator.kernels.artifact_proof):
verdicts, their causes (a segfault, a hang, an exception, a returned reason), their cache in
memory and on disk, its key, concurrent writers. The engine's side:
test_artifact_proof_engine.py.

The probes (tests/proof_probes.py) import no torch, so most children cost milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_operator.kernels import artifact_proof

TESTS_DIR = Path(__file__).resolve().parent
# A fresh process proving what this one proves (same probe, arguments and directory).
FRESH_PROCESS = """
import json, sys
from llm_operator.kernels import artifact_proof
verdict = artifact_proof.prove(
    "counted", "proof_probes:passes", json.loads(sys.argv[1]), directory=sys.argv[2]
)
print(json.dumps([verdict.passed, verdict.source]))
"""


@pytest.fixture
def proofs(monkeypatch) -> pytest.MonkeyPatch:
    """Proofs on (``LLM_OPERATOR_PROVE`` unset) with an empty in-process verdict cache."""
    monkeypatch.delenv(artifact_proof.PROVE_ENV, raising=False)
    monkeypatch.setattr(artifact_proof, "_verdicts", {})
    return monkeypatch


def runs(marker: Path) -> int:
    """How many times a counting probe ran (lines it appended to ``marker``)."""
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def fresh_process(*args: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    environment.pop(artifact_proof.PROVE_ENV, None)
    return subprocess.Popen(
        [sys.executable, "-c", FRESH_PROCESS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )


# ---------------------------------------------------------------- verdicts


def test_a_passing_probe_passes_once_then_comes_from_memory(proofs, tmp_path):
    marker = tmp_path / "runs"
    arguments = {"marker": str(marker)}
    verdict = artifact_proof.prove("counted", "proof_probes:passes", arguments, directory=tmp_path)
    assert verdict.passed and verdict.reason is None and verdict.source == "child"
    stored = json.loads(verdict.path.read_text())
    assert stored["passed"] is True and stored["key"]["arguments"] == arguments
    again = artifact_proof.prove("counted", "proof_probes:passes", arguments, directory=tmp_path)
    assert again.passed and again.source == "memory"
    assert runs(marker) == 1


def test_a_segfault_is_a_failed_verdict_naming_the_signal_and_the_frame(proofs, tmp_path):
    marker = tmp_path / "runs"
    verdict = artifact_proof.prove(
        "crash", "proof_probes:segfaults", {"marker": str(marker)}, directory=tmp_path
    )
    assert runs(marker) == 1, "the probe ran in a child"
    assert not verdict.passed
    assert verdict.reason.startswith("killed by SIGSEGV")
    assert "Fatal Python error" in verdict.reason and "in segfaults" in verdict.reason
    assert json.loads(verdict.path.read_text())["passed"] is False  # cached: not retried
    assert artifact_proof.prove(
        "crash", "proof_probes:segfaults", {"marker": str(marker)}, directory=tmp_path
    ).reason == (verdict.reason)
    assert runs(marker) == 1


def test_a_hang_hits_the_timeout_and_shows_where_it_hung(proofs, tmp_path):
    started = time.perf_counter()
    verdict = artifact_proof.prove(
        "hang", "proof_probes:hangs", {}, directory=tmp_path, timeout=1.5
    )
    assert time.perf_counter() - started < 15
    assert not verdict.passed and verdict.reason.startswith("timed out after 1.5 s")
    assert "in hangs" in verdict.reason  # faulthandler's dump on SIGABRT


@pytest.mark.parametrize(
    ("probe", "reason"),
    [
        ("proof_probes:raises", "ValueError: bad probe input ("),
        ("proof_probes:disagrees", "output 0 differs from eager by up to 0.5 ("),
        ("proof_probes:missing", "AttributeError: module 'proof_probes' has no attribute"),
    ],
)
def test_a_probe_that_raises_or_returns_a_reason_fails(proofs, tmp_path, probe, reason):
    verdict = artifact_proof.prove("failing", probe, {}, directory=tmp_path)
    assert not verdict.passed and verdict.reason.startswith(reason), verdict.reason


def test_a_fresh_process_reads_the_verdict_from_disk(proofs, tmp_path):
    marker = tmp_path / "runs"
    arguments = {"marker": str(marker)}
    assert artifact_proof.prove("counted", "proof_probes:passes", arguments, directory=tmp_path)[0]
    process = fresh_process(json.dumps(arguments), str(tmp_path))
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-2000:]
    assert json.loads(stdout.splitlines()[-1]) == [True, "disk"]
    assert runs(marker) == 1


def test_concurrent_processes_run_one_child_and_leave_one_valid_verdict(proofs, tmp_path):
    marker = tmp_path / "runs"
    arguments = json.dumps({"marker": str(marker), "sleep": 1.0})
    processes = [fresh_process(arguments, str(tmp_path)) for _ in range(3)]
    outcomes = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr[-2000:]
        outcomes.append(json.loads(stdout.splitlines()[-1]))
    assert sorted(source for _, source in outcomes) == ["child", "disk", "disk"]
    assert all(passed for passed, _ in outcomes) and runs(marker) == 1
    (verdict_file,) = tmp_path.glob("*.proof.json")
    assert json.loads(verdict_file.read_text())["passed"] is True
    assert not list(tmp_path.glob("*.tmp")), "no temporary file is left behind"


def test_a_verdict_for_another_machine_or_artifact_is_not_used(proofs, tmp_path):
    marker, artifact = tmp_path / "runs", tmp_path / "kernels.so"
    artifact.write_bytes(b"one build")
    arguments = {"marker": str(marker)}

    def prove():
        proofs.setattr(artifact_proof, "_verdicts", {})  # as a fresh process would
        return artifact_proof.prove("lib", "proof_probes:passes", arguments, artifact=artifact)

    first = prove()
    assert first.source == "child" and first.path.parent == tmp_path
    assert prove().source == "disk" and runs(marker) == 1

    stored = json.loads(first.path.read_text())  # the same file, keyed for another machine
    stored["key"]["machine"] = "x86_64 Another CPU avx2"
    first.path.write_text(json.dumps(stored))
    assert prove().source == "child" and runs(marker) == 2

    real_identity = artifact_proof.machine_identity
    proofs.setattr(artifact_proof, "machine_identity", lambda device="cpu": "another machine")
    elsewhere = prove()
    assert elsewhere.source == "child" and elsewhere.path != first.path and runs(marker) == 3
    proofs.setattr(artifact_proof, "machine_identity", real_identity)
    assert prove().source == "disk" and runs(marker) == 3  # this machine's verdict stays

    artifact.write_bytes(b"another build")  # a rebuilt artifact is proved again
    assert prove().source == "child" and runs(marker) == 4


def test_off_trusts_without_a_child_and_bad_arguments_raise(proofs, tmp_path):
    marker = tmp_path / "runs"
    proofs.setenv(artifact_proof.PROVE_ENV, "off")
    verdict = artifact_proof.prove(
        "counted", "proof_probes:segfaults", {"marker": str(marker)}, directory=tmp_path
    )
    assert verdict.passed and verdict.source == "trusted" and runs(marker) == 0
    proofs.setenv(artifact_proof.PROVE_ENV, "sometimes")
    with pytest.raises(ValueError, match=artifact_proof.PROVE_ENV):
        artifact_proof.prove("x", "proof_probes:passes", {}, directory=tmp_path)
    proofs.setenv(artifact_proof.PROVE_ENV, "auto")
    with pytest.raises(ValueError, match="probe"):
        artifact_proof.prove("x", "proof_probes.passes", {}, directory=tmp_path)
    with pytest.raises(TypeError, match="arguments"):
        artifact_proof.prove("x", "proof_probes:passes", {"a": object()}, directory=tmp_path)
    with pytest.raises(ValueError, match="directory"):
        artifact_proof.prove("x", "proof_probes:passes", {})
    with pytest.raises(ValueError, match="device"):
        artifact_proof.machine_identity("tpu")
