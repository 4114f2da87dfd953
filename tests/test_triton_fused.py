"""The Triton elementwise kernels (llm_operator.kernels.triton_fused) against the torch
references (llm_operator.models.fused), run by the Triton interpreter on CPU tensors
(conftest sets TRITON_INTERPRET=1 before anything imports triton); small shapes. The last
test compiles them for sm_90 without a GPU. TritonOps and the engine: test_triton_ops.py.

What is exact and why (the kernels compute in fp32 and round each op to the dtype as eager
does; the interpreter runs numpy's fp32 ops):
- the residual add, the q/k/v split, RoPE without a q/k norm and the K/V store: bitwise
  in fp32, fp16 and bf16 (no reduction, no transcendental: the same IEEE ops);
- RMSNorm (and Qwen3's q/k norm): the fp32 sum of squares runs in another order than
  eager's, so fp32 agrees to a few ulp (RoPE after the norm can cancel: an absolute bound
  there) and fp16/bf16 are bitwise but for rare flips of one or two ulp;
- SiLU: numpy's ``exp`` and torch's differ by an ulp: fp32 within a few ulp, fp16/bf16
  with rare flips.
bf16 is tested too: the kernels round to bf16 by the bits (nearest even), so the
interpreter's truncating bf16 cast never rounds a value that is not already a bf16.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from helpers import compile_for_sm90  # noqa: E402
from torch import Tensor  # noqa: E402

from llm_operator.kernels import torch_attention, triton_attention  # noqa: E402
from llm_operator.kernels import triton_fused as tf  # noqa: E402
from llm_operator.models import fused  # noqa: E402

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
FP32_ULPS = 4  # RMSNorm's sum order, exp's implementation: measured at most 3 and 4
MAX_FLIP_ULPS, MAX_FLIP_FRACTION = 2, 0.01  # fp16/bf16 flips: how far, how many
QK_NORM_FP32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}  # RoPE after the q/k norm can cancel


def randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=generator)


def ordered(x: Tensor) -> Tensor:
    """Float bits as integers that step by one between adjacent values of x's dtype."""
    bits = x.view({4: torch.int32, 2: torch.int16}[x.element_size()]).long()
    sign = {4: 1 << 31, 2: 1 << 15}[x.element_size()]
    return torch.where(bits < 0, -(bits + sign), bits)


def assert_ulps(got: Tensor, want: Tensor, max_ulps: int, name: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, name
    ulps = int((ordered(got) - ordered(want)).abs().max()) if got.numel() else 0
    assert ulps <= max_ulps, f"{name}: {ulps} ulp apart (at most {max_ulps})"


def assert_rare_flips(
    got: Tensor, want: Tensor, name: str, max_fraction: float = MAX_FLIP_FRACTION
) -> None:
    """Bitwise equal but for at most ``max_fraction`` of the elements, each at most two
    ulp of the dtype away (an fp32 last bit crossing a rounding boundary: one ulp, which a
    weight's product can widen to two), same sign."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    flipped = got != want
    if not bool(flipped.any()):
        return
    steps = (ordered(got) - ordered(want))[flipped].abs()
    assert int(steps.max()) <= MAX_FLIP_ULPS, f"{name}: {int(steps.max())} ulp apart"
    fraction = flipped.float().mean().item()
    assert fraction <= max_fraction, f"{name}: {fraction:.2%} of the elements differ"


def assert_matches(got: Tensor, want: Tensor, name: str, exact: bool = False) -> None:
    """``exact``: bitwise; else fp32 within FP32_ULPS, fp16/bf16 rare flips."""
    assert got.is_contiguous(), f"{name} is not contiguous"
    if exact:
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max()}"
    elif got.dtype == torch.float32:
        assert_ulps(got, want, FP32_ULPS, name)
    else:
        assert_rare_flips(got, want, name)


# ---------------------------------------------------------------- RMSNorm, residual add


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("tokens", "size"), [(1, 64), (7, 40)], ids=["decode-64", "rows-40"])
def test_norms_match_reference(dtype, tokens, size):
    generator = torch.Generator().manual_seed(tokens + size)
    hidden = randn(generator, tokens, size, scale=3.0).to(dtype)
    delta = randn(generator, tokens, size).to(dtype)
    weight = randn(generator, size).to(dtype)
    total, normed = tf.add_rms_norm(hidden, delta, weight, EPS)
    want_total, want_normed = fused.add_rms_norm(hidden, delta, weight, EPS)
    assert_matches(total, want_total, "hidden + delta", exact=True)
    assert_matches(normed, want_normed, "add_rms_norm")
    assert_matches(tf.rms_norm(hidden, weight, EPS), fused.rms_norm(hidden, weight, EPS), "norm")


def test_norm_of_row_strided_input_and_zero_tokens():
    generator = torch.Generator().manual_seed(3)
    wide = randn(generator, 5, 96)
    hidden, weight = wide[:, 16:80], randn(generator, 64)  # rows 96 apart
    assert_matches(tf.rms_norm(hidden, weight, EPS), fused.rms_norm(hidden, weight, EPS), "norm")
    total, normed = tf.add_rms_norm(hidden[:0], hidden[:0], weight, EPS)
    assert total.shape == normed.shape == (0, 64)


# ---------------------------------------------------------------- QKV split, q/k norm, RoPE

ROPE_SHAPES = [(4, 2, 16), (3, 1, 24)]  # (heads, kv_heads, head_dim): GQA; odd counts


def rope_inputs(tokens: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0):
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(seed)
    qkv = randn(generator, tokens, (num_heads + 2 * num_kv_heads) * head_dim, scale=2.0)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.3
    angles = torch.cat([angles, angles], dim=-1)  # as RotaryEmbedding builds them
    norms = randn(generator, head_dim).to(dtype), randn(generator, head_dim).to(dtype)
    return qkv.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype), norms


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", ROPE_SHAPES, ids=["gqa-16", "odd-24"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm-rope"])
def test_qkv_rope_matches_reference(dtype, heads, qk_norm):
    """Without q/k norm bitwise in every dtype; with it (Qwen3) fp32 within an absolute
    bound (x * cos + rotate_half(x) * sin can cancel: an ulp of the terms, not of the sum)."""
    qkv, cos, sin, norms = rope_inputs(5, heads, dtype)
    norms = norms if qk_norm else (None, None)
    got = tf.qkv_rope(qkv, cos, sin, *norms, EPS, *heads)
    want = fused.qkv_rope(qkv, cos, sin, *norms, EPS, *heads)
    for name, got_part, want_part in zip("qkv", got, want, strict=True):
        if name == "v" or not qk_norm or dtype != torch.float32:
            assert_matches(got_part, want_part, name, exact=not qk_norm or name == "v")
        else:
            assert got_part.is_contiguous()
            torch.testing.assert_close(got_part, want_part, **QK_NORM_FP32_TOLERANCE, msg=name)


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype):
    return (
        torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype) for _ in "kv"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_qkv_rope_store_writes_what_store_kv_writes(dtype, slot_dtype):
    """One launch: the q/k/v of qkv_rope, and the cache exactly as store_kv leaves it;
    slots -1 and past the cache are skipped."""
    heads = (4, 2, 16)
    qkv, cos, sin, norms = rope_inputs(6, heads, dtype, seed=1)
    slots = torch.tensor([5, -1, 0, 11, 12, 3], dtype=slot_dtype)  # 3 blocks of 4: 12 slots
    k_cache, v_cache = make_cache(3, 4, 2, 16, dtype)
    got = tf.qkv_rope_store(qkv, cos, sin, *norms, EPS, *heads, k_cache, v_cache, slots)
    q, k, v = tf.qkv_rope(qkv, cos, sin, *norms, EPS, *heads)
    for name, got_part, want_part in zip("qkv", got, (q, k, v), strict=True):
        assert torch.equal(got_part, want_part), name
    want_k, want_v = make_cache(3, 4, 2, 16, dtype)
    triton_attention.store_kv(want_k, want_v, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    kept = torch.tensor([0, 2, 3, 5])  # the torch reference, given only the slots in range
    reference_k, reference_v = make_cache(3, 4, 2, 16, dtype)
    torch_attention.store_kv(reference_k, reference_v, k[kept], v[kept], slots[kept])
    assert torch.equal(k_cache, reference_k) and torch.equal(v_cache, reference_v)
    assert int((k_cache != 7.0).any(-1).any(-1).sum()) == 4, "exactly four slots written"


# ---------------------------------------------------------------- SiLU * up


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("intermediate", [128, 40])
def test_silu_mul_matches_reference(dtype, intermediate):
    generator = torch.Generator().manual_seed(intermediate)
    gate_up = randn(generator, 6, 2 * intermediate, scale=4.0).to(dtype)
    assert_matches(tf.silu_mul(gate_up), fused.silu_mul(gate_up), "silu_mul")
    strided = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * intermediate]  # rows 4I apart
    assert torch.equal(tf.silu_mul(strided), tf.silu_mul(gate_up))


def test_many_tokens_span_several_programs():
    """37 tokens: several programs of up to 16 rows each, the last one partly masked."""
    generator = torch.Generator().manual_seed(37)
    hidden, weight = randn(generator, 37, 64).half(), randn(generator, 64).half()
    total, normed = tf.add_rms_norm(hidden, hidden, weight, EPS)
    want_total, want_normed = fused.add_rms_norm(hidden, hidden, weight, EPS)
    assert_matches(total, want_total, "hidden + delta", exact=True)
    assert_matches(normed, want_normed, "add_rms_norm")
    qkv, cos, sin, _ = rope_inputs(37, (4, 2, 16), torch.float16, seed=37)
    slots = torch.arange(37) * 2 - 1  # -1, 1, 3, ..., 71: 36 slots of 80, one skipped
    k_cache, v_cache = make_cache(20, 4, 2, 16, torch.float16)
    got = tf.qkv_rope_store(qkv, cos, sin, None, None, EPS, 4, 2, 16, k_cache, v_cache, slots)
    want = fused.qkv_rope(qkv, cos, sin, None, None, EPS, 4, 2, 16)
    for name, got_part, want_part in zip("qkv", got, want, strict=True):
        assert_matches(got_part, want_part, name, exact=True)
    want_k, want_v = make_cache(20, 4, 2, 16, torch.float16)
    torch_attention.store_kv(want_k, want_v, want[1][1:], want[2][1:], slots[1:])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    gate_up = randn(generator, 37, 256, scale=4.0).half()
    assert_matches(tf.silu_mul(gate_up), fused.silu_mul(gate_up), "silu_mul")


# ---------------------------------------------------------------- argument errors


def test_launchers_reject_bad_arguments():
    hidden, weight = torch.zeros(3, 8), torch.zeros(8)
    qkv, cos, sin, norms = rope_inputs(2, (4, 2, 16), torch.float32)
    heads = (4, 2, 16)
    k_cache, v_cache = make_cache(2, 4, 2, 16, torch.float32)
    slots = torch.tensor([0, 1])
    cases = [
        (TypeError, "x must be a torch.Tensor", lambda: tf.rms_norm(hidden.tolist(), weight, EPS)),
        (ValueError, r"x must be \[tokens, size\]", lambda: tf.rms_norm(hidden[0], weight, EPS)),
        (TypeError, "weight dtype", lambda: tf.rms_norm(hidden, weight.half(), EPS)),
        (TypeError, "float16, bfloat16 or float32", lambda: tf.rms_norm(hidden.long(), weight, EPS)),
        (ValueError, "weight has 4 elements", lambda: tf.rms_norm(hidden, weight[:4], EPS)),
        (ValueError, "hidden must have unit stride", lambda: tf.add_rms_norm(hidden.t(), hidden.t(), torch.zeros(3), EPS)),
        (ValueError, "delta shape", lambda: tf.add_rms_norm(hidden, hidden[:2], weight, EPS)),
        (ValueError, "eps must be finite", lambda: tf.rms_norm(hidden, weight, -1.0)),
        (ValueError, "at most 32768", lambda: tf.rms_norm(torch.zeros(1, 40000), torch.zeros(40000), EPS)),
        (ValueError, "qkv has rows of 128", lambda: tf.qkv_rope(qkv, cos, sin, None, None, EPS, 4, 1, 16)),
        (ValueError, "head_dim must be even", lambda: tf.qkv_rope(qkv[:, :40], cos, sin, None, None, EPS, 4, 2, 5)),
        (ValueError, "head_dim must be at most 256", lambda: tf.qkv_rope(qkv, cos, sin, None, None, EPS, 1, 1, 512)),
        (ValueError, r"cos must be \[tokens, head_dim\]", lambda: tf.qkv_rope(qkv, cos[:1], sin, None, None, EPS, *heads)),
        (TypeError, "sin dtype", lambda: tf.qkv_rope(qkv, cos, sin.half(), None, None, EPS, *heads)),
        (ValueError, "both be given", lambda: tf.qkv_rope(qkv, cos, sin, norms[0], None, EPS, *heads)),
        (ValueError, r"k_norm_weight must be \[head_dim = 16\]", lambda: tf.qkv_rope(qkv, cos, sin, norms[0], norms[1][:8], EPS, *heads)),
        (ValueError, "num_kv_heads = 2, head_dim = 16", lambda: tf.qkv_rope_store(qkv, cos, sin, None, None, EPS, *heads, k_cache[..., :8], v_cache, slots)),
        (TypeError, "int32 or int64", lambda: tf.qkv_rope_store(qkv, cos, sin, None, None, EPS, *heads, k_cache, v_cache, slots.float())),
        (ValueError, "slot_mapping has 1 slots", lambda: tf.qkv_rope_store(qkv, cos, sin, None, None, EPS, *heads, k_cache, v_cache, slots[:1])),
        (TypeError, "k_cache dtype torch.float16 != qkv dtype", lambda: tf.qkv_rope_store(qkv, cos, sin, None, None, EPS, *heads, k_cache.half(), v_cache.half(), slots)),
        (ValueError, "even, positive size", lambda: tf.silu_mul(torch.zeros(2, 7))),
        (ValueError, "gate_up must have unit stride", lambda: tf.silu_mul(torch.zeros(8, 2).t())),
    ]  # fmt: skip
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


# ---------------------------------------------------------------- GPU build

# Compiles every kernel variant for sm_90 (H100/H200) with Triton's bundled LLVM and
# ptxas, without a GPU (as test_kernels_triton does for attention): catches what the
# interpreter lets through. fp32 builds must hold no fused multiply-add outside libdevice.
COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as error:
    print(error)
    sys.exit(77)
from llm_operator.kernels import triton_fused, triton_fused_kernels as kernels

assert not triton_fused.interpreted(), "the kernels run in the interpreter"


def build(kernel, types, constexprs, warps):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or n.startswith("stride")}
    source = ASTSource(kernel, signature, attrs=attrs,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    options = dict(num_warps=warps, enable_fp_fusion=False)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


for name, dtype in (("bf16", tl.bfloat16), ("fp16", tl.float16), ("fp32", tl.float32)):
    pointer, ptx = "*" + name, []
    norm = {n: pointer for n in ("x_ptr", "delta_ptr", "weight_ptr", "out_ptr", "sum_ptr")}
    for has_delta, rows, size in ((True, 1, 2048), (False, 2, 576)):
        ptx.append(build(kernels._rms_norm_kernel, norm | {"eps": "fp32"},
                         dict(SIZE=size, HAS_DELTA=has_delta, DTYPE=dtype, ROWS=rows,
                              BLOCK=triton.next_power_of_2(size)), 8))
    rope = {n: pointer for n in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr", "k_norm_ptr",
                                 "q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    for qk_norm, store, heads, rows in ((False, False, (32, 8, 64), 1),
                                        (True, True, (9, 3, 128), 1),
                                        (True, True, (4, 2, 16), 16)):
        ptx.append(build(kernels._qkv_rope_kernel, rope | {"slot_ptr": "*i64", "eps": "fp32"},
                         dict(NUM_HEADS=heads[0], NUM_KV_HEADS=heads[1], HEAD_DIM=heads[2],
                              QK_NORM=qk_norm, STORE=store, DTYPE=dtype, ROWS=rows,
                              BLOCK_Q=triton.next_power_of_2(heads[0]),
                              BLOCK_KV=triton.next_power_of_2(heads[1]), BLOCK_D=heads[2]), 8))
    silu = build(kernels._silu_mul_kernel, {"gate_up_ptr": pointer, "out_ptr": pointer},
                 dict(SIZE=8192, DTYPE=dtype, LIBDEVICE_EXP=True, ROWS=2, BLOCK=1024), 8)
    assert "div.rn.f32" in silu and "div.full" not in silu, "SiLU must divide as IEEE"
    if dtype == tl.float32:
        assert not any("fma." in text for text in ptx), "fp fusion skipped a rounding"
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    compile_for_sm90(COMPILE_SCRIPT)
