"""TritonOps (llm_operator.models.triton_ops): the decoder layer's elementwise regions as
Triton kernels, which ``fused.fused_ops`` picks for CUDA tensors, and for CPU tensors when
LLM_OPERATOR_KERNELS=triton under the Triton interpreter (how these tests run the CUDA
path). Inputs the kernels do not take run the eager reference; a kernel failure warns
once and turns every region eager; the engine on that path gives HF generate's tokens;
a decode layer dispatches far fewer ops. The kernels' numerics: test_triton_fused.py.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from helpers import NATIVE_FAMILIES  # noqa: E402
from test_hf_backend import assert_matches_hf, three_level_prompts  # noqa: E402
from test_triton_fused import DTYPES, EPS, randn, rope_inputs  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.kernels import IMPLEMENTATION_ENV  # noqa: E402
from llm_operator.kernels import triton_fused as tf  # noqa: E402
from llm_operator.models import fused, triton_ops  # noqa: E402
from llm_operator.models.triton_ops import TRITON_OPS, TritonOps  # noqa: E402

# ---------------------------------------------------------------- TritonOps and fused_ops


def test_triton_ops_run_the_kernels_or_the_eager_reference(monkeypatch):
    """Eligible inputs: one kernel call each. Non-contiguous, mixed dtypes, zero tokens and
    tensors that need gradients: the eager reference, same values."""
    calls = []
    for name in ("rms_norm", "add_rms_norm", "qkv_rope", "silu_mul"):
        function = getattr(tf, name)
        monkeypatch.setattr(tf, name, lambda *a, f=function, n=name: calls.append(n) or f(*a))
    ops = TritonOps()
    generator = torch.Generator().manual_seed(5)
    hidden, weight = randn(generator, 3, 64), randn(generator, 64)
    qkv, cos, sin, norms = rope_inputs(3, (4, 2, 16), torch.float32)
    gate_up = randn(generator, 3, 256)
    ops.rms_norm(hidden, weight, EPS)
    ops.add_rms_norm(hidden, hidden, weight, EPS)
    ops.qkv_rope(qkv, cos, sin, *norms, EPS, 4, 2, 16)
    ops.silu_mul(gate_up)
    assert calls == ["rms_norm", "add_rms_norm", "qkv_rope", "silu_mul"]
    calls.clear()
    odd = {
        "strided": (hidden.t().contiguous().t(), weight, gate_up.t().contiguous().t()),
        "mixed dtypes": (hidden, weight.double(), gate_up.double()),
        "zero tokens": (hidden[:0], weight, gate_up[:0]),
        "needs grad": (hidden.clone().requires_grad_(), weight, gate_up.clone().requires_grad_()),
    }
    for name, (x, w, g) in odd.items():
        torch.testing.assert_close(ops.rms_norm(x, w, EPS), fused.rms_norm(x, w, EPS), msg=name)
        torch.testing.assert_close(ops.silu_mul(g), fused.silu_mul(g), msg=name)
    eager_rope = ops.qkv_rope(qkv.t().contiguous().t(), cos, sin, *norms, EPS, 4, 2, 16)
    for got, want in zip(eager_rope, fused.qkv_rope(qkv, cos, sin, *norms, EPS, 4, 2, 16)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # eager sums by strides
    ops.qkv_rope(qkv, cos, sin, norms[0], None, EPS, 4, 2, 16)  # one weight: no norm, eager
    assert calls == [], "odd inputs must not reach the kernels"
    needs_grad = gate_up.clone().requires_grad_()
    ops.silu_mul(needs_grad).sum().backward()  # eager: autograd works
    assert needs_grad.grad is not None


def test_a_failing_kernel_warns_once_and_every_region_runs_eagerly(monkeypatch):
    def broken(*args):
        raise RuntimeError("PTX assembly failed")

    ops = TritonOps()
    monkeypatch.setattr(triton_ops, "TRITON_OPS", ops)
    monkeypatch.setattr(tf, "silu_mul", broken)
    monkeypatch.setenv(IMPLEMENTATION_ENV, "triton")
    gate_up = torch.randn(3, 256)
    hidden, weight = torch.randn(3, 64), torch.randn(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(ops.silu_mul(gate_up), fused.silu_mul(gate_up))
        assert torch.equal(ops.silu_mul(gate_up), fused.silu_mul(gate_up))
        assert torch.equal(ops.rms_norm(hidden, weight, EPS), fused.rms_norm(hidden, weight, EPS))
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1 and "RuntimeError: PTX assembly failed" in str(runtime[0].message)
    assert ops.failed
    assert fused.fused_ops(torch.device("cpu"), torch.float16) is fused.EAGER_OPS
    assert fused.fused_ops(torch.device("cuda"), torch.bfloat16) is fused.EAGER_OPS


def test_fused_ops_picks_triton_on_cuda_and_for_forced_cpu_tensors(monkeypatch):
    import sys

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(IMPLEMENTATION_ENV, raising=False)
    monkeypatch.setenv(fused.COMPILE_ENV, "auto")
    assert not TRITON_OPS.failed
    assert fused.fused_ops(cuda, torch.bfloat16) is TRITON_OPS
    assert fused.fused_ops(cpu, torch.float32) is fused.COMPILED_OPS  # the CPU as before
    assert fused.fused_ops(cpu, torch.float16) is fused.EAGER_OPS
    monkeypatch.setenv(IMPLEMENTATION_ENV, "triton")  # the interpreter runs the kernels
    for dtype in DTYPES:
        assert fused.fused_ops(cpu, dtype) is TRITON_OPS
    monkeypatch.setenv(fused.COMPILE_ENV, "on")
    assert fused.fused_ops(cuda, torch.float16) is TRITON_OPS
    monkeypatch.setenv(fused.COMPILE_ENV, "off")
    assert fused.fused_ops(cuda, torch.float16) is fused.EAGER_OPS
    assert fused.fused_ops(cpu, torch.float32) is fused.EAGER_OPS
    monkeypatch.setenv(fused.COMPILE_ENV, "auto")
    monkeypatch.setattr(tf, "_INTERPRETED", False)  # compiled Triton: CPU tensors can't run
    assert fused.fused_ops(cpu, torch.float32) is fused.COMPILED_OPS
    monkeypatch.setitem(sys.modules, "llm_operator.models.triton_ops", None)  # no Triton
    assert fused.fused_ops(cuda, torch.bfloat16) is fused.EAGER_OPS
    assert fused.fused_ops(cpu, torch.float32) is fused.COMPILED_OPS


def test_qkv_rope_store_into_strided_cache_views_and_its_eager_fallback():
    heads = (4, 2, 16)
    qkv, cos, sin, norms = rope_inputs(4, heads, torch.float32, seed=2)
    slots = torch.tensor([9, 0, -1, 4])
    results = []
    for strided_qkv in (False, True):  # True: TritonOps runs the eager regions + store
        storage = torch.zeros(3, 4, 2, 32)  # k and v interleaved in one buffer
        k_cache, v_cache = storage[..., ::2], storage[..., 1::2]  # [3, 4, 2, 16] each
        args = qkv.t().contiguous().t() if strided_qkv else qkv
        outputs = TritonOps().qkv_rope_store(
            args, cos, sin, None, None, EPS, *heads, k_cache, v_cache, slots
        )
        assert int((storage != 0).sum()) == 3 * 2 * 32, "three slots of both caches, no more"
        results.append((storage, outputs))
    (storage, outputs), (eager_storage, eager_outputs) = results
    torch.testing.assert_close(storage, eager_storage, atol=0, rtol=0)
    for got, want in zip(outputs, eager_outputs, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------- the model and the engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_with_triton_ops_matches_hf_generate(family, monkeypatch, request):
    """The native engine's CUDA path on the CPU (LLM_OPERATOR_KERNELS=triton: attention and
    the elementwise regions as Triton kernels under the interpreter), fp32, greedy: HF
    generate's tokens, with every region through a kernel."""
    assert family in NATIVE_FAMILIES
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    monkeypatch.setenv(IMPLEMENTATION_ENV, "triton")
    assert fused.fused_ops(torch.device("cpu"), torch.float32) is TRITON_OPS
    calls = dict.fromkeys(("rms_norm", "add_rms_norm", "qkv_rope", "silu_mul"), 0)
    for name in calls:
        function = getattr(tf, name)

        def counting(*args, name=name, function=function):
            calls[name] += 1
            return function(*args)

        monkeypatch.setattr(tf, name, counting)
    prompts = three_level_prompts()[:4]
    op = LLMOperator(model_dir, backend="native", kv_block_size=4, prefill_batch_tokens=48)
    results = op.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 3, ignore_eos=True)
    assert all(count > 0 for count in calls.values()), calls
    assert not TRITON_OPS.failed


# The eager regions' elementwise ops (each a kernel launch on a GPU but for no-op casts).
ELEMENTWISE_OPS = {"add", "mul", "pow", "mean", "rsqrt", "neg", "cat", "silu", "to",
                   "_to_copy", "contiguous", "clone", "copy_"}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_decode_layer_dispatches_fewer_ops_with_triton_ops(family, monkeypatch, request):
    """aten ops one decoder layer's forward dispatches on 4 decode rows (TorchDispatchMode),
    eager regions against TritonOps; an interpreted Triton launch counts as one launch and
    its own bookkeeping (the interpreter's argument copies) is not counted."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from llm_operator.models.llama import LlamaModel

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}
            self.launches = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    counters: list[CountOps] = []
    run_grid = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        counters[-1].launches += 1
        with _disable_current_modes():
            return run_grid(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    model = LlamaModel.from_pretrained(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    layer = model.layers[1]  # a layer whose input norm adds the previous MLP's output
    generator = torch.Generator().manual_seed(0)
    hidden, delta = (randn(generator, 4, model.config.hidden_size) for _ in range(2))
    cos, sin = model.rotary(torch.arange(20, 24), torch.float32)
    outputs = {}
    for name, ops in (("eager", fused.EAGER_OPS), ("triton", TritonOps())):
        counters.append(CountOps())
        with torch.inference_mode(), counters[-1]:
            outputs[name] = layer(hidden, delta, cos, sin, lambda index, q, k, v: q, ops)
    eager, triton = counters
    eager_total, triton_total = sum(eager.ops.values()), sum(triton.ops.values())
    print(
        f"\n{family} layer, 4 decode rows: eager {eager_total} aten ops {eager.ops}; "
        f"TritonOps {triton_total} aten ops {triton.ops} + {triton.launches} Triton launches"
    )
    assert triton.launches == 4  # add + RMSNorm twice, QKV + RoPE, SiLU * up
    assert triton_total + triton.launches < eager_total
    assert not set(triton.ops) & ELEMENTWISE_OPS, "TritonOps left elementwise work to aten"
    assert sum(eager.ops.get(op, 0) for op in ELEMENTWISE_OPS) >= 30  # op by op, eagerly
    for got, want in zip(outputs["triton"], outputs["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the self-check


@pytest.fixture
def checked_cpu(monkeypatch, tmp_path):
    """Proofs on, verdicts in tmp_path, CPU tensors treated as CUDA ones (they default to
    the Triton kernels, so the engine checks them), nothing forced, compile mode auto."""
    from llm_operator import kernels
    from llm_operator.kernels import artifact_proof

    monkeypatch.delenv(artifact_proof.PROVE_ENV, raising=False)
    monkeypatch.delenv(IMPLEMENTATION_ENV, raising=False)
    monkeypatch.setenv(fused.COMPILE_ENV, "auto")
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path))
    monkeypatch.setattr(artifact_proof, "_verdicts", {})
    monkeypatch.setattr(kernels, "_TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "_check_results", {})
    monkeypatch.setattr(kernels, "_fallback_devices", set())
    return monkeypatch


TINY_SIZES = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
              "intermediate_size": 128}  # fmt: skip


def test_a_fused_check_that_crashes_in_its_child_sends_the_device_to_eager(checked_cpu, tmp_path):
    """The check's child segfaults: one RuntimeWarning, the check never runs here, every
    region on that device runs eagerly (no kernel is called), other devices keep them."""
    from llm_operator.kernels import self_check_fused, triton_proof

    in_process = []
    checked_cpu.setattr(
        self_check_fused, "check_triton_fused", lambda *a, **k: in_process.append(a)
    )
    checked_cpu.setattr(triton_proof, "FUSED_PROBE", "proof_probes:segfaults")
    ops = TritonOps()
    with pytest.warns(RuntimeWarning) as record:
        reason = ops.ensure_checked("cpu", torch.float32, **TINY_SIZES)
    assert len(record) == 1 and reason.startswith("it failed in a child process: killed by")
    message = str(record[0].message)
    assert "elementwise kernels failed their self-check on cpu (float32)" in message
    assert "killed by SIGSEGV" in message and "run eagerly" in message
    assert in_process == [] and ops.failed_on(torch.device("cpu")) and not ops.failed
    assert not ops.failed_on(torch.device("cuda", 0))
    assert list((tmp_path / "proofs").glob("Triton-fused-self-check.*.proof.json"))

    def must_not_run(*args):
        raise AssertionError("a Triton kernel ran on a device that failed its self-check")

    for name in ("rms_norm", "add_rms_norm", "qkv_rope", "qkv_rope_store", "silu_mul"):
        checked_cpu.setattr(tf, name, must_not_run)
    generator = torch.Generator().manual_seed(7)
    hidden, weight, gate_up = (
        randn(generator, 3, 64),
        randn(generator, 64),
        randn(generator, 3, 256),
    )
    qkv, cos, sin, norms = rope_inputs(3, (4, 2, 16), torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning: checked once
        assert ops.ensure_checked(torch.device("cpu"), torch.float32, **TINY_SIZES) == reason
        assert torch.equal(ops.rms_norm(hidden, weight, EPS), fused.rms_norm(hidden, weight, EPS))
        for got, want in zip(
            ops.add_rms_norm(hidden, hidden, weight, EPS),
            fused.add_rms_norm(hidden, hidden, weight, EPS),
        ):
            assert torch.equal(got, want)
        for got, want in zip(
            ops.qkv_rope(qkv, cos, sin, *norms, EPS, 4, 2, 16),
            fused.qkv_rope(qkv, cos, sin, *norms, EPS, 4, 2, 16),
        ):
            assert torch.equal(got, want)
        assert torch.equal(ops.silu_mul(gate_up), fused.silu_mul(gate_up))
    assert in_process == []
    checked_cpu.setattr(triton_ops, "TRITON_OPS", ops)
    checked_cpu.setenv(IMPLEMENTATION_ENV, "triton")  # would hand the CPU TRITON_OPS
    assert triton_ops.triton_ops_for(torch.device("cpu")) is None
    assert fused.fused_ops(torch.device("cpu"), torch.float32) is not ops


def test_the_real_fused_probe_passes_in_a_child_then_runs_here(checked_cpu, tmp_path):
    """The real check in a child (the interpreter there too), then here; no warning."""
    import json

    from llm_operator.kernels import self_check_fused

    calls = []
    check = self_check_fused.check_triton_fused
    checked_cpu.setattr(
        self_check_fused, "check_triton_fused", lambda *a, **k: calls.append(a) or check(*a, **k)
    )
    ops = TritonOps()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.ensure_checked("cpu", torch.bfloat16, **TINY_SIZES) is None
    assert len(calls) == 1 and not ops.failed_on(torch.device("cpu"))  # here, after the child
    (verdict,) = (tmp_path / "proofs").glob("Triton-fused-self-check.*.proof.json")
    stored = json.loads(verdict.read_text())
    assert stored["passed"] is True
    assert stored["key"]["arguments"]["reference"] == triton_ops.REFERENCE
    assert stored["key"]["arguments"]["hidden_size"] == 64


def test_no_check_where_the_kernels_do_not_run_unforced(checked_cpu):
    from llm_operator import kernels
    from llm_operator.kernels import triton_proof

    def must_not_run(*args, **kwargs):
        raise AssertionError("checked where no check applies")

    checked_cpu.setattr(triton_proof, "proven_check_triton_fused", must_not_run)
    ops = TritonOps()
    checked_cpu.setenv(IMPLEMENTATION_ENV, "triton")  # forced: unchecked
    assert ops.ensure_checked("cpu", torch.float32, **TINY_SIZES) is None
    checked_cpu.delenv(IMPLEMENTATION_ENV)
    checked_cpu.setenv(fused.COMPILE_ENV, "off")  # no TritonOps at all
    assert ops.ensure_checked("cpu", torch.float32, **TINY_SIZES) is None
    checked_cpu.setenv(fused.COMPILE_ENV, "auto")
    checked_cpu.setattr(kernels, "_TRITON_DEVICE_TYPES", ("cuda",))  # the CPU, as it is
    assert ops.ensure_checked("cpu", torch.float32, **TINY_SIZES) is None


def test_the_engine_checks_the_fused_kernels_with_the_model_sizes(checked_cpu, tiny_qwen3_dir):
    """At engine start, beside the attention check and apart from it: each failure warns
    once and falls back on its own; every row completes."""
    import json

    from llm_operator.kernels import self_check, triton_proof

    checked_cpu.setenv("LLM_OPERATOR_PROVE", "off")  # the fakes run here
    checked_cpu.setattr(self_check, "check_triton", lambda *a, **k: "attention is off")
    calls = []

    def fused_check(device, dtype, reference, **sizes):
        calls.append((device, dtype, reference, sizes))
        return "silu_mul: activated is 9 ulp off (at most 4)"

    checked_cpu.setattr(triton_proof, "proven_check_triton_fused", fused_check)
    checked_cpu.setattr(triton_ops, "TRITON_OPS", TritonOps())
    op = LLMOperator(tiny_qwen3_dir, backend="native", device="cpu")
    with pytest.warns(RuntimeWarning) as record:
        results = op.generate(["Summarize the review."], SamplingParams(max_tokens=3))
    messages = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert len(messages) == 2, messages
    assert "Triton attention kernels" in messages[0] and "attention is off" in messages[0]
    assert "elementwise kernels" in messages[1] and "9 ulp off" in messages[1]
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    ((device, dtype, reference, sizes),) = calls
    assert (device, dtype, reference) == (torch.device("cpu"), torch.float32, triton_ops.REFERENCE)
    assert sizes == {
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "eps": config["rms_norm_eps"],
        "identity": sizes["identity"],
    }
    assert triton_ops.TRITON_OPS.failed_on(torch.device("cpu"))
    assert results[0].error is None and results[0].completion_tokens > 0
