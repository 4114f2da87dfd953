"""Decode steps replayed as CUDA graphs, one per bucket of rows (as vLLM and SGLang do).

A decode step of a small model is hundreds of kernel launches of a few microseconds each:
the GPU waits for the host. A graph records one step's launches once and replays them in
one call. A graph replays fixed shapes at fixed addresses, so each bucket of rows has its
static buffers (``_Static``), refilled from the step's host arrays before each replay with
one host-to-device copy:

    arena (int32, one copy per replay; region map in ``_Layout``):
      [ input ids R | positions R | KV slots R | own: query_start R+1, context R,
        tables R x W, work R x 6 | per level: rows R, row_start S+1, lengths S,
        tables S x Ws, work X x 6 ]

The rows of a bucket past the step's (padding) get token 0 at position 0, slot -1 (the
K/V store skips it), no own keys and no segment (their outputs are dropped). Work items
past the step's have count 0: their programs do nothing. The kernels' launch plans are
preset on the static batches (``triton_attention.preset_plan``), so recording launches
nothing that reads the host.

A graph's key is everything its launches depend on: the bucket, the own table width, and
per chain level the segment capacity, table width, work capacity, tile shape and key splits
(capacities rounded up to powers of two, so a job sees a handful of keys). Graphs are
recorded lazily, at a key's first step: a warm-up run on a side stream (Triton compiles),
the capture, then the replay.

``invariant=True`` (``deterministic=True``: ``EnginePaths.invariant``) records the
batch-invariant attention (``triton_attention.attend_invariant``): the step's tables and
lengths are first aligned to its softmax steps on the host (``kernels.layout.
align_step_keys``, the blocks a row carries from one level into the next item's table),
its work items have no key splits, and every level takes the one fixed tile shape
(``invariant_config``), so a row's attention has the same bits in every bucket and batch.

``capture=False`` runs the same static buffers eagerly at every step (``cuda_graphs="on"``
with ``kernels="triton"`` under the Triton interpreter): the CPU path of the tests, which
checks the padding and the static layout against the eager engine and Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llm_operator import kernels
from llm_operator.engine.native.overlap import patch_input_ids
from llm_operator.engine.native.step_builder import HostStep, LayerAttention
from llm_operator.kernels import layout as kernel_layout
from llm_operator.kernels import triton_attention as triton_kernels
from llm_operator.models.fused import EAGER_OPS, FusedOps
from llm_operator.models.llama import LlamaModel


def buckets(max_rows: int) -> list[int]:
    """Row counts a graph is recorded for: 1, 2, 4, 8, then steps of 8 to 64, 16 to 256,
    64 to 1024 and 128 beyond, up to the first at or above ``max_rows``."""
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= max_rows:
            return sizes
        step = 8 if size < 64 else 16 if size < 256 else 64 if size < 1024 else 128
        size = size * 2 if size < 8 else size + step


def _capacity(count: int) -> int:
    return 1 << max(0, int(count) - 1).bit_length()


@dataclass(frozen=True)
class _LevelKey:
    segments: int  # segment capacity S
    width: int  # segment table width
    work: int  # work item capacity
    config: tuple  # BLOCK_M, BLOCK_N, BLOCK_D, warps, stages
    splits: int


@dataclass
class _Layout:
    """Offsets of each region of a graph's int32 arena (see the module docstring)."""

    size: int
    regions: dict[str, tuple[int, tuple[int, ...]]]

    @classmethod
    def of(cls, rows: int, width: int, levels: tuple[_LevelKey, ...]) -> _Layout:
        regions: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0

        def add(name: str, *shape: int) -> None:
            nonlocal offset
            regions[name] = (offset, shape)
            offset += int(np.prod(shape))

        for name in ("input_ids", "positions", "slots", "context"):
            add(name, rows)
        add("query_start", rows + 1)
        add("own_tables", rows, width)
        add("own_work", rows, 6)
        for index, level in enumerate(levels):
            add(f"rows{index}", rows)
            add(f"row_start{index}", level.segments + 1)
            add(f"lengths{index}", level.segments)
            add(f"tables{index}", level.segments, level.width)
            add(f"work{index}", level.work, 6)
        return cls(offset, regions)

    def view(self, arena, name: str):
        offset, shape = self.regions[name]
        return arena[offset : offset + int(np.prod(shape))].reshape(shape)


@dataclass
class _Static:
    """One graph: its arena (host and device), static attention step and output."""

    layout: _Layout
    host: torch.Tensor  # int32 arena, pinned on CUDA
    arena: torch.Tensor  # int32 arena on the device
    step: kernels.AttentionStep
    hidden: torch.Tensor | None = None  # [rows, hidden_size]: the recorded output
    graph: object = None  # torch.cuda.CUDAGraph once recorded


class DecodeGraphs:
    """Runs decode-only steps of one KV pool through per-bucket graphs.

    Contract: ``accepts(host)`` says whether a step can run here (decode only, at most
    ``max_rows`` rows); ``logits(host)`` returns the step's logits [rows, vocab] float32,
    the same as the eager forward and ``model.compute_logits`` of every row would, after
    storing the step's K/V. The graph ends at the final norm: the head runs eagerly on the
    step's rows only (a recorded output lives as long as its graph, and [rows, vocab]
    logits of every bucket would hold gigabytes). The caches and the model must not move
    while this object lives.
    """

    def __init__(
        self,
        model: LlamaModel,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        *,
        max_rows: int,
        block_size: int,
        pool_blocks: int,
        capture: bool,
        ops: FusedOps = EAGER_OPS,
        fused_store: bool = False,
        invariant: bool = False,
    ) -> None:
        """ops, fused_store: the forward's elementwise regions and whether they store K/V
        (``LlamaModel.forward``). invariant: record the batch-invariant attention (module
        docstring)."""
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        self.ops, self.fused_store = ops, fused_store
        self.invariant = invariant
        self.buckets = buckets(max_rows)
        self.block_size, self.pool_blocks, self.capture = block_size, pool_blocks, capture
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        config = model.config
        self.heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        self.group = config.num_heads // config.num_kv_heads
        self.graphs: dict[tuple, _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps run through a graph (or its eager stand-in)

    def accepts(self, host: HostStep) -> bool:
        return host.decode_only and host.num_tokens <= self.buckets[-1]

    # -- a step ------------------------------------------------------------------------
    def logits(self, host: HostStep, patch=None) -> torch.Tensor:
        """patch: (token rows, indices, tokens): input ids copied on the device from
        ``tokens[indices]`` (``OverlappedSteps``)."""
        count = host.num_tokens
        rows = next(size for size in self.buckets if size >= count)
        arrays = self._arrays(host)
        own_tables, context_lens, level_tables, level_lengths = arrays
        (_, kv_heads, dim), group = self.heads, self.group
        if self.invariant:  # one tile shape for every launch, no key splits
            own_config = triton_kernels.invariant_config(self.dtype, dim, group, self.block_size)
        else:
            own_config = triton_kernels.tile_config(self.dtype, dim, 1, group)
        own_items = triton_kernels.own_work(host.query_start, context_lens, own_config[0] // group)
        level_items, level_keys = [], []
        for level, tables, lengths in zip(host.levels, level_tables, level_lengths):
            if self.invariant:
                config, target = own_config, 0
            else:
                config = triton_kernels.tile_config(self.dtype, dim, rows, group)
                target = triton_kernels._target_programs(self.device)
            items, splits = triton_kernels.prefix_work(
                level.row_start, lengths, config[0] // group, config[1], target, kv_heads
            )
            level_items.append(items)
            sizes = (len(lengths), max(1, tables.shape[1]), max(1, len(items)))
            level_keys.append(_LevelKey(*map(_capacity, sizes), config, splits))
        width = _capacity(max(1, own_tables.shape[1]))
        key = (rows, width, tuple(level_keys))
        static = self.graphs.get(key)
        if static is None:
            static = self.graphs[key] = self._static(rows, width, tuple(level_keys), own_config)
        self._fill(static, host, arrays, own_items, level_items)
        static.arena.copy_(static.host, non_blocking=True)
        if patch is not None:
            patch_input_ids(static.layout.view(static.arena, "input_ids"), patch)
        if static.graph is not None:
            static.graph.replay()
        elif self.capture:
            self._record(static)
        else:
            static.hidden = self._forward(static)
        self.replays += 1
        return self.model.compute_logits(static.hidden[:count])

    def _arrays(self, host: HostStep) -> tuple:
        """(own tables, context lens, per level tables, per level lengths) of the step: the
        host step's, or in the invariant mode aligned to its softmax steps."""
        levels = host.levels
        if not self.invariant:
            return (
                host.own_tables, host.context_lens,
                [level.tables for level in levels], [level.lengths for level in levels],
            )  # fmt: skip
        aligned = kernel_layout.align_step_keys(
            host.query_start,
            host.own_tables,
            host.context_lens,
            [(level.rows, level.row_start, level.tables, level.lengths) for level in levels],
            block_size=self.block_size,
            step_keys=triton_kernels.invariant_step_keys(self.block_size),
        )
        return aligned.own_tables, aligned.context_lens, aligned.level_tables, aligned.level_lengths

    def _fill(self, static: _Static, host: HostStep, arrays, own_items, level_items) -> None:
        """Write the step into the graph's host arena, padding past its rows and items
        (``arrays``: the step's tables and lengths, ``_arrays``)."""
        own_tables, context_lens, level_tables, level_lengths = arrays
        layout, arena = static.layout, static.host.numpy()
        count = host.num_tokens

        def put(name: str, values, fill: int = 0) -> None:
            view = layout.view(arena, name)
            view.fill(fill)
            values = np.asarray(values)
            view[tuple(slice(0, size) for size in values.shape)] = values

        put("input_ids", host.input_ids)
        put("positions", host.positions)
        put("slots", host.slots, fill=-1)
        put("context", context_lens)
        query_start = layout.view(arena, "query_start")
        query_start[: count + 1] = host.query_start
        query_start[count + 1 :] = count  # padding rows: no query rows
        put("own_tables", own_tables)
        put("own_work", own_items)
        levels = zip(host.levels, level_tables, level_lengths, level_items)
        for index, (level, tables, lengths, items) in enumerate(levels):
            put(f"rows{index}", level.rows, fill=-1)
            row_start = layout.view(arena, f"row_start{index}")
            row_start[: len(level.row_start)] = level.row_start
            row_start[len(level.row_start) :] = level.row_start[-1]
            put(f"lengths{index}", lengths)
            put(f"tables{index}", tables)
            put(f"work{index}", items)

    # -- building and recording --------------------------------------------------------
    def _static(
        self, rows: int, width: int, levels: tuple[_LevelKey, ...], own_config: tuple
    ) -> _Static:
        layout = _Layout.of(rows, width, levels)
        host = torch.zeros(layout.size, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        arena = torch.zeros(layout.size, dtype=torch.int32, device=self.device)

        def view(name: str) -> torch.Tensor:
            return layout.view(arena, name)

        heads = dict(zip(("num_heads", "num_kv_heads", "head_dim"), self.heads))
        shape = {"block_size": self.block_size, "num_blocks": self.pool_blocks}
        query_start = view("query_start")
        own = kernels.OwnBatch(
            query_start=query_start,
            block_tables=view("own_tables"),
            context_lens=view("context"),
            num_rows=rows,
            max_query_rows=1,
            max_context_len=width * self.block_size,
            host_query_start=(),
            host_context_lens=(),
            **shape,
        )
        self._preset(own, own_config, view("own_work"), 1, heads)
        prefixes = []
        for index, level in enumerate(levels):
            batch = kernels.PrefixBatch(
                rows=view(f"rows{index}"),
                row_start=view(f"row_start{index}"),
                block_tables=view(f"tables{index}"),
                lengths=view(f"lengths{index}"),
                num_rows=rows,
                max_segment_rows=rows,
                max_length=level.width * self.block_size,
                host_rows=(),
                host_row_start=(),
                host_lengths=(),
                **shape,
            )
            self._preset(batch, level.config, view(f"work{index}"), level.splits, heads)
            prefixes.append(batch)
        step = kernels.AttentionStep(
            "triton", own, prefixes, view("slots"), invariant=self.invariant
        )
        return _Static(layout, host, arena, step)

    def _preset(self, batch, config: tuple, work: torch.Tensor, splits: int, heads: dict) -> None:
        """The static batch's launch plan (the invariant one: its tables come aligned)."""
        if self.invariant:
            triton_kernels.preset_invariant_plan(batch, config=config, work=work, **heads)
        else:
            triton_kernels.preset_plan(batch, config=config, work=work, num_splits=splits, **heads)

    def _forward(self, static: _Static) -> torch.Tensor:
        """The step on the static buffers: the final-normed hidden states [rows, hidden]."""
        layout, arena = static.layout, static.arena
        return self.model(
            layout.view(arena, "input_ids"),
            layout.view(arena, "positions"),
            LayerAttention(static.step, self.k_cache, self.v_cache, self.model.config.scale),
            self.ops,
            self.fused_store,
        )

    def _record(self, static: _Static) -> None:
        """Warm up on a side stream (kernels compile, allocations settle), record, replay."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.hidden = self._forward(static)
        static.graph = graph
        graph.replay()
