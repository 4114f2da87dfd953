"""On a CUDA GPU: the Triton attention kernels compiled for it (not the interpreter) against
the torch reference, and the native engine against Hugging Face ``generate`` (greedy, fp32,
on the GPU, each prompt alone) with CUDA graphs on and off, at 1, 3, 17 and 64 rows.

Marked ``gpu`` and skipped without CUDA, and when ``TRITON_INTERPRET=1`` (conftest sets it
for the rest of the suite unless the environment already has it): ``make test-gpu`` runs
these with ``TRITON_INTERPRET=0``. The kernel cases are the interpreter tests' own
(``test_kernels_triton.make_case``: NaN in unwritten cache slots, shuffled blocks, junk in
table padding), moved to the GPU; the reference runs on the CPU copy, as the engine's
self-check does.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        CUDA and INTERPRETED,
        reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 (make test-gpu)",
    ),
]

pytest.importorskip("triton")

from helpers import REVIEWS  # noqa: E402
from test_kernels_torch import BATCHES  # noqa: E402
from test_kernels_triton import Case, assert_close, make_case, random_parts  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402
from llm_operator.kernels import AttentionOutput, torch_attention  # noqa: E402
from llm_operator.kernels import triton_attention as tri  # noqa: E402
from llm_operator.kernels.self_check import check_triton, check_triton_fused  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_COUNTS = [1, 3, 17, 64]


# ---------------------------------------------------------------- the kernels
def on_gpu(case: Case) -> Case:
    """The same case with every tensor (data and batch metadata) on the GPU."""

    def moved(batch):
        tensors = {
            f.name: getattr(batch, f.name).cuda()
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        }
        return dataclasses.replace(batch, **tensors, derived={})

    return Case(
        case.q.cuda(),
        case.k_cache.cuda(),
        case.v_cache.cuda(),
        moved(case.prefix),
        moved(case.own),
        case.scale,
    )


def on_cpu(output) -> AttentionOutput:
    out, lse = output
    return AttentionOutput(out.cpu(), lse.cpu())


def check_on_gpu(case: Case) -> None:
    """prefix, own and their merge: Triton on the GPU vs the reference on the CPU."""
    gpu = on_gpu(case)
    dtype = case.q.dtype
    expected = {
        "prefix": torch_attention.prefix_attention(
            case.q, case.k_cache, case.v_cache, case.prefix, case.scale
        ),
        "own": torch_attention.own_attention(
            case.q, case.k_cache, case.v_cache, case.own, case.scale
        ),
    }
    got = {
        "prefix": tri.prefix_attention(gpu.q, gpu.k_cache, gpu.v_cache, gpu.prefix, gpu.scale),
        "own": tri.own_attention(gpu.q, gpu.k_cache, gpu.v_cache, gpu.own, gpu.scale),
    }
    assert got["prefix"].out.is_cuda and got["own"].out.is_cuda
    for part in ("prefix", "own"):
        assert_close(on_cpu(got[part]), expected[part], dtype)
    merged = tri.merge_attention_states([got["prefix"], got["own"]])
    reference = torch_attention.merge_attention_states([expected["prefix"], expected["own"]])
    assert_close(on_cpu(merged), reference, dtype)
    assert not bool(merged.out.isnan().any())


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_fp32(head_dim, group):
    check_on_gpu(make_case(prefix_len=37, head_dim=head_dim, group=group, seed=head_dim + group))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(16, 64, 1), (32, 128, 4), (16, 64, 3)]
)
def test_attention_half_precision(dtype, block_size, head_dim, group):
    num_kv_heads = 3 if group == 3 else 2  # SmolLM2's 9 heads on 3 KV heads
    case = make_case(
        prefix_len=45,
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        seed=7,
    )
    check_on_gpu(case)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("prefix_len", [0, 70])
def test_attention_batch_kinds(batch, prefix_len):
    check_on_gpu(make_case(prefix_len=prefix_len, requests=BATCHES[batch], seed=prefix_len + 11))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_segment_of_decode_rows(dtype):
    """Few decode rows on a 600-key segment: the GPU splits the keys and combines."""
    check_on_gpu(make_case(prefix_len=600, requests=BATCHES["decode_only"], dtype=dtype, seed=5))


def test_segments_scattered_rows_int64():
    requests = [(1, 1)] * 6 + [(70, 30)]
    case = make_case(
        segments=[(33, [0]), (64, [1, 2, 3]), (200, list(range(6, 36)))],
        requests=requests,
        block_size=32,
        head_dim=128,
        dtype=torch.float16,
        index_dtype=torch.int64,
        seed=9,
    )
    check_on_gpu(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_given_slots(dtype):
    generator = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(6, 16, 2, 64, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 64, generator=generator).to(dtype).cuda()
    slots = torch.tensor([0, 17, 95, 40, -1], device="cuda")  # -1: not stored
    tri.store_kv(k_cache, v_cache, k, k + 1, slots)
    expected_k = torch.zeros_like(k_cache).view(-1, 2, 64)
    for index, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot] = k[index]
    assert torch.equal(k_cache.view(-1, 2, 64), expected_k)
    assert int((v_cache != 0).any(-1).any(-1).sum()) == 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_merge(dtype, num_parts):
    parts = random_parts(num_parts, dtype, seed=num_parts)
    merged = tri.merge_attention_states([(out.cuda(), lse.cuda()) for out, lse in parts])
    assert_close(on_cpu(merged), torch_attention.merge_attention_states(parts), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "windowed"),
    [(9, 3, 64, False), (24, 8, 128, False), (4, 1, 256, True)],
)
def test_self_check_passes(dtype, num_heads, num_kv_heads, head_dim, windowed):
    """The engine's start-up check, at the 135M and 3B head shapes, and Gemma 3 270M's
    with its sliding-window kernels."""
    reason = check_triton(
        "cuda", dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        windowed=windowed,
    )  # fmt: skip
    assert reason is None, reason


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sizes",
    [(9, 3, 64, 576, 1536), (24, 8, 128, 3072, 8192)],
    ids=["smollm2-135m", "llama-3b"],
)
def test_fused_self_check_passes(dtype, sizes):
    """The engine's start-up check of the elementwise kernels (against eager on the GPU),
    at the 135M and 3B sizes."""
    from llm_operator.models.fused import EAGER_OPS

    names = ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size")
    reason = check_triton_fused("cuda", dtype, EAGER_OPS, **dict(zip(names, sizes)))
    assert reason is None, reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_merges_levels_in_place(dtype):
    """The engine's attention call (own part, then each segment level merged into one
    state in place) on the GPU against the reference's parts merged on the CPU."""
    case = make_case(
        segments=[(5, [1, 2]), (0, [3]), (230, [0, 4, 6, 7, 8, 9, 10, 11])],
        requests=[(3, 1)] * 7 + [(20, 5)],
        dtype=dtype,
        seed=31,
    )
    gpu = on_gpu(case)
    out = tri.attend(gpu.q, gpu.k_cache, gpu.v_cache, gpu.own, [gpu.prefix], case.scale)
    args = (case.q, case.k_cache, case.v_cache)
    expected = torch_attention.merge_attention_states(
        [
            torch_attention.own_attention(*args, case.own, case.scale),
            torch_attention.prefix_attention(*args, case.prefix, case.scale),
        ]
    )
    assert_close(on_cpu((out, expected.lse.cuda())), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_elementwise_kernels(dtype):
    """The fused Triton kernels compiled for the GPU against the eager references on the
    CPU (the interpreter tests' tolerances: tests/test_triton_fused.py)."""
    from test_triton_fused import assert_matches, rope_inputs

    from llm_operator.kernels import triton_fused as tf
    from llm_operator.models import fused

    generator = torch.Generator().manual_seed(5)
    hidden = (3 * torch.randn(9, 576, generator=generator)).to(dtype)
    delta = torch.randn(9, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    total, normed = tf.add_rms_norm(hidden.cuda(), delta.cuda(), weight.cuda(), 1e-5)
    want_total, want_normed = fused.add_rms_norm(hidden, delta, weight, 1e-5)
    assert_matches(total.cpu(), want_total, "hidden + delta", exact=True)
    assert_matches(normed.cpu(), want_normed, "add_rms_norm")
    gate_up = torch.randn(9, 2 * 1536, generator=generator).to(dtype)
    assert_matches(tf.silu_mul(gate_up.cuda()).cpu(), fused.silu_mul(gate_up), "silu_mul")
    heads = (9, 3, 64)
    qkv, cos, sin, _norms = rope_inputs(9, heads, dtype)
    got = tf.qkv_rope(qkv.cuda(), cos.cuda(), sin.cuda(), None, None, 1e-5, *heads)
    want = fused.qkv_rope(qkv, cos, sin, None, None, 1e-5, *heads)
    for name, got_part, want_part in zip("qkv", got, want, strict=True):
        assert_matches(got_part.cpu(), want_part, name, exact=True)


# ---------------------------------------------------------------- the engine against HF
def bucket_prompts(rows: int) -> tuple[list[str], list[int]]:
    """``rows`` prompts in two groups sharing an instruction, then a review each (a second
    level of sharing where reviews repeat); rows end after 3 to 8 tokens, so the decode
    batch shrinks through the row buckets."""
    instructions = (
        "Classify the sentiment of the review as positive, negative or neutral.\nReview: ",
        "Extract the product name and the main complaint from the review.\nReview: ",
    )
    prompts = [
        f"{instructions[row % 2]}{REVIEWS[row % len(REVIEWS)]} (row {row})\nAnswer:"
        for row in range(rows)
    ]
    return prompts, [3 + row % 6 for row in range(rows)]


@pytest.fixture(scope="module")
def hf_on_gpu(tiny_llama_dir):
    """(tokenizer, HF generate on one prompt on the GPU, fp32, greedy, EOS ignored)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, local_files_only=True
    ).cuda()
    model.eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # never stop: every row decodes exactly its max tokens
    config.do_sample = False

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        input_ids = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        return output[0, len(ids) :].tolist()

    return AutoTokenizer.from_pretrained(tiny_llama_dir), generate


@pytest.fixture(scope="module", params=["on", "off"])
def native_on_gpu(request, tiny_llama_dir):
    """One native operator per cuda_graphs mode, kept across the row counts."""
    return LLMOperator(
        tiny_llama_dir, backend="native", device="cuda", dtype="float32", cuda_graphs=request.param
    )


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_native_matches_hf_generate_in_fp32(native_on_gpu, hf_on_gpu, rows):
    tokenizer, generate = hf_on_gpu
    prompts, max_tokens = bucket_prompts(rows)
    sampling = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    results = native_on_gpu.generate(prompts, sampling)
    assert [r.finish_reason for r in results] == ["length"] * rows
    for prompt, limit, result in zip(prompts, max_tokens, results):
        ids = tokenizer(prompt)["input_ids"]
        assert list(result.token_ids) == generate(ids, limit), prompt
    # the run stayed on the Triton kernels (no fallback to the torch reference)
    paths = native_on_gpu.backend().paths
    assert (paths.attention, paths.elementwise, paths.fallbacks) == ("triton", "triton", ())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_native_runs_in_half_precision(tiny_llama_dir, dtype):
    """No exactness in half precision, but every row gets its tokens, graphs on and off."""
    prompts, max_tokens = bucket_prompts(17)
    sampling = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    for mode in ("on", "off"):
        op = LLMOperator(
            tiny_llama_dir, backend="native", device="cuda", dtype=dtype, cuda_graphs=mode
        )
        results = op.generate(prompts, sampling)
        assert [len(r.token_ids) for r in results] == max_tokens, mode
