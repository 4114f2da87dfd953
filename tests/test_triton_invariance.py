"""Batch invariance of the Triton attention (``AttentionStep("triton", invariant=True)``,
``triton_attention.attend_invariant``), under the Triton interpreter in fp32.

One target sequence's keys sit behind many layouts (alone, beside others, under one or
two shared levels, as the last row of a prefill chunk, beside 63 decode rows, as
tests/test_batch_invariance.py puts them for the compiled CPU kernel); the target row's
output must have the same bits in every one. The default Triton mode (key tiles sized by
the batch, shared levels merged by log-sum-exp) is shown to differ on the same layouts, so
the comparison can fail. The compiled kernels (a GPU) never run here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from helpers import PagedLayout, compile_for_sm90  # noqa: E402

from llm_operator.kernels import AttentionStep, layout, torch_attention  # noqa: E402
from llm_operator.kernels import triton_attention as tri  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 32
LENGTH = 150  # the target sequence: its query row sits at position 149
# The interpreter's numpy arithmetic warns on the garbage of masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


class Layout(PagedLayout):
    """``PagedLayout`` with this module's heads, blocks in a random order seeded by ``seed``;
    ``batches`` lays it out for the kernels."""

    def __init__(self, block_size: int, seed: int):
        super().__init__(block_size, KV_HEADS, DIM, torch.Generator().manual_seed(seed))

    def batches(self, window: int = 0):
        """(q, own, prefixes) of the layout; ``window``: sliding-window batches that keep
        every row in every segment of its chain (``windowed(drop=False)``)."""
        starts = [0]
        for *_, queries in self.requests:
            starts.append(starts[-1] + len(queries))
        shape = {"block_size": self.block_size, "num_blocks": self.k.shape[0]}
        own = layout.own_batch(
            starts, [r[1] for r in self.requests], [r[2] for r in self.requests], **shape
        )
        prefixes, segment_starts = [], []
        prefix_len = [0] * len(self.requests)  # shared keys in front of each request's own
        for level in sorted({s[2] for s in self.segments}):
            ids = [i for i, s in enumerate(self.segments) if s[2] == level]
            readers = [
                [row for r, request in enumerate(self.requests) if i in request[0]
                 for row in range(starts[r], starts[r + 1])]
                for i in ids
            ]  # fmt: skip
            begins = []
            for i in ids:
                reader = next(r for r, request in enumerate(self.requests) if i in request[0])
                begins.append(prefix_len[reader])
            for r, request in enumerate(self.requests):
                prefix_len[r] += sum(self.segments[i][1] for i in ids if i in request[0])
            segment_starts.append(begins)
            prefixes.append(
                layout.prefix_batch(
                    readers,
                    [self.segments[i][0] for i in ids],
                    [self.segments[i][1] for i in ids],
                    num_rows=starts[-1],
                    **shape,
                )
            )
        q = torch.cat([r[3] for r in self.requests])
        if window:
            positions = [
                prefix_len[r] + request[2] - len(request[3]) + j
                for r, request in enumerate(self.requests)
                for j in range(len(request[3]))
            ]
            own, prefixes = layout.windowed(
                own, prefixes, positions, segment_starts, window, drop=False
            )
        return q, own, prefixes

    def run(self, invariant: bool, window: int = 0) -> torch.Tensor:
        q, own, prefixes = self.batches(window)
        step = AttentionStep(
            "triton", own, prefixes, torch.empty(0, dtype=torch.int64), invariant=invariant
        )
        return step.attend(q, self.k, self.v, DIM**-0.5)

    def reference(self, window: int = 0) -> torch.Tensor:
        q, own, prefixes = self.batches(window)
        scale = DIM**-0.5
        parts = [torch_attention.own_attention(q, self.k, self.v, own, scale)]
        parts += [torch_attention.prefix_attention(q, self.k, self.v, p, scale) for p in prefixes]
        return torch_attention.merge_attention_states(parts).out


def _sequence(generator, length):
    return (
        torch.randn(length, KV_HEADS, DIM, generator=generator),
        torch.randn(length, KV_HEADS, DIM, generator=generator),
        torch.randn(length, HEADS, DIM, generator=generator),
    )


def _layouts(block_size: int, seed: int, decode_rows: int = 63):
    """(name, layout, row of the target's query at position 149) for one target sequence
    of 150 tokens behind many layouts (tests/test_batch_invariance.py's, smaller heads)."""
    keys, values, queries = _sequence(torch.Generator().manual_seed(seed), LENGTH)
    noise = torch.Generator().manual_seed(seed + 1)
    b = block_size

    def other(n_keys: int, n_rows: int):
        k, v, q = _sequence(noise, n_keys)
        return k, v, q[-n_rows:]

    cases = []
    alone = Layout(b, 1)
    alone.add([], keys, values, queries[-1:])
    cases.append(("alone", alone, 0))

    beside = Layout(b, 2)
    for n_keys, n_rows in [(40, 1), (300, 1), (7, 7)]:
        beside.add([], *other(n_keys, n_rows))
    beside.add([], keys, values, queries[-1:])
    cases.append(("beside 3 others, last", beside, 9))

    cut = 3 * b
    shared = Layout(b, 3)
    segment = shared.segment(keys[:cut], values[:cut], level=1)
    shared.add([segment], *other(20, 1))
    shared.add([segment], keys[cut:], values[cut:], queries[-1:])
    shared.add([], *other(90, 3))
    cases.append(("one shared level", shared, 1))

    first, second = b, 4 * b
    nested = Layout(b, 4)
    outer = nested.segment(keys[:first], values[:first], level=1)
    inner = nested.segment(keys[first:second], values[first:second], level=2)
    nested.add([outer], *other(30, 2))
    nested.add([outer, inner], keys[second:], values[second:], queries[-1:])
    nested.add([outer, inner], *other(11, 11))
    cases.append(("two shared levels", nested, 2))

    chunk = Layout(b, 5)
    chunk.add([], *other(64, 1))
    chunk.add([], keys, values, queries[-37:])
    cases.append(("last row of a 37-row prefill chunk", chunk, 1 + 36))

    big = Layout(b, 6)
    for _ in range(decode_rows):
        big.add([], *other(130, 1))
    big.add([], keys, values, queries[-1:])
    cases.append((f"beside {decode_rows} decode rows", big, decode_rows))
    return cases


@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_invariant_triton_attention_gives_a_row_the_same_bits_in_every_layout(block_size):
    cases = _layouts(block_size, seed=block_size, decode_rows=63 if block_size == 16 else 15)
    outputs = {name: case.run(invariant=True)[row] for name, case, row in cases}
    expected = outputs["alone"]
    for name, out in outputs.items():
        assert torch.equal(out, expected), f"{name}: differs from the row alone"
    # and it is the attention: the torch reference's, up to fp32 rounding
    for name, case, row in cases[:4]:
        reference = case.reference()[row]
        assert (outputs[name] - reference).abs().max() <= 1e-5, name


def test_default_triton_attention_depends_on_the_layout():
    """The default mode (its key tiles follow the batch's tile shape, shared levels merge
    by log-sum-exp) rounds the same row differently across these layouts: the comparison
    above can fail."""
    cases = _layouts(16, seed=16, decode_rows=3)
    outputs = [case.run(invariant=False)[row] for _, case, row in cases]
    differing = [
        name for (name, _, _), out in zip(cases, outputs) if not torch.equal(out, outputs[0])
    ]
    assert "one shared level" in differing or "two shared levels" in differing


def test_invariant_triton_attention_with_a_sliding_window():
    """A 100-key window (the row at 149 sees keys 50..149): the same bits in every layout
    where every row stays in every segment of its chain, and the reference's values."""
    cases = _layouts(16, seed=3, decode_rows=3)
    outputs = {name: case.run(invariant=True, window=100)[row] for name, case, row in cases}
    expected = outputs["alone"]
    for name, out in outputs.items():
        assert torch.equal(out, expected), f"{name}: differs from the row alone"
    for name, case, row in cases[2:4]:
        reference = case.reference(window=100)[row]
        assert (outputs[name] - reference).abs().max() <= 1e-5, name
    # without the window the row reads other keys: the window is applied
    assert not torch.equal(cases[0][1].run(invariant=True)[0], expected)


def test_invariant_mode_refuses_layouts_it_cannot_align():
    """A segment that does not end on a block boundary, and a windowed layout that left the
    target row out of the outer segment of its chain (``drop=True``): ValueError, not a
    silently wrong or layout-dependent answer."""
    keys, values, queries = _sequence(torch.Generator().manual_seed(0), 40)
    partial = Layout(16, 0)
    segment = partial.segment(keys[:20], values[:20], level=1)
    partial.add([segment], keys[20:], values[20:], queries[-1:])
    q, own, prefixes = partial.batches()
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        AttentionStep("triton", own, prefixes, torch.empty(0, dtype=torch.int64), invariant=True)
    _, nested, _ = _layouts(16, seed=4, decode_rows=1)[3]
    q, own, prefixes = nested.batches()
    positions = [44, 45, 149] + [64 + j for j in range(11)]  # the target's window: 50..149
    own, dropped = layout.windowed(own, prefixes, positions, [[0], [16]], 100, drop=True)
    with pytest.raises(ValueError, match="carry different keys"):
        AttentionStep("triton", own, dropped, torch.empty(0, dtype=torch.int64), invariant=True)


def test_invariant_tile_shape_is_fixed_per_model():
    """Every launch of a model takes one tile shape, whatever the step's rows."""
    config = tri.invariant_config(torch.bfloat16, 128, 4, 16)
    assert config == (64, 64, 128, 4, 2, 64)
    assert tri.invariant_config(torch.float32, 64, 8, 32)[-1] == 64
    assert tri.invariant_step_keys(48) == 48 and tri.invariant_step_keys(128) == 64


# ---------------------------------------------------------------- the engine


SHARED = (
    "You label customer reviews. Answer with one word: positive, negative or neutral. "
    "Examples: 'Great value' is positive; 'Arrived crushed' is negative."
)


def _rowwise(self, x, weight, bias=None, packed=None):
    """F.linear one row at a time: the CPU's BLAS, like cuBLAS, rounds a row differently at
    different row counts, and the linears are not what these tests are about."""
    import torch.nn.functional as F

    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


def test_deterministic_triton_graph_rows_get_the_same_bits_alone_and_in_a_batch(
    tiny_llama_dir, monkeypatch
):
    """``kernels="triton", cuda_graphs="on", deterministic=True`` under the interpreter
    (decode steps replayed on the graphs' static buffers): a row's greedy tokens and their
    log-probability are bit-identical alone and beside two rows sharing its prompt's first
    part (a shared segment, other buckets). The linears run row by row here (``_rowwise``):
    on a GPU they are cuBLAS's, not batch-invariant, and the engine warns so."""
    from helpers import REVIEWS

    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.models import gemm

    monkeypatch.setattr(gemm.Gemm, "__call__", _rowwise)
    prompts = [f"{SHARED}\nReview: {text}" for text in REVIEWS[:3]]
    sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, ignore_eos=True)

    def answers(rows):
        op = LLMOperator(
            tiny_llama_dir, backend="native", kernels="triton", cuda_graphs="on",
            deterministic=True, kv_block_size=16,
        )  # fmt: skip
        with pytest.warns(RuntimeWarning, match="the Triton attention runs batch-invariant"):
            results = op.generate([prompts[r] for r in rows], sampling)
        assert all(r.error is None for r in results), [r.error for r in results]
        backend = op.backend()
        assert backend.paths.invariant and backend.last_profile.graph_steps > 0
        assert backend._graphs.invariant  # the graphs replay the invariant attention
        return [(tuple(r.token_ids), r.logprob) for r in results]

    whole = answers([0, 1, 2])
    for row in (0, 2):
        assert answers([row])[0] == whole[row], f"row {row} alone differs"


# ---------------------------------------------------------------- GPU build

# The interpreter runs the kernel's broadcast-sum products (ROW_PRODUCTS); a GPU runs its
# tl.dot path, compiled here for sm_90 without a GPU (as tests/test_kernels_triton.py does
# for the other kernels), in the engine's tile shapes (``invariant_config``).
COMPILE_SCRIPT = r"""
import sys
try:
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as error:
    print(error)
    sys.exit(77)
from llm_operator.kernels import triton_attention as tri

assert not tri._INTERPRETED, "the kernels run in the interpreter"
kernel = tri._invariant_attention_kernel
names = kernel.arg_names
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_od"}
TL = {torch.bfloat16: ("bf16", tl.bfloat16), torch.float16: ("fp16", tl.float16),
      torch.float32: ("fp32", tl.float32)}
for dtype, head_dim, group, block_size, own, load, windowed in [
    (torch.bfloat16, 128, 4, 16, False, True, False),  # a shared level
    (torch.float16, 64, 8, 32, True, False, False),  # own keys only
    (torch.bfloat16, 256, 2, 16, True, True, True),  # own keys after the levels, windowed
    (torch.float32, 64, 1, 48, False, True, True),  # fp32 FMA products, a 48-key block a step
]:
    name, mma = TL[dtype]
    block_m, block_n, block_d, warps, stages, step = tri.invariant_config(
        dtype, head_dim, group, block_size
    )
    constexprs = dict(GROUP=group, INDIRECT=not own, CAUSAL=own, LOAD_STATE=load, FINAL=own,
                      WINDOWED=windowed, MMA_DTYPE=mma,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32",
                      STEP_KEYS=step, ROW_PRODUCTS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_D=block_d, **{n: 1 for n in UNIT})
    types = {n: "*" + name for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", work_ptr="*i32",
                 rows_ptr="*i64", table_ptr="*i32", lows_ptr="*i32", scale="fp32")
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or (n.startswith("stride") and n not in UNIT)}
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
print("compiled")
"""


def test_invariant_kernel_compiles_for_sm90_without_a_gpu():
    compile_for_sm90(COMPILE_SCRIPT, TRITON_DEFAULT_FP_FUSION="1")
