"""The engine's native artifacts behind their proofs (llm_operator.kernels.artifact_proof):
an AOTInductor package, the compiled CPU kernels or the Triton self-check that fails (here:
segfaults) in its proving child falls back with one warning and the same tokens; an
artifact trusted unproven that crashes leaves a Python traceback naming it on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_hf_backend import assert_matches_hf, three_level_prompts

from llm_operator import LLMOperator, SamplingParams
from llm_operator.kernels import artifact_proof


@pytest.fixture
def proofs(monkeypatch) -> pytest.MonkeyPatch:
    """Proofs on (``LLM_OPERATOR_PROVE`` unset) with an empty in-process verdict cache."""
    monkeypatch.delenv(artifact_proof.PROVE_ENV, raising=False)
    monkeypatch.setattr(artifact_proof, "_verdicts", {})
    return monkeypatch


def _generate(model_dir: Path, prompts: list[str]) -> tuple[LLMOperator, list, list]:
    """A native engine's greedy results on ``prompts`` and the RuntimeWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        op = LLMOperator(model_dir, backend="native")
        results = op.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    return op, results, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_package_that_crashes_its_proof_falls_back_to_eager(proofs, tiny_llama_dir, tmp_path):
    """The fused regions' packages (eager layers: no compiled decoder) fail their proof
    with a segfault in the child: one warning, every region eager, the same tokens."""
    from llm_operator.models import aot_packages, cpu_decoder, fused

    proofs.setenv(cpu_decoder.DECODER_ENV, "0")
    proofs.setenv(fused.COMPILE_ENV, "off")
    prompts = three_level_prompts()[:4]
    _, eager, _ = _generate(tiny_llama_dir, prompts)

    proofs.setenv(fused.COMPILE_ENV, "on")
    proofs.setattr(fused, "FALLBACK", fused._Fallback())
    proofs.setattr(fused, "COMPILED_OPS", fused.CompiledOps(cache_dir=tmp_path))
    proofs.setattr(aot_packages, "BUILD_PROBE", "proof_probes:segfaults")  # builds, proves
    _, results, caught = _generate(tiny_llama_dir, prompts)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "PackageProofError" in message and "killed by SIGSEGV" in message
    assert [r.token_ids for r in results] == [r.token_ids for r in eager]
    assert fused.FALLBACK.failed and not fused.COMPILED_OPS.packages.runners
    (verdict,) = tmp_path.glob("*.proof.json")  # the first package's build; none after
    assert json.loads(verdict.read_text())["passed"] is False
    assert not list(tmp_path.glob("*.pt2")), "nothing is left to load"


def test_the_package_probe_loads_runs_and_compares_with_eager(proofs, tmp_path):
    """``prove_package`` itself: passes a real package, names an output that disagrees
    with the eager module, and (in a child) fails a file that is not a package."""
    from llm_operator.models import aot_packages, fused

    with torch.inference_mode():
        fused.COMPILED_OPS.silu_mul(torch.randn(3, 256))  # built, or loaded and proven
    assert not fused.FALLBACK.failed
    (key,) = [
        k
        for k in fused.COMPILED_OPS.packages.runners
        if k[:4] == ("silu_mul", torch.float32, torch.device("cpu"), 256) and k[-1] == 1
    ]
    path = str(fused.COMPILED_OPS.packages._path(key, torch.device("cpu")))
    inputs = [{"shape": [3, 256], "dtype": "float32"}]
    reference = "llm_operator.models.fused:_SiluMul"
    assert aot_packages.prove_package(path, inputs, reference, [], "cpu", -1) is None
    silu_mul = fused.silu_mul
    proofs.setattr(fused, "silu_mul", lambda gate_up: silu_mul(gate_up) * 1.01)
    reason = aot_packages.prove_package(path, inputs, reference, [], "cpu", -1)
    assert reason.startswith("output 0 on 1 rows differs from eager by up to")

    garbage = tmp_path / "silu_mul-garbage.pt2"
    garbage.write_bytes(b"not a package")
    with pytest.raises(aot_packages.PackageProofError, match="silu_mul-garbage.pt2 failed"):
        aot_packages._prove(
            garbage, [torch.zeros(3, 256)], (reference, []), torch.device("cpu"), -1
        )


def test_cpu_kernels_that_crash_their_proof_fall_back_to_torch_attention(
    proofs, tiny_llama_dir, tmp_path
):
    from llm_operator.kernels import cpu_extension

    library = cpu_extension.library_path()
    if not library.is_file() and cpu_extension.load() is None:
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_extension.failure()}")
    copy = tmp_path / library.name  # its verdicts land in tmp_path
    shutil.copyfile(library, copy)
    proofs.setattr(cpu_extension, "library_path", lambda: copy)
    proofs.setattr(cpu_extension, "_state", {})
    proofs.setattr(cpu_extension, "PROBE", "proof_probes:segfaults")
    prompts = three_level_prompts()[:4]
    op, results, caught = _generate(tiny_llama_dir, prompts)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "compiled CPU kernels are not used" in message and "killed by SIGSEGV" in message
    assert cpu_extension.loaded() is None and "SIGSEGV" in cpu_extension.failure()
    assert op.backend()._pool[0] == "torch"  # the KV pool's layout: the torch attention
    assert_matches_hf(op, tiny_llama_dir, prompts, results, 6, ignore_eos=True)


def test_a_triton_check_that_crashes_in_the_child_never_runs_here(proofs, tmp_path):
    """ensure_checked's CUDA branch (CPU tensors standing in for CUDA ones): a check that
    kills its child fails, warns once and sends the device to torch, unrun here."""
    from llm_operator import kernels
    from llm_operator.kernels import self_check, triton_proof

    proofs.setenv("LLM_OPERATOR_CACHE", str(tmp_path))
    proofs.delenv(kernels.IMPLEMENTATION_ENV, raising=False)
    proofs.setattr(kernels, "_TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    proofs.setattr(kernels, "_check_results", {})
    proofs.setattr(kernels, "_fallback_devices", set())
    in_process = []
    proofs.setattr(self_check, "check_triton", lambda *args, **kwargs: in_process.append(args))
    proofs.setattr(triton_proof, "PROBE", "proof_probes:segfaults")
    with pytest.warns(RuntimeWarning, match="failed their self-check") as record:
        reason = kernels.ensure_checked("cpu", torch.float32)
    assert len(record) == 1 and reason.startswith("it failed in a child process: killed by SIGSEGV")
    assert in_process == [] and kernels.implementation(torch.zeros(1)) == "torch"
    assert list((tmp_path / "proofs").glob("Triton-self-check.*.proof.json"))


def test_the_real_triton_probe_passes_in_a_child_then_runs_here(proofs, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from llm_operator.kernels import self_check, triton_proof

    proofs.setenv("LLM_OPERATOR_CACHE", str(tmp_path))
    proofs.setenv("TRITON_INTERPRET", "1")  # the child runs the kernels in the interpreter
    calls = []
    check_triton = self_check.check_triton
    monkeypatch.setattr(
        self_check, "check_triton", lambda *a, **k: calls.append(a) or check_triton(*a, **k)
    )
    assert triton_proof.proven_check_triton("cpu", torch.float32) is None
    assert len(calls) == 1  # here, after the child passed
    (verdict,) = (tmp_path / "proofs").glob("*.proof.json")
    assert json.loads(verdict.read_text())["passed"] is True


CRASHING_ENGINE = """
import ctypes, faulthandler, sys
import torch._inductor
from llm_operator import LLMOperator, SamplingParams
from llm_operator.models import aot_packages

def build_garbage(self, path, module, args, threads):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a package")

def crash(*args, **kwargs):  # a package whose loader segfaults, as on the H200 (issue 29)
    ctypes.string_at(0)

aot_packages.PackageCache._compile = build_garbage
torch._inductor.aoti_load_package = crash
print("faulthandler before the engine:", faulthandler.is_enabled(), flush=True)
LLMOperator(sys.argv[1], backend="native").generate(["Why"], SamplingParams(max_tokens=2))
"""


def test_an_engine_that_segfaults_leaves_a_traceback_in_its_log(tiny_llama_dir, tmp_path):
    """Proofs off (the package is trusted and crashes its loader in-process): the task's
    stderr names the artifact, then faulthandler's Python frames down to our loader."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    environment.update(
        LLM_OPERATOR_PROVE="off",
        LLM_OPERATOR_COMPILE="on",
        LLM_OPERATOR_KERNELS="torch",  # eager layers, so the fused regions load packages
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_ENGINE, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == -11, done.stderr[-3000:]  # SIGSEGV, as before this change
    assert "faulthandler before the engine: False" in done.stdout
    stderr = done.stderr
    loading = stderr.index("llm_operator: loading the AOTInductor package " + str(tmp_path))
    fatal = stderr.index("Fatal Python error: Segmentation fault")
    assert loading < fatal
    frames = stderr[fatal:]
    assert 'aot_packages.py", line' in frames and "in build" in frames
    assert 'fused.py", line' in frames
