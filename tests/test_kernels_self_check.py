"""The Triton kernels' self-checks (llm_operator.kernels.self_check) and
the engine's one decision point that runs them (``engine.factory.native_paths``): the
torch kernels where a check fails.

The real kernels run on CPU tensors in the Triton interpreter (conftest sets
TRITON_INTERPRET=1), 0.3-0.8 s per check here. Broken kernels are simulated by replacing one
operation of ``triton_attention`` (the others replaced by the reference, so those tests
stay fast); a CUDA device by its name (the decision reads the device's type).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from test_kernels_torch import LSE_TOLERANCE, OUT_TOLERANCE  # noqa: E402

import llm_operator.kernels as kernels  # noqa: E402
from llm_operator.kernels import layout, self_check, torch_attention  # noqa: E402
from llm_operator.kernels import triton_attention as tri  # noqa: E402
from llm_operator.models.fused import EAGER_OPS  # noqa: E402

CPU = torch.device("cpu")


def test_tolerances_are_the_triton_tests_tolerances():
    assert self_check.OUT_TOLERANCE == OUT_TOLERANCE
    assert self_check.LSE_TOLERANCE == LSE_TOLERANCE


# ---------------------------------------------------------------- the real kernels


def test_real_kernels_pass_in_the_interpreter_on_both_ends_of_the_tile_sizes(monkeypatch):
    """SmolLM2's heads (9 on 3 KV heads, head_dim 64) in bf16: the launches span the
    smallest tile (16 packed rows: a decode step) and the largest (128: a prefill)."""
    launches = []
    original = tri._plan

    def record(batch, *args):
        plan = original(batch, *args)
        launches.append((type(batch).__name__, plan.config[0]))
        return plan

    monkeypatch.setattr(tri, "_plan", record)
    assert (
        self_check.check_triton(CPU, torch.bfloat16, num_heads=9, num_kv_heads=3, head_dim=64)
        is None
    )
    # Level 1: 9 rows x 3 heads; level 2: 42 prefill rows x 3; own; own decode: 1 row x 3.
    assert launches == [
        ("PrefixBatch", 32),
        ("PrefixBatch", 128),
        ("OwnBatch", 128),
        ("OwnBatch", 16),
    ]


def test_real_kernels_pass_with_key_splits(monkeypatch):
    """As on a GPU, where decode rows on the long level-1 segment leave most SMs idle."""
    monkeypatch.setattr(tri, "_target_programs", lambda device: 64)
    plans = []
    original = tri._prefix_plan

    def record(*args):
        plans.append(original(*args))
        return plans[-1]

    monkeypatch.setattr(tri, "_prefix_plan", record)
    assert self_check.check_triton(CPU, torch.float16) is None
    assert [plan.num_splits for plan in plans] == [2, 1]  # level 1 split, level 2 not


def test_interpreter_missing_is_a_reason_not_an_error():
    """Compiled Triton on CPU tensors (no TRITON_INTERPRET): the launcher's refusal."""
    script = (
        "import torch\n"
        "from llm_operator.kernels.self_check import check_triton\n"
        "print(check_triton('cpu', torch.float32))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("store_kv raised RuntimeError: the Triton kernels got CPU tensors")


# ---------------------------------------------------------------- broken kernels


@pytest.fixture
def reference_kernels(monkeypatch):
    """triton_attention's four operations replaced by the reference (tests break one)."""
    for name in ("store_kv", "own_attention", "prefix_attention", "merge_attention_states"):
        monkeypatch.setattr(tri, name, getattr(torch_attention, name))
    return monkeypatch


def test_reference_as_kernels_passes(reference_kernels):
    assert self_check.check_triton(CPU, torch.float32) is None
    assert self_check.check_triton(CPU, torch.float16, num_heads=8, num_kv_heads=1) is None


def test_prefix_attention_returning_zeros_is_named(reference_kernels):
    def zeros(q, k_cache, v_cache, batch, scale):
        rows, heads = q.shape[:2]
        return layout.AttentionOutput(torch.zeros_like(q), torch.zeros(rows, heads))

    reference_kernels.setattr(tri, "prefix_attention", zeros)
    reason = self_check.check_triton(CPU, torch.float32)
    assert reason is not None and reason.startswith("prefix_attention (level 1): out max error")
    assert "\n" not in reason


def test_small_lse_error_is_caught_and_measured(reference_kernels):
    """1e-4 off in lse (5x the tolerance) on the second level only."""

    def shifted(q, k_cache, v_cache, batch, scale):
        out, lse = torch_attention.prefix_attention(q, k_cache, v_cache, batch, scale)
        return layout.AttentionOutput(out, lse + (1e-4 if len(batch.host_lengths) == 2 else 0))

    reference_kernels.setattr(tri, "prefix_attention", shifted)
    reason = self_check.check_triton(CPU, torch.float32)
    assert reason is not None and reason.startswith("prefix_attention (level 2): lse max error")
    match = re.search(r"max error (\S+) .* at (\d+) of (\d+) values", reason)
    assert match, reason
    assert float(match[1]) == pytest.approx(1e-4, rel=1e-3)
    # fp32, head_dim 32: 64-row tiles, so the prefill has 64 / 2 = 32 rows, 41 in all. Level
    # 2 is read by request 0's row and the prefill's: their 4 heads are off, -inf stays.
    assert (int(match[2]), int(match[3])) == ((1 + 32) * 4, 41 * 4)


def test_nan_from_own_attention_is_named(reference_kernels):
    def nan_row(q, k_cache, v_cache, batch, scale):
        out, lse = torch_attention.own_attention(q, k_cache, v_cache, batch, scale)
        out[5, 1, 3] = float("nan")
        return layout.AttentionOutput(out, lse)

    reference_kernels.setattr(tri, "own_attention", nan_row)
    reason = self_check.check_triton(CPU, torch.float16)
    # fp16, head_dim 32: 128-row tiles, a 64-row prefill; out is 73 rows x 4 heads x 32.
    assert reason == (
        "own_attention: out max error nan (atol 0.002, rtol 0.002) at 1 of 9344 values"
    )


def test_merge_error_is_blamed_on_merge(reference_kernels):
    def off(parts):
        out, lse = torch_attention.merge_attention_states(parts)
        return layout.AttentionOutput(out + 0.5, lse)

    reference_kernels.setattr(tri, "merge_attention_states", off)
    reason = self_check.check_triton(CPU, torch.bfloat16)
    assert reason is not None and reason.startswith("merge_attention_states: out max error 0.5")
    assert float(re.search(r"max error (\S+)", reason)[1]) == pytest.approx(0.5, abs=0.01)


def test_store_kv_writing_nothing_is_named(reference_kernels):
    reference_kernels.setattr(tri, "store_kv", lambda *args: None)
    reason = self_check.check_triton(CPU, torch.float32)
    # Requests 0 and 1's 9 new tokens x 2 KV heads x head_dim 32 stay NaN, in a cache of
    # 41 used blocks (33 + 1 + 2 segment blocks, 1 + 2 + 2 own) + 2 spare, of 16 slots.
    assert reason == "store_kv: k_cache differs from the reference's at 576 of 44032 values"


def test_exceptions_become_one_line_reasons(reference_kernels):
    def compile_error(*args):
        raise RuntimeError("at 12:4:\n    acc = tl.dot(p, v)\n    ^\nincompatible types")

    reference_kernels.setattr(tri, "own_attention", compile_error)
    reason = self_check.check_triton(CPU, torch.float32)
    assert reason == (
        "own_attention raised RuntimeError: at 12:4: acc = tl.dot(p, v) ^ incompatible types"
    )


def test_missing_triton_is_a_reason(monkeypatch):
    """triton not installed: importing the kernels fails inside the check."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises
    monkeypatch.delitem(sys.modules, "llm_operator.kernels.triton_attention")
    monkeypatch.delattr(kernels, "triton_attention")
    reason = self_check.check_triton(CPU, torch.float32)
    assert reason == (
        "import triton_attention raised ModuleNotFoundError: import of triton halted; "
        "None in sys.modules"
    )


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="dtype"):
        self_check.check_triton(CPU, torch.int32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        self_check.check_triton(CPU, torch.float32, num_heads=6, num_kv_heads=4)


# ---------------------------------------------------------------- the decision point

FAILURE = "prefix_attention (level 1): out max error 0.7 (atol 1e-05, rtol 1e-05) at 9 of 9"


class RecordingCheck:
    """Stands in for check_triton: records its calls and returns ``reason``."""

    def __init__(self, reason: str | None) -> None:
        self.reason = reason
        self.calls: list[tuple] = []

    def __call__(self, device, dtype, **heads) -> str | None:
        self.calls.append((device, dtype, heads))
        return self.reason


@pytest.fixture
def registry(monkeypatch) -> RecordingCheck:
    """check_triton replaced by a RecordingCheck returning FAILURE, with the factory's
    once-per-process memo of the checks emptied."""
    from llm_operator.engine import factory

    fake = RecordingCheck(FAILURE)
    monkeypatch.setattr(self_check, "check_triton", fake)
    factory._triton_failure.cache_clear()
    factory._triton_fused_failure.cache_clear()
    yield fake
    factory._triton_failure.cache_clear()
    factory._triton_fused_failure.cache_clear()


def paths_for(model_dir, device: str, **options):
    """``factory.native_paths`` for the model in ``model_dir`` on ``device`` (a meta device
    stands in for CUDA: the decision needs the device's type, not the device)."""
    from llm_operator.config import EngineConfig
    from llm_operator.engine import factory
    from llm_operator.models.llama import LlamaModel

    model = LlamaModel.from_pretrained(model_dir, device=CPU, dtype=torch.float32)
    return factory.native_paths(EngineConfig(**options), model, torch.device(device), torch.float32)


def test_failed_check_takes_the_torch_kernels_and_warns_once(registry, tiny_qwen3_dir):
    """On CUDA "auto" picks Triton after its self-check, with the model's heads (qwen3:
    head_dim 32, not hidden / heads = 16); a failure takes the torch kernels, eager
    regions and no graphs, after one warning, and the check is not run again."""
    with pytest.warns(RuntimeWarning) as record:
        paths = paths_for(tiny_qwen3_dir, "cuda")
    assert len(record) == 1
    message = str(record[0].message)
    assert "failed their self-check on cuda (float32)" in message and FAILURE in message
    assert (paths.attention, paths.elementwise, paths.graphs) == ("torch", "eager", "off")
    assert FAILURE in paths.describe()
    assert registry.calls == [
        (torch.device("cuda"), torch.float32,
         {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "windowed": False})
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any further warning fails the test
        assert paths_for(tiny_qwen3_dir, "cuda").attention == "torch"
    assert len(registry.calls) == 1  # checked once


def test_passing_check_keeps_triton_and_graphs_on_cuda(registry, monkeypatch, tiny_qwen3_dir):
    registry.reason = None
    monkeypatch.setattr(self_check, "check_triton_fused", lambda *args, **sizes: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = paths_for(tiny_qwen3_dir, "cuda")
    assert (paths.attention, paths.elementwise, paths.graphs) == ("triton", "triton", "capture")
    assert paths.overlap and paths.fused_store and not paths.invariant
    assert (paths.forward, paths.gemm) == ("eager", "aten")


def test_explicit_kernels_are_checked_and_raise_instead_of_falling_back(registry, tiny_qwen3_dir):
    with pytest.raises(RuntimeError, match="kernels='triton' but the kernels failed: prefix"):
        paths_for(tiny_qwen3_dir, "cuda", kernels="triton")
    paths = paths_for(tiny_qwen3_dir, "cuda", kernels="torch")
    assert (paths.attention, paths.fallbacks) == ("torch", ())
    with pytest.raises(ValueError, match="kernels='cpp' runs fp32 and bf16 on the CPU"):
        paths_for(tiny_qwen3_dir, "cuda", kernels="cpp")
    with pytest.raises(ValueError, match="cuda_graphs='on': it needs the Triton kernels"):
        paths_for(tiny_qwen3_dir, "cpu", kernels="torch", cuda_graphs="on")


def test_cpu_devices_take_the_compiled_kernels_without_a_triton_check(registry, tiny_qwen3_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = paths_for(tiny_qwen3_dir, "cpu")
    assert registry.calls == []
    assert (paths.attention, paths.forward, paths.gemm) == ("cpp", "compiled", "packed")
    assert (paths.graphs, paths.overlap, paths.fallbacks) == ("off", False, ())


def test_real_check_in_the_interpreter(tiny_qwen3_dir):
    from llm_operator.engine import factory

    factory._triton_failure.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = paths_for(tiny_qwen3_dir, "cpu", kernels="triton")
    assert (paths.attention, paths.elementwise, paths.graphs) == ("triton", "triton", "off")


def test_native_engine_falls_back_when_the_compiled_kernels_fail(monkeypatch, tiny_qwen3_dir):
    """A CPU whose compiled kernels cannot load (no compiler, a failed self-check) runs
    the torch kernels after one warning, and every row completes; kernels="cpp" refuses."""
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "load", lambda: None)
    monkeypatch.setattr(cpu_extension, "failure", lambda: "no C++ compiler")
    op = LLMOperator(tiny_qwen3_dir, backend="native", device="cpu")
    prompts = ["Summarize the review in one sentence.", "Summarize the review: great value."]
    results = op.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [r.error for r in results] == [None, None]
    assert all(r.completion_tokens > 0 for r in results)
    paths = op.backend().paths
    assert (paths.attention, paths.forward) == ("torch", "eager")
    assert "compiled CPU kernels unavailable: no C++ compiler" in paths.describe()
    with pytest.raises(RuntimeError, match="kernels='cpp' but the compiled CPU kernels"):
        LLMOperator(tiny_qwen3_dir, backend="native", kernels="cpp").generate(prompts)


# ---------------------------------------------------------------- the elementwise kernels

SMOLLM2 = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576,
           "intermediate_size": 1536}  # fmt: skip


def test_fused_tolerances_are_the_triton_fused_tests_tolerances():
    import test_triton_fused

    assert self_check.FP32_ULPS == test_triton_fused.FP32_ULPS
    assert self_check.MAX_FLIP_ULPS == test_triton_fused.MAX_FLIP_ULPS
    assert self_check.MAX_FLIP_FRACTION == test_triton_fused.MAX_FLIP_FRACTION
    assert self_check.QK_NORM_FP32_TOLERANCE == test_triton_fused.QK_NORM_FP32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", [{}, SMOLLM2], ids=["tiny", "smollm2"])
def test_real_fused_kernels_pass_in_the_interpreter(dtype, sizes, monkeypatch):
    """Every launcher, on a decode step and a batch of several programs, against the eager
    regions."""
    from llm_operator.kernels import triton_fused as tf

    calls = []
    for name in ("rms_norm", "add_rms_norm", "qkv_rope", "qkv_rope_store", "silu_mul"):
        function = getattr(tf, name)
        monkeypatch.setattr(tf, name, lambda *a, f=function, n=name: calls.append(n) or f(*a))
    assert self_check.check_triton_fused(CPU, dtype, EAGER_OPS, **sizes) is None
    assert calls == ["rms_norm"] * 2 + ["add_rms_norm"] * 2 + ["qkv_rope"] * 4 + [
        "qkv_rope_store"
    ] * 2 + ["silu_mul"] * 2  # fmt: skip


def _broken(monkeypatch, name, replacement, dtype=torch.bfloat16) -> str | None:
    from llm_operator.kernels import triton_fused as tf

    monkeypatch.setattr(tf, name, replacement)
    return self_check.check_triton_fused(CPU, dtype, EAGER_OPS)


def test_fused_kernels_that_disagree_are_named(monkeypatch):
    from llm_operator.kernels import triton_fused as tf
    from llm_operator.models import fused

    silu_mul = tf.silu_mul
    reason = _broken(
        monkeypatch, "silu_mul", lambda g: (silu_mul(g).view(torch.int16) + 1).view(g.dtype)
    )
    # 1 + 19 tokens x 128: every value one ulp off, past the 1% of rare flips.
    assert reason == (
        "silu_mul: activated differs from the reference's at 2560 of 2560 values "
        "(at most 1%, each at most 2 ulp)"
    )
    monkeypatch.undo()

    qkv_rope = tf.qkv_rope

    def unnormed_k(qkv, cos, sin, q_norm, k_norm, eps, *heads):
        q, _, v = qkv_rope(qkv, cos, sin, q_norm, k_norm, eps, *heads)
        return q, fused.qkv_rope(qkv, cos, sin, None, None, eps, *heads)[1], v

    reason = _broken(monkeypatch, "qkv_rope", unnormed_k)
    assert reason is not None and reason.startswith("qkv_rope (q/k norm): k normed is "), reason
    reason = _broken(monkeypatch, "qkv_rope", unnormed_k, torch.float32)
    assert reason is not None and reason.startswith("qkv_rope (q/k norm): k normed max error")
    assert "(atol 1e-05, rtol 1e-05)" in reason, reason


def test_a_store_that_writes_nothing_is_named(monkeypatch):
    from llm_operator.kernels import triton_fused as tf

    reason = _broken(monkeypatch, "qkv_rope_store", lambda *args: tf.qkv_rope(*args[:9]))
    # The decode token's and 18 of the 19 batch tokens' slots (one is -1), x 2 kv heads x 32,
    # stay NaN in caches of 3 and 7 blocks of 4 slots.
    assert reason == "qkv_rope_store: k_cache differs from the reference's at 1216 of 2560 values"


def test_fused_exceptions_become_reasons_and_bad_arguments_raise(monkeypatch):
    def compile_error(*args):
        raise RuntimeError("at 3:4:\n    x = tl.load(p)\nPTX assembly failed")

    assert _broken(monkeypatch, "rms_norm", compile_error) == (
        "rms_norm raised RuntimeError: at 3:4: x = tl.load(p) PTX assembly failed"
    )
    with pytest.raises(ValueError, match="dtype"):
        self_check.check_triton_fused(CPU, torch.int32, EAGER_OPS)
    with pytest.raises(ValueError, match="head_dim must be even"):
        self_check.check_triton_fused(CPU, torch.float32, EAGER_OPS, head_dim=15)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        self_check.check_triton_fused(CPU, torch.float32, EAGER_OPS, hidden_size=0)


def test_windowed_check_runs_the_window_kernels():
    """``windowed=True`` (a model with sliding-window layers) also checks the kernels under
    a window: the real ones pass, and an own_attention that ignores the window is named."""
    assert self_check.check_triton(CPU, torch.float32, windowed=True) is None


def test_windowed_check_names_a_kernel_ignoring_the_window(reference_kernels):
    def windowless(q, k_cache, v_cache, batch, scale):
        import dataclasses

        return torch_attention.own_attention(
            q, k_cache, v_cache, dataclasses.replace(batch, window=0, derived={}), scale
        )

    reference_kernels.setattr(tri, "own_attention", windowless)
    assert self_check.check_triton(CPU, torch.float32) is None  # no window, no difference
    reason = self_check.check_triton(CPU, torch.float32, windowed=True)
    assert reason is not None and reason.startswith("own_attention (window 20)"), reason
