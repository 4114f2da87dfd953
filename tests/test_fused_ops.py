"""The fused elementwise regions (llm_operator.models.fused): compiled equals eager.

The shapes are the tiny test models' (hidden 64, 4 heads, 2 kv heads, head_dim 16 or
Qwen3's 32 with q/k norm, intermediate 128, eps 1e-6), so the packages these tests build
are the ones the engine tests use: inductor's cache directory holds them once per
machine. 600 tokens takes the multi-threaded CPU build, fewer the one-thread build.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import tiny_config
from test_native_model import DenseAttention, hf_logits, native_model, prompts, run_packed
from torch import Tensor

from llm_operator.models import fused
from llm_operator.models.llama import LlamaModel

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, EPS = 64, 128, 4, 2, 1e-6
FP32_TOLERANCE = {"atol": 1e-6, "rtol": 1e-6}  # reductions sum in another order: a few ulp
TOKEN_COUNTS = (1, 3, 17, 600)


def random_inputs(tokens: int, dtype: torch.dtype, head_dim: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed + tokens)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    angles = torch.rand(tokens, head_dim, generator=generator) * 6.3
    return {
        "hidden": randn(tokens, HIDDEN, scale=3.0),
        "delta": randn(tokens, HIDDEN),
        "weight": randn(HIDDEN),
        "qkv": randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, scale=2.0),
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "q_norm": randn(head_dim),
        "k_norm": randn(head_dim),
        "gate_up": randn(tokens, 2 * INTERMEDIATE, scale=4.0),
    }


def all_regions(ops: fused.FusedOps, x: dict, head_dim: int, qk_norm: bool) -> list[Tensor]:
    norms = (x["q_norm"], x["k_norm"]) if qk_norm else (None, None)
    return [
        *ops.add_rms_norm(x["hidden"], x["delta"], x["weight"], EPS),
        *ops.qkv_rope(x["qkv"], x["cos"], x["sin"], *norms, EPS, HEADS, KV_HEADS, head_dim),
        ops.silu_mul(x["gate_up"]),
    ]


def assert_bf16_equal_up_to_rare_flips(got: Tensor, want: Tensor, name: str) -> None:
    """Bitwise equal, except at most 1 in 1,000 elements up to two bf16 ulp apart: an
    RMSNorm sums its squares in fp32 in another order than eager, and a last-bit difference
    there can cross a bf16 rounding boundary of the normalized value (one ulp), which the
    weight's multiply can widen to two (measured on SmolLM2 in bf16: 140 of 29 million norm
    outputs, none elsewhere)."""
    assert got.dtype == want.dtype == torch.bfloat16
    flipped = got != want
    if not flipped.any():
        return
    steps = got.view(torch.int16).int() - want.view(torch.int16).int()  # adjacent bf16: 1
    assert steps[flipped].abs().max() <= 2 and (got[flipped] * want[flipped] > 0).all(), (
        f"{name}: differs by more than two bf16 ulp (max |diff| {(got - want).abs().max()})"
    )
    fraction = flipped.float().mean().item()
    assert fraction <= 1e-3, f"{name}: {fraction:.2%} of the elements differ"


def assert_compiled() -> None:
    assert not fused.FALLBACK.failed, "a compiled region failed and fell back to eager"
    built = {key[0] for key in fused.COMPILED_OPS.packages.runners}
    assert built >= {"add_rms_norm", "qkv_rope", "silu_mul"}, built


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize(
    ("dtype", "head_dim", "qk_norm"),
    [(torch.float32, 16, False), (torch.float32, 32, True), (torch.bfloat16, 32, True)],
    ids=["fp32", "fp32-qk-norm", "bf16-qk-norm"],
)
def test_compiled_regions_equal_eager(tokens, dtype, head_dim, qk_norm):
    """fp32: within a few ulp; bf16: bitwise (every bf16 rounding of eager kept) but for
    rare one-ulp flips of RMSNorm outputs."""
    x = random_inputs(tokens, dtype, head_dim)
    with torch.inference_mode():
        compiled = all_regions(fused.COMPILED_OPS, x, head_dim, qk_norm)
        eager = all_regions(fused.EAGER_OPS, x, head_dim, qk_norm)
    assert_compiled()
    names = ["hidden", "normed", "q", "k", "v", "activated"]
    for name, got, want in zip(names, compiled, eager, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.is_contiguous(), f"{name} is not contiguous"
        if dtype == torch.bfloat16:
            assert_bf16_equal_up_to_rare_flips(got, want, name)
        else:
            torch.testing.assert_close(got, want, **FP32_TOLERANCE, msg=name)


def test_outputs_are_fresh_tensors_and_odd_inputs_run_eagerly():
    x = random_inputs(5, torch.float32, 16)
    with torch.inference_mode():
        first = fused.COMPILED_OPS.silu_mul(x["gate_up"])
        kept = first.clone()
        fused.COMPILED_OPS.silu_mul(x["gate_up"] * 2)
        assert torch.equal(first, kept), "a later call overwrote an earlier call's output"
        strided = x["gate_up"].t().contiguous().t()  # same values, column-major
        runners = len(fused.COMPILED_OPS.packages.runners)
        torch.testing.assert_close(fused.COMPILED_OPS.silu_mul(strided), first, **FP32_TOLERANCE)
        empty = fused.COMPILED_OPS.silu_mul(x["gate_up"][:0])
    assert empty.shape == (0, INTERMEDIATE)
    assert len(fused.COMPILED_OPS.packages.runners) == runners, "odd inputs must not build packages"
    needs_grad = x["gate_up"].clone().requires_grad_()
    fused.COMPILED_OPS.silu_mul(needs_grad).sum().backward()  # eager: autograd works
    assert needs_grad.grad is not None


def test_packages_load_from_the_cache_directory():
    """A second CompiledOps (a second process) loads what the first one built."""
    x = random_inputs(3, torch.float32, 16)
    with torch.inference_mode():
        fused.COMPILED_OPS.silu_mul(x["gate_up"])  # built here, or loaded by an earlier run
        fresh = fused.CompiledOps()
        got = fresh.silu_mul(x["gate_up"])
    assert [action for _, action, _ in fresh.packages.log] == ["loaded"]
    torch.testing.assert_close(got, fused.silu_mul(x["gate_up"]), **FP32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_forward_compiled_equals_eager(tiny_qwen3_dir, monkeypatch, dtype):
    """The whole tiny Qwen3 (q/k norm) forward, compiled against eager."""
    model = LlamaModel.from_pretrained(tiny_qwen3_dir, device=torch.device("cpu"), dtype=dtype)
    config = model.config
    groups = config.num_heads // config.num_kv_heads

    def causal_attention(layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, T, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=config.scale
        )
        return out[0].transpose(0, 1)

    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(fused.COMPILE_ENV, mode)
        with torch.inference_mode():
            outputs[mode] = model(ids, torch.arange(len(ids)), causal_attention)
    assert not fused.FALLBACK.failed
    if dtype == torch.bfloat16:
        assert_bf16_equal_up_to_rare_flips(outputs["on"], outputs["off"], "hidden")
    else:
        torch.testing.assert_close(outputs["on"], outputs["off"], atol=1e-5, rtol=1e-5)


def test_other_activations_run_eagerly_and_match_hf(tmp_path, monkeypatch):
    """Only SiLU is fused: a GELU model takes the layer's eager act_fn, compiled norms and
    RoPE around it, and still gives HF's logits."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(fused.COMPILE_ENV, "on")
    config = tiny_config("llama", 512, 0)
    config.hidden_act = "gelu_pytorch_tanh"
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = native_model(tmp_path)
    assert not model.layers[0].fuse_activation
    batch = prompts(512, lengths=(9, 14))
    chunks = [(f"r{i}", ids, 0) for i, ids in enumerate(batch)]
    for ids, logits in zip(batch, run_packed(model, DenseAttention(model.config), chunks)):
        torch.testing.assert_close(logits, hf_logits(tmp_path, ids), atol=1e-5, rtol=1e-5)
    assert not fused.FALLBACK.failed


def test_compile_mode_and_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    for value, mode in [("", "auto"), ("auto", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"),
                        ("off", "off")]:  # fmt: skip
        monkeypatch.setenv(fused.COMPILE_ENV, value)
        assert fused.compile_mode() == mode
    monkeypatch.setenv(fused.COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match="LLM_OPERATOR_COMPILE must be one of"):
        fused.fused_ops(cpu, torch.float32)
    monkeypatch.setenv(fused.COMPILE_ENV, "auto")
    assert fused.fused_ops(cpu, torch.float32) is fused.COMPILED_OPS
    assert fused.fused_ops(cpu, torch.bfloat16) is fused.COMPILED_OPS
    assert fused.fused_ops(cpu, torch.float16) is fused.EAGER_OPS  # CPU fp16: eager unless "on"
    monkeypatch.setenv(fused.COMPILE_ENV, "on")
    assert fused.fused_ops(cpu, torch.float16) is fused.COMPILED_OPS
    monkeypatch.setenv(fused.COMPILE_ENV, "off")
    assert fused.fused_ops(cpu, torch.float32) is fused.EAGER_OPS


def _run_with_failure(monkeypatch, tmp_path, break_it) -> tuple[list, list[Tensor], list[Tensor]]:
    """Every region twice on a fresh CompiledOps (its own cache directory) and a fresh
    fallback flag, with ``break_it(ops)`` applied first: (warnings, compiled, eager)."""
    monkeypatch.setattr(fused, "FALLBACK", fused._Fallback())
    ops = fused.CompiledOps(cache_dir=tmp_path)
    break_it(ops)
    x = random_inputs(6, torch.float32, 32)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        for _ in range(2):
            compiled = all_regions(ops, x, 32, qk_norm=True)
        eager = all_regions(fused.EAGER_OPS, x, 32, qk_norm=True)
    runtime_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    return runtime_warnings, compiled, eager


@pytest.mark.parametrize("where", ["child", "here"])
def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, tmp_path, where):
    """The build fails in the proving child (proofs on: its failure is cached beside the
    package that never was) or in this process (proofs off)."""
    import torch._inductor

    from llm_operator.kernels import artifact_proof
    from llm_operator.models import aot_packages

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    def break_it(ops):
        if where == "child":
            monkeypatch.delenv(artifact_proof.PROVE_ENV, raising=False)
            monkeypatch.setattr(aot_packages, "BUILD_PROBE", "proof_probes:no_compiler")
        else:
            monkeypatch.setenv(artifact_proof.PROVE_ENV, "off")
            monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)

    caught, compiled, eager = _run_with_failure(monkeypatch, tmp_path, break_it)
    assert len(caught) == 1
    assert "RuntimeError: no C++ compiler found" in str(caught[0].message)
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    assert fused.FALLBACK.failed
    monkeypatch.setenv(fused.COMPILE_ENV, "on")
    assert fused.fused_ops(torch.device("cpu"), torch.float32) is fused.EAGER_OPS
    left = sorted(path.name for path in tmp_path.iterdir())
    if where == "child":  # the failed build's verdict and lock: no package, no staged file
        assert [name.rsplit(".", 3)[-2:] for name in left] == [["proof", "json"], ["proof", "lock"]]
        assert "no C++ compiler found" in json.loads((tmp_path / left[0]).read_text())["reason"]
    else:
        assert not left, "a failed build leaves no file behind"


def test_runtime_failure_falls_back_to_eager_with_one_warning(monkeypatch, tmp_path):
    calls = []

    def broken_runner(args):
        calls.append(len(args))
        raise RuntimeError("kernel crashed")

    def break_it(ops):
        monkeypatch.setattr(ops.packages, "build", lambda *args: broken_runner)

    caught, compiled, eager = _run_with_failure(monkeypatch, tmp_path, break_it)
    assert len(caught) == 1 and "RuntimeError: kernel crashed" in str(caught[0].message)
    assert len(calls) == 1, "after the failure no region tries its compiled build again"
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
