"""Proving native artifacts in a child process (llm_operator.kernels.artifact_proof):
verdicts, their causes (a segfault, a hang, an exception, a returned reason), their cache in
memory and on disk, its key, concurrent writers; artifacts built and proved in one child
(prove_build); one child for many probes (child_probe.ProbeWorker). The engine's side:
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

from llm_operator.kernels import artifact_proof, child_probe

TESTS_DIR = Path(__file__).resolve().parent
# A fresh process proving what this one proves (same probe, arguments and directory).
FRESH_PROCESS = """
import json, sys
from llm_operator.kernels import artifact_proof, child_probe
verdict = artifact_proof.prove(
    "counted", "proof_probes:passes", json.loads(sys.argv[1]), directory=sys.argv[2]
)
print(json.dumps([verdict.passed, verdict.source]))
"""
# A fresh process building and proving what this one does (prove_build, artifact argv[2]).
FRESH_BUILD = """
import json, sys
from llm_operator.kernels import artifact_proof
build_arguments, artifact = json.loads(sys.argv[1]), sys.argv[2]
verdict = artifact_proof.prove_build(
    "lib", "proof_probes:passes", {}, artifact=artifact, build="proof_probes:builds",
    build_arguments=build_arguments,
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


def outcomes_of(processes: list[subprocess.Popen]) -> list:
    """Each process's last stdout line as JSON, once all have exited cleanly."""
    outcomes = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr[-2000:]
        outcomes.append(json.loads(stdout.splitlines()[-1]))
    return outcomes


def fresh_process(*args: str, script: str = FRESH_PROCESS) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    environment.pop(artifact_proof.PROVE_ENV, None)
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
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
    outcomes = outcomes_of(processes)
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


# ---------------------------------------------------------------- built in the proving child


def prove_build(artifact: Path, build_arguments: dict, load_marker: Path | None = None):
    """prove_build of ``artifact`` by proof_probes:builds; the load probe counts its runs
    in ``load_marker``."""
    arguments = {"marker": str(load_marker)} if load_marker else {}
    return artifact_proof.prove_build(
        "lib", "proof_probes:passes", arguments, artifact=artifact,
        build="proof_probes:builds", build_arguments=build_arguments,
    )  # fmt: skip


def test_a_build_in_the_child_leaves_the_artifact_and_the_verdict_prove_finds(proofs, tmp_path):
    built, loaded, artifact = tmp_path / "built", tmp_path / "loaded", tmp_path / "lib.so"
    verdict = prove_build(artifact, {"marker": str(built)}, loaded)
    assert verdict.passed and verdict.source == "child" and artifact.read_text() == "built"
    assert runs(built) == 1 and runs(loaded) == 0, "built and checked in one child"
    stored = json.loads(verdict.path.read_text())  # the load probe's verdict on these bytes
    assert stored["key"]["probe"] == "proof_probes:passes" and stored["passed"] is True
    assert stored["key"]["artifact"] == str(artifact.resolve())
    left = {p.name for p in tmp_path.iterdir() if p.suffix != ".lock"} - {"built"}
    assert left == {"lib.so", verdict.path.name}, "no staged file, one verdict"

    arguments = {"marker": str(loaded)}
    again = artifact_proof.prove("lib", "proof_probes:passes", arguments, artifact=artifact)
    assert again.source == "memory"
    proofs.setattr(artifact_proof, "_verdicts", {})  # as a fresh process
    assert prove_build(artifact, {"marker": str(built)}, loaded).source == "disk"
    assert runs(built) == 1 and runs(loaded) == 0

    artifact.write_text("rebuilt elsewhere")  # other bytes: proved (not built) again
    assert prove_build(artifact, {"marker": str(built)}, loaded).source == "child"
    assert runs(built) == 1 and runs(loaded) == 1


@pytest.mark.parametrize(
    ("build_arguments", "reason"),
    [
        ({"reason": "output 0 differs from eager by up to 0.5"}, "output 0 differs from eager"),
        ({"write": False}, "it passed without writing lib."),
    ],
    ids=["disagrees", "writes-nothing"],
)
def test_a_failed_build_leaves_no_artifact_and_is_cached(proofs, tmp_path, build_arguments, reason):
    built, artifact = tmp_path / "built", tmp_path / "lib.so"
    build_arguments = {**build_arguments, "marker": str(built)}
    verdict = prove_build(artifact, build_arguments)
    assert not verdict.passed and verdict.reason.startswith(reason), verdict.reason
    assert not artifact.exists() and not list(tmp_path.glob("*staged*"))
    assert json.loads(verdict.path.read_text())["key"]["probe"] == "proof_probes:builds"
    assert prove_build(artifact, build_arguments).source == "memory"
    proofs.setattr(artifact_proof, "_verdicts", {})
    cached = prove_build(artifact, build_arguments)
    assert cached.source == "disk" and cached.reason == verdict.reason and runs(built) == 1


def test_concurrent_processes_build_once(proofs, tmp_path):
    built, artifact = tmp_path / "built", tmp_path / "lib.so"
    arguments = json.dumps({"marker": str(built), "sleep": 1.0})
    processes = [fresh_process(arguments, str(artifact), script=FRESH_BUILD) for _ in range(3)]
    outcomes = outcomes_of(processes)
    assert sorted(source for _, source in outcomes) == ["child", "disk", "disk"]
    assert all(passed for passed, _ in outcomes) and runs(built) == 1
    assert artifact.read_text() == "built" and not list(tmp_path.glob("*staged*"))


def test_off_builds_in_a_child_and_trusts(proofs, tmp_path):
    proofs.setenv(artifact_proof.PROVE_ENV, "off")
    built, artifact = tmp_path / "built", tmp_path / "lib.so"
    verdict = prove_build(artifact, {"marker": str(built)})
    assert verdict.passed and verdict.source == "trusted" and artifact.read_text() == "built"
    assert not list(tmp_path.glob("*.proof.json"))


# ---------------------------------------------------------------- one child, many probes


def test_a_worker_runs_probe_after_probe_in_one_child(proofs, tmp_path):
    environment = child_probe.child_environment({"PYTHONPATH": str(TESTS_DIR)})
    worker = child_probe.ProbeWorker(environment, idle_seconds=1.0)
    pids = tmp_path / "pids"
    try:
        for _ in range(3):
            assert worker.run("proof_probes:records_pid", {"marker": str(pids)}, timeout=60)[0]
        assert len(set(pids.read_text().split())) == 1, "one child ran all three"

        crashed = worker.run("proof_probes:segfaults", {}, timeout=60)
        assert not crashed.passed and crashed.reason.startswith("killed by SIGSEGV")
        assert "in segfaults" in crashed.reason
        failed = worker.run("proof_probes:raises", {}, timeout=60)
        assert failed.reason.startswith("ValueError: bad probe input ("), failed.reason
        hung = worker.run("proof_probes:hangs", {}, timeout=1.5)
        assert hung.reason.startswith("timed out after 1.5 s") and "in hangs" in hung.reason

        time.sleep(1.5)  # the child idles out; the next probe starts another
        assert worker.run("proof_probes:records_pid", {"marker": str(pids)}, timeout=60)[0]
        assert worker.run("proof_probes:records_pid", {"marker": str(pids)}, timeout=60)[0]
        first, *_, second, third = pids.read_text().split()
        assert len({first, second}) == 2 and second == third

        worker.idle_seconds = 600.0  # this side thinks the child fresh and alive; it is not
        time.sleep(1.5)
        proofs.setattr(worker._child, "poll", lambda: None)
        assert worker.run("proof_probes:records_pid", {"marker": str(pids)}, timeout=60)[0]
        assert pids.read_text().split()[-1] not in (first, second), "retried in a new child"
    finally:
        worker.close()


def test_shared_proofs_run_in_one_child_until_the_environment_changes(proofs, tmp_path):
    pids = tmp_path / "pids"

    def prove(name: str) -> None:
        verdict = artifact_proof.prove(
            name, "proof_probes:records_pid", {"marker": str(pids)}, directory=tmp_path,
            shared=True,
        )  # fmt: skip
        assert verdict.passed and verdict.source == "child", verdict

    prove("one")
    prove("two")
    proofs.setenv("PYTEST_CURRENT_TEST", "another test")  # changes no outcome
    prove("three")
    proofs.setenv("LLM_OPERATOR_TEST_SETTING", "changed")  # may change one: a fresh child
    prove("four")
    first, second, third, fourth = pids.read_text().split()
    assert first == second == third != fourth
