"""The compiled CPU kernels (kernels/cpu_kernels.cpp) against their torch references.

packed_linear against F.linear; paged_attention and store_kv against the reference
operations on the same keys (reference layout in, CPU layout converted); the elementwise
regions against fused.py's eager functions (bf16 bit for bit); the decoder in one call
against the eager LlamaModel forward; the packed GEMM; the build's fallbacks (no compiler,
a failed self-check).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llm_operator import kernels
from llm_operator.kernels import cpu_extension, cpu_ops, layout, torch_attention
from llm_operator.models import fused
from llm_operator.models.gemm import ATEN_GEMM, packed_gemm

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def cpu_module():
    module = cpu_extension.load()
    assert module is not None, f"the CPU kernels did not load: {cpu_extension.failure()}"
    return module


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """Within fp32 rounding, or bf16 rounding of the output, of a reference."""
    tolerance = 2e-5 if dtype == torch.float32 else 1.6e-2
    bound = tolerance * (scale + expected.float().abs().max().item())
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= bound, f"max error {error:.3g} > {bound:.3g}"


# ---------------------------------------------------------------- packed linear


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 576, 64), (3, 30, 17), (8, 48, 40), (13, 100, 33), (40, 64, 96), (9, 7, 1)],
)
def test_packed_linear_matches_linear(cpu_module, dtype, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = cpu_ops.pack_linear_weight(cpu_module, weight)
    assert packed.dtype == dtype and packed.shape[0] == -(-out_features // 16)
    for b in (None, bias):
        out = cpu_ops.packed_linear(cpu_module, x, packed, b, out_features)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        expected = torch.nn.functional.linear(
            x.float(), weight.float(), None if b is None else b.float()
        )
        close(out, expected, dtype, scale=in_features**0.5)


def test_packed_linear_refuses_mismatched_inputs(cpu_module):
    weight = torch.randn(32, 24)
    packed = cpu_ops.pack_linear_weight(cpu_module, weight)
    with pytest.raises(ValueError, match="must be \\[rows, 24\\]"):
        cpu_ops.packed_linear(cpu_module, torch.randn(2, 23), packed, None, 32)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_ops.packed_linear(cpu_module, torch.randn(2, 24).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_ops.packed_linear(cpu_module, torch.randn(2, 24), packed, None, 40)
    with pytest.raises(TypeError, match="float16"):
        cpu_ops.pack_linear_weight(cpu_module, weight.half())


# ---------------------------------------------------------------- attention


def paged_case(dtype, block_size, generator, *, own, levels):
    """A step in the reference layout: ``own`` (context_len, rows) per request, rows in
    request order; ``levels``: per chain level, [(segment length, [requests])]. Unwritten
    slots hold NaN. Returns q, caches, own batch, prefix batches, this step's slots."""
    heads, kv_heads, dim = 6, 2, 24
    tokens = sum(n for _, n in own) + sum(length for level in levels for length, _ in level)
    num_blocks = 4 * (-(-tokens // block_size) + len(own) + 4)
    order = torch.randperm(num_blocks, generator=generator).tolist()

    def take(count: int) -> list[int]:
        return [order.pop() for _ in range(-(-count // block_size))]

    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan")).to(dtype)
    v_cache = k_cache.clone()

    def write(table: list[int], count: int) -> None:
        for i in range(count):
            slot = (table[i // block_size], i % block_size)
            k_cache[slot] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
            v_cache[slot] = torch.randn(kv_heads, dim, generator=generator).to(dtype)

    tables = [take(length) for length, _ in own]
    starts = [0]
    new_slots = []
    for table, (length, rows) in zip(tables, own):
        write(table, length)
        starts.append(starts[-1] + rows)
        new_slots += [table[i // block_size] * block_size + i % block_size
                      for i in range(length - rows, length)]  # fmt: skip
    rows_of = [list(range(starts[b], starts[b + 1])) for b in range(len(own))]
    shape = {"block_size": block_size, "num_blocks": num_blocks}
    prefixes = []
    for level in levels:
        segment_tables = [take(length) for length, _ in level]
        for table, (length, _) in zip(segment_tables, level):
            write(table, length)
        prefixes.append(
            layout.prefix_batch(
                [[r for b in readers for r in rows_of[b]] for _, readers in level],
                segment_tables,
                [length for length, _ in level],
                num_rows=starts[-1],
                **shape,
            )
        )
    q = torch.randn(starts[-1], heads, dim, generator=generator).to(dtype)
    own_batch = layout.own_batch(starts, tables, [length for length, _ in own], **shape)
    return q, k_cache, v_cache, own_batch, prefixes, torch.tensor(new_slots, dtype=torch.int64)


def reference_attention(q, k_cache, v_cache, own_batch, prefixes, scale):
    parts = [torch_attention.own_attention(q, k_cache, v_cache, own_batch, scale)]
    parts += [torch_attention.prefix_attention(q, k_cache, v_cache, p, scale) for p in prefixes]
    return torch_attention.merge_attention_states(parts).out


STEPS = {
    # (context_len, rows) per request; per level [(segment length, readers)]
    "decode": ([(7, 1), (30, 1), (1, 1), (90, 1)], [[(300, [0, 1, 2, 3])]]),
    "prefill": ([(40, 40), (17, 17)], [[(33, [0]), (5, [1])]]),
    "mixed": (
        [(12, 1), (45, 20), (64, 64), (3, 1), (20, 4)],
        [[(70, [0, 1, 2]), (9, [4])], [(0, [0]), (19, [1, 2])]],
    ),
    "no-prefix": ([(25, 3), (9, 9)], []),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 5, 1])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention_matches_reference(cpu_module, dtype, block_size, step):
    generator = torch.Generator().manual_seed(block_size * 7 + len(step))
    own, levels = STEPS[step]
    q, k_cache, v_cache, own_batch, prefixes, _ = paged_case(
        dtype, block_size, generator, own=own, levels=levels
    )
    scale = q.shape[-1] ** -0.5
    expected = reference_attention(q, k_cache, v_cache, own_batch, prefixes, scale)
    k_cpu, v_cpu = cpu_ops.to_cpu_layout(k_cache, v_cache)
    work = cpu_ops.attention_items(own_batch, prefixes)
    for split_keys in (cpu_ops.SPLIT_KEYS, 16, 3):
        out = cpu_ops.attention(cpu_module, q, k_cpu, v_cpu, work, scale, split_keys)
        assert out.shape == q.shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        close(out, expected, dtype)


def test_attention_step_stores_then_attends_in_the_cpu_layout(cpu_module):
    """AttentionStep("cpp") writes this step's K/V (store_kv) and attends over them: the
    same cache and output as the reference's store_kv and attention."""
    generator = torch.Generator().manual_seed(5)
    own, levels = STEPS["mixed"]
    q, k_cache, v_cache, own_batch, prefixes, slots = paged_case(
        torch.float32, 16, generator, own=own, levels=levels
    )
    scale = q.shape[-1] ** -0.5
    expected = reference_attention(q, k_cache, v_cache, own_batch, prefixes, scale)
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    k_new, v_new = flat_k[slots].clone(), flat_v[slots].clone()
    flat_k[slots], flat_v[slots] = 0.0, 0.0  # the step's tokens are not in the cache yet
    k_cpu, v_cpu = cpu_ops.to_cpu_layout(k_cache, v_cache)
    step = kernels.AttentionStep("cpp", own_batch, prefixes, slots)
    out = step(q, k_new, v_new, k_cpu, v_cpu, scale)
    close(out, expected, torch.float32)
    flat_k[slots], flat_v[slots] = k_new, v_new
    k_back, v_back = cpu_ops.from_cpu_layout(k_cpu, v_cpu)
    assert torch.equal(k_back.nan_to_num(), k_cache.nan_to_num())
    assert torch.equal(v_back.nan_to_num(), v_cache.nan_to_num())


def test_cpu_layout_round_trips_and_has_the_declared_shape():
    k = torch.randn(7, 16, 2, 24)
    v = torch.randn(7, 16, 2, 24)
    k_cpu, v_cpu = cpu_ops.to_cpu_layout(k, v)
    assert (tuple(k_cpu.shape), tuple(v_cpu.shape)) == cpu_ops.kv_cache_shapes(7, 16, 2, 24)
    assert kernels.kv_cache_shapes("cpp", 7, 16, 2, 24) == cpu_ops.kv_cache_shapes(7, 16, 2, 24)
    assert kernels.kv_cache_shapes("torch", 7, 16, 2, 24) == ((7, 16, 2, 24),) * 2
    k_back, v_back = cpu_ops.from_cpu_layout(k_cpu, v_cpu)
    assert torch.equal(k_back, k) and torch.equal(v_back, v)
    # slot s of head g: K at [g, s // 16, :, s % 16], V at [g, s // 16, s % 16, :]
    assert torch.equal(k_cpu[1, 3, :, 5], k[3, 5, 1]) and torch.equal(v_cpu[1, 3, 5], v[3, 5, 1])


def test_attention_refuses_a_reference_layout_cache(cpu_module):
    q = torch.randn(2, 6, 24)
    k = torch.randn(8, 16, 2, 24)
    with pytest.raises(ValueError, match="does not match"):
        cpu_ops._check_caches(q, k, k.clone())


# ---------------------------------------------------------------- elementwise regions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_regions_match_eager(cpu_module, dtype):
    """bf16: bit for bit (every rounding HF makes); fp32: within an ulp or two (sums)."""
    generator = torch.Generator().manual_seed(11)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    def check(actual, expected):
        if dtype == torch.bfloat16:
            assert torch.equal(actual, expected)
        else:
            torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)

    gate_up = randn(37, 2 * 96, scale=6.0)
    gate_up[0, :4] = torch.tensor([90.0, -90.0, 0.0, -30.0])  # exp over- and underflow
    check(cpu_module.silu_mul(gate_up), fused.silu_mul(gate_up))
    hidden, delta, weight = randn(37, 64), randn(37, 64), randn(64)
    for got, want in zip(
        cpu_module.add_rms_norm(hidden, delta, weight, 1e-5),
        fused.add_rms_norm(hidden, delta, weight, 1e-5),
    ):
        check(got, want)
    check(cpu_module.add_rms_norm(hidden, torch.empty(0, dtype=dtype), weight, 1e-5)[1],
          fused.rms_norm(hidden, weight, 1e-5))  # fmt: skip
    qkv, cos, sin = randn(37, 8 * 16), randn(37, 16), randn(37, 16)
    none = torch.empty(0, dtype=dtype)
    for q_norm, k_norm in ((None, None), (randn(16), randn(16))):
        got = cpu_module.qkv_rope(
            qkv, cos, sin, none if q_norm is None else q_norm, none if k_norm is None else k_norm,
            1e-6, 4, 2, 16,
        )  # fmt: skip
        want = fused.qkv_rope(qkv, cos, sin, q_norm, k_norm, 1e-6, 4, 2, 16)
        for g, w in zip(got, want):
            check(g, w)


# ---------------------------------------------------------------- the decoder in one call


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_decoder_matches_the_eager_forward(cpu_module, native_model_dir, dtype):
    """One mixed step (a prefill chunk after a shared segment, a decode row) through
    CompiledDecoder and through LlamaModel.forward with the reference attention."""
    from llm_operator.models.cpu_decoder import CompiledDecoder
    from llm_operator.models.llama import LlamaModel

    model = LlamaModel.from_pretrained(native_model_dir, device=torch.device("cpu"), dtype=dtype)
    assert model.pack_weights()
    decoder = CompiledDecoder(model)
    config = model.config
    block_size, num_blocks = 4, 32
    # segment: 9 tokens (blocks 0-2); request 0: 6 own tokens, all new (blocks 3-4);
    # request 1: 5 own tokens, the last one new (blocks 5-6), reads the segment too
    generator = torch.Generator().manual_seed(3)
    segment_ids = torch.randint(0, config.vocab_size, (9,), generator=generator)
    own0 = torch.randint(0, config.vocab_size, (6,), generator=generator)
    own1 = torch.randint(0, config.vocab_size, (5,), generator=generator)
    shape = {"block_size": block_size, "num_blocks": num_blocks}

    def run_eager(ids, positions, own, prefixes, slots, caches):
        step = kernels.AttentionStep("torch", own, prefixes, slots)

        def attention(layer, q, k, v):
            return step(q, k, v, *caches[layer], config.scale)

        return model(ids, positions, attention)

    def run_compiled(ids, positions, own, prefixes, slots, caches):
        step = kernels.AttentionStep("cpp", own, prefixes, slots)
        return decoder(ids, positions, step, [c[0] for c in caches], [c[1] for c in caches])

    outputs = {}
    for name, run, family in (("eager", run_eager, "torch"), ("compiled", run_compiled, "cpp")):
        k_shape, v_shape = kernels.kv_cache_shapes(
            family, num_blocks, block_size, config.num_kv_heads, config.head_dim
        )
        caches = [(torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype))
                  for _ in range(config.num_layers)]  # fmt: skip
        # step 1: the segment alone, then request 1's first 4 own tokens after it
        seg_own = layout.own_batch([0, 9], [[0, 1, 2]], [9], **shape)
        run(segment_ids, torch.arange(9), seg_own, [], torch.arange(9), caches)
        own = layout.own_batch([0, 4], [[5, 6]], [4], **shape)
        prefix = layout.prefix_batch([[0, 1, 2, 3]], [[0, 1, 2]], [9], num_rows=4, **shape)
        run(own1[:4], torch.arange(9, 13), own, [prefix], torch.tensor([20, 21, 22, 23]), caches)
        # step 2: request 0's whole prefill (6 rows) and request 1's decode row
        own = layout.own_batch([0, 6, 7], [[3, 4], [5, 6]], [6, 5], **shape)
        prefix = layout.prefix_batch([[6]], [[0, 1, 2]], [9], num_rows=7, **shape)
        ids = torch.cat([own0, own1[4:]])
        positions = torch.tensor([0, 1, 2, 3, 4, 5, 13])
        slots = torch.tensor([12, 13, 14, 15, 16, 17, 24])
        outputs[name] = run(ids, positions, own, [prefix], slots, caches)
    assert outputs["compiled"].shape == (7, config.hidden_size)
    close(outputs["compiled"], outputs["eager"], dtype, scale=4.0)


# ---------------------------------------------------------------- the packed GEMM


def test_packed_gemm_equals_linear_and_is_batch_invariant(cpu_module):
    """The engine's GEMM on the CPU: F.linear up to rounding, and a row's bits the same
    alone or among 100 (what the deterministic mode relies on); aten's is F.linear."""
    gemm = packed_gemm()
    weight, bias = torch.randn(64, 32), torch.randn(64)
    packed = cpu_ops.pack_linear_weight(cpu_module, weight)
    x = torch.randn(100, 32)
    expected = torch.nn.functional.linear(x, weight, bias)
    together = gemm(x, weight, bias, packed)
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)
    for row in (0, 7, 99):
        assert torch.equal(gemm(x[row : row + 1], weight, bias, packed), together[row : row + 1])
    assert torch.equal(ATEN_GEMM(x, weight, bias, packed), expected)
    with pytest.raises(AssertionError, match="no packed copy"):
        gemm(x, weight, bias, None)


# ---------------------------------------------------------------- fallbacks


def test_no_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    def no_compiler(name, path):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_extension, "_state", {})
    monkeypatch.setattr(cpu_extension, "library_path", lambda: tmp_path / "missing.so")
    monkeypatch.setattr(cpu_extension, "_build", no_compiler)
    with pytest.warns(RuntimeWarning, match="Ninja is required.*torch path"):
        assert cpu_extension.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert cpu_extension.load() is None
    assert "Ninja" in cpu_extension.failure()


def test_failed_self_check_falls_back(cpu_module, monkeypatch):
    """The library imports, but its self-check (in process) disagrees: one warning, and
    load() gives None for the rest of the process."""
    monkeypatch.setattr(cpu_extension, "_state", {})
    monkeypatch.setattr(cpu_ops, "self_check", lambda module: "paged_attention: max error 0.7")
    with pytest.warns(RuntimeWarning, match="disagree with the torch reference.*max error 0.7"):
        assert cpu_extension.load() is None
    assert "max error 0.7" in cpu_extension.failure()


def test_self_check_catches_a_wrong_kernel(cpu_module):
    class Wrong:
        """The real module with one operation off by a little."""

        def __getattr__(self, name):
            return getattr(cpu_module, name)

        def paged_attention(self, *args):
            return cpu_module.paged_attention(*args) * 1.001

    assert cpu_ops.self_check(cpu_module) is None
    reason = cpu_ops.self_check(Wrong())
    assert reason is not None and reason.startswith("paged_attention")


def test_silu_lanes_match_the_scalar_loop(cpu_module):
    """fp32 SiLU runs 8 lanes at a time where the CPU has AVX2 and each leftover value
    alone: a value's result must not depend on which of the two computed it."""
    generator = torch.Generator().manual_seed(5)
    gate = torch.randn(64, generator=generator) * 8.0
    gate[:6] = torch.tensor([90.0, -90.0, 0.0, -30.0, 88.6, -87.5])  # the exp's edges
    up = torch.randn(64, generator=generator)
    together = cpu_module.silu_mul(torch.cat([gate, up]).view(1, -1))  # 8 lanes at a time
    alone = torch.cat(
        [cpu_module.silu_mul(torch.stack([g, u]).view(1, 2)) for g, u in zip(gate, up)], dim=1
    )  # one value per call: the scalar loop
    assert torch.equal(together, alone)
    torch.testing.assert_close(together[0], torch.nn.functional.silu(gate) * up)
