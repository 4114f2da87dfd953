"""TritonOps (llm_operator.models.triton_ops): the decoder layer's elementwise regions as
Triton kernels, which the engine takes on CUDA, and on CPU tensors with kernels="triton"
under the Triton interpreter (how these tests run the CUDA path). Inputs the kernels do
not take run the eager reference; the engine on that path gives HF generate's tokens; a
decode layer dispatches far fewer ops; a failed self-check leaves the regions eager. The
kernels' numerics: test_triton_fused.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from helpers import NATIVE_FAMILIES  # noqa: E402
from test_hf_backend import assert_matches_hf, three_level_prompts  # noqa: E402
from test_triton_fused import EPS, randn, rope_inputs  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.kernels import triton_fused as tf  # noqa: E402
from llm_operator.models import fused  # noqa: E402
from llm_operator.models.triton_ops import TritonOps  # noqa: E402

# ---------------------------------------------------------------- TritonOps


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
    """The native engine's CUDA path on the CPU (kernels="triton": attention and the
    elementwise regions as Triton kernels under the interpreter, K/V stored by the RoPE
    launch), fp32, greedy: HF generate's tokens, with every region through a kernel."""
    assert family in NATIVE_FAMILIES
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    calls = dict.fromkeys(("rms_norm", "add_rms_norm", "qkv_rope_store", "silu_mul"), 0)
    for name in calls:
        function = getattr(tf, name)

        def counting(*args, name=name, function=function):
            calls[name] += 1
            return function(*args)

        monkeypatch.setattr(tf, name, counting)
    prompts = three_level_prompts()[:4]
    op = LLMOperator(
        model_dir, backend="native", kernels="triton", kv_block_size=4, prefill_batch_tokens=48
    )
    results = op.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert_matches_hf(op, model_dir, prompts, results, 3, ignore_eos=True)
    assert all(count > 0 for count in calls.values()), calls
    assert op.backend().paths.fused_store


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


def test_the_engine_checks_the_fused_kernels_with_the_model_sizes(monkeypatch, tiny_qwen3_dir):
    """At engine start, after the attention check and apart from it: a failure of the
    elementwise kernels warns once and leaves the regions eager, the attention on Triton;
    every row completes."""
    import json

    from llm_operator.engine import factory
    from llm_operator.kernels import self_check

    calls = []

    def fused_check(device, dtype, reference, **sizes):
        calls.append((device, dtype, reference, sizes))
        return "silu_mul: activated is 9 ulp off (at most 4)"

    monkeypatch.setattr(self_check, "check_triton_fused", fused_check)
    factory._triton_fused_failure.cache_clear()
    try:
        op = LLMOperator(tiny_qwen3_dir, backend="native", device="cpu", kernels="triton")
        with pytest.warns(RuntimeWarning) as record:
            results = op.generate(["Summarize the review."], SamplingParams(max_tokens=3))
    finally:
        factory._triton_fused_failure.cache_clear()
    messages = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert len(messages) == 1 and "elementwise kernels" in messages[0], messages
    assert "9 ulp off" in messages[0]
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    ((device, dtype, reference, sizes),) = calls
    assert (device, dtype, reference) == (torch.device("cpu"), torch.float32, fused.EAGER_OPS)
    assert sizes == {
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "eps": config["rms_norm_eps"],
    }
    paths = op.backend().paths
    assert (paths.attention, paths.elementwise, paths.fused_store) == ("triton", "eager", False)
    assert results[0].error is None and results[0].completion_tokens > 0
