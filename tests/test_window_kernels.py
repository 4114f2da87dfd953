"""Sliding-window attention in every kernel against a dense reference .

A step of three requests over a paged cache: two share segment A (and one of them a
deeper segment B), one has no shared prefix; rows are a prefill chunk, a decode row and a
fresh prompt. Every query at position p may see keys at p - window + 1 .. p only; the
reference attends over exactly those keys, row by row, in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_operator import kernels
from llm_operator.kernels import cpu_extension, cpu_ops, layout

HEADS, KV_HEADS, DIM = 4, 2, 16


def _scenario(block_size: int, window: int, seed: int = 0, dtype=torch.float32, segments=(37, 21)):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 96
    order = torch.randperm(num_blocks, generator=generator).tolist()

    def take(tokens):
        return [order.pop() for _ in range(-(-tokens // block_size))]

    seg_a, seg_b = segments  # A then B (B below A)
    blocks_a, blocks_b = take(seg_a), take(seg_b)
    # (chain, own tokens after the step, rows this step)
    requests = [(("A", "B"), 30, 7), (("A",), 19, 1), ((), 45, 45)]
    own_tables = [take(own) for _, own, _ in requests]
    k = torch.randn(num_blocks, block_size, KV_HEADS, DIM, generator=generator).to(dtype)
    v = torch.randn(num_blocks, block_size, KV_HEADS, DIM, generator=generator).to(dtype)

    def slots(table, count):
        return [table[i // block_size] * block_size + i % block_size for i in range(count)]

    segment = {"A": (blocks_a, seg_a, 0), "B": (blocks_b, seg_b, seg_a)}
    starts, positions, visible = [0], [], []
    for (chain, own, rows), table in zip(requests, own_tables):
        prefix = sum(segment[name][1] for name in chain)
        keys = [
            (slot, segment[name][2] + i)
            for name in chain
            for i, slot in enumerate(slots(segment[name][0], segment[name][1]))
        ] + [(slot, prefix + i) for i, slot in enumerate(slots(table, own))]
        for j in range(own - rows, own):
            p = prefix + j
            positions.append(p)
            visible.append([slot for slot, at in keys if p - window < at <= p])
        starts.append(starts[-1] + rows)
    q = torch.randn(starts[-1], HEADS, DIM, generator=generator).to(dtype)
    flat_k = k.view(-1, KV_HEADS, DIM).double()
    flat_v = v.view(-1, KV_HEADS, DIM).double()
    expected = torch.empty(starts[-1], HEADS, DIM, dtype=torch.float64)
    scale = DIM**-0.5
    for row, seen in enumerate(visible):
        index = torch.tensor(seen)
        keys = flat_k[index].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [n, heads, dim]
        values = flat_v[index].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), keys) * scale
        expected[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    shape = {"block_size": block_size, "num_blocks": num_blocks}
    own = layout.own_batch(starts, own_tables, [o for _, o, _ in requests], **shape)
    rows_of = [list(range(starts[i], starts[i + 1])) for i in range(3)]
    levels = [
        layout.prefix_batch(
            [rows_of[0] + rows_of[1]], [blocks_a], [seg_a], num_rows=starts[-1], **shape
        ),  # fmt: skip
        layout.prefix_batch([rows_of[0]], [blocks_b], [seg_b], num_rows=starts[-1], **shape),
    ]
    return {
        "q": q, "k": k, "v": v, "expected": expected, "own": own, "levels": levels,
        "positions": np.array(positions), "level_starts": [[0], [seg_a]],
        "scale": scale,
    }  # fmt: skip


WINDOWS = [5, 16, 40, 64]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_window_levels(window, block_size):
    case = _scenario(block_size, window)
    own, levels = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], window
    )
    step = kernels.AttentionStep("torch", own, levels, torch.zeros(0, dtype=torch.long))
    out = step.attend(case["q"], case["k"], case["v"], case["scale"])
    torch.testing.assert_close(out.double(), case["expected"], atol=1e-5, rtol=1e-5)


def test_window_drops_rows_outside_it():
    case = _scenario(16, 5)
    _, levels = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], 5
    )
    # window 5: every row's window lies within its own tokens (the decode row of request 1
    # has 18 own tokens before it, the chunk of request 0 at least 23)
    assert [len(level.host_rows) for level in levels] == [0, 0]
    _, kept = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], 5, drop=False
    )
    assert [len(level.host_rows) for level in kept] == [8, 7]


def _cpu_module():
    module = cpu_extension.load()
    if module is None:
        pytest.skip(f"compiled CPU kernels unavailable: {cpu_extension.failure()}")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpp_window(window, block_size, dtype):
    _cpu_module()
    case = _scenario(block_size, window, dtype=dtype)
    own, levels = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], window
    )
    k, v = cpu_ops.to_cpu_layout(case["k"], case["v"])
    step = kernels.AttentionStep("cpp", own, levels, torch.zeros(0, dtype=torch.long))
    out = step.attend(case["q"], k, v, case["scale"])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), case["expected"], atol=tolerance, rtol=tolerance)
    for split in (5, 0):  # key splits of a few keys; one block a softmax step
        out = cpu_ops.attention(step.module, case["q"], k, v, step.work, case["scale"], split)
        torch.testing.assert_close(out.double(), case["expected"], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("window", [5, 40, 64, 100])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpp_window_invariant(window, block_size):
    """The batch-invariant mode: segments on block boundaries, every row kept in every
    segment (drop=False), items aligned to 64-key steps; the same bits for a row alone as
    beside the others."""
    _cpu_module()
    case = _scenario(block_size, window, segments=(2 * block_size, block_size))
    own, levels = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], window, drop=False
    )
    k, v = cpu_ops.to_cpu_layout(case["k"], case["v"])
    step = kernels.AttentionStep(
        "cpp", own, levels, torch.zeros(0, dtype=torch.long), invariant=True
    )
    assert step.split_keys == -1
    out = step.attend(case["q"], k, v, case["scale"])
    torch.testing.assert_close(out.double(), case["expected"], atol=1e-5, rtol=1e-5)
    # the decode row of request 1 (row 7) alone: its own batch and its one segment
    alone_own = layout.own_batch(
        [0, 1], [case["own"].block_tables[1].tolist()], [case["own"].host_context_lens[1]],
        block_size=block_size, num_blocks=case["own"].num_blocks,
    )  # fmt: skip
    level = case["levels"][0]
    alone_level = layout.prefix_batch(
        [[0]], [level.block_tables[0].tolist()], [level.host_lengths[0]], num_rows=1,
        block_size=block_size, num_blocks=level.num_blocks,
    )  # fmt: skip
    own1, levels1 = layout.windowed(
        alone_own, [alone_level], case["positions"][7:8], [[0]], window, drop=False
    )
    alone = kernels.AttentionStep(
        "cpp", own1, levels1, torch.zeros(0, dtype=torch.long), invariant=True
    )
    single = alone.attend(case["q"][7:8].contiguous(), k, v, case["scale"])
    assert torch.equal(single[0], out[7])


def _triton():
    pytest.importorskip("triton")
    from llm_operator.kernels import triton_attention

    return triton_attention


@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_window(window, block_size, drop):
    """The Triton kernels (under the interpreter here) take the window: ``attend`` (own
    part, then each level merged in place) and the separate operations merged after, with
    rows kept in segments their window misses wholly (drop=False: out 0, lse -inf there)."""
    triton_attention = _triton()
    case = _scenario(block_size, window)
    own, levels = layout.windowed(
        case["own"], case["levels"], case["positions"], case["level_starts"], window, drop=drop
    )
    step = kernels.AttentionStep("triton", own, levels, torch.zeros(0, dtype=torch.long))
    out = step.attend(case["q"], case["k"], case["v"], case["scale"])
    torch.testing.assert_close(out.double(), case["expected"], atol=1e-5, rtol=1e-5)
    args = (case["q"], case["k"], case["v"])
    parts = [triton_attention.own_attention(*args, own, case["scale"])]
    for level in levels:
        part = triton_attention.prefix_attention(*args, level, case["scale"])
        rows = list(level.host_rows)
        blind = [
            row
            for row, first in zip(rows, level.host_key_start)
            if first >= max(level.host_lengths)
        ]
        if blind:  # rows whose window misses the segment: nothing seen, not masked garbage
            assert not drop
            assert torch.isinf(part.lse[blind]).all() and (part.lse[blind] < 0).all()
        parts.append(part)
    merged = triton_attention.merge_attention_states(parts).out
    torch.testing.assert_close(merged.double(), case["expected"], atol=1e-5, rtol=1e-5)
    # the same kernels without the window see more keys: the window is what matches
    if window < 40:
        plain = kernels.AttentionStep("triton", case["own"], case["levels"], torch.zeros(0))
        full = plain.attend(case["q"], case["k"], case["v"], case["scale"])
        assert not torch.allclose(full.double(), case["expected"], atol=1e-3)
