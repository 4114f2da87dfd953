"""One engine step's attention over a paged KV cache, on one of three kernel families.

``AttentionStep`` is built once per step (its layout: ``layout.OwnBatch`` and one
``layout.PrefixBatch`` per level of the shared segment chains) and called by every layer:
it stores the step's K/V, then merges each row's attention over its own K/V (causal) with
its attention over the shared segments it reads (non-causal). Which family runs it is the
engine's choice, made once when the engine starts (``engine.factory.native_paths``):

    torch   plain torch (``torch_attention.py``): the oracle and the fallback
    triton  Triton kernels (``triton_attention.py``) for CUDA tensors (and CPU tensors
            under the Triton interpreter, in tests); the same reference cache layout
    cpp     the compiled CPU kernels (``cpu_kernels.cpp`` through ``cpu_ops.py``) for
            fp32/bf16 CPU tensors: their own cache layout (``kv_cache_shapes``) and one
            call per layer that stores the K/V and computes every part, merged
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from llm_operator.kernels import cpu_extension, cpu_ops, torch_attention
from llm_operator.kernels.layout import OwnBatch, PrefixBatch

IMPLEMENTATIONS = ("torch", "triton", "cpp")


def kv_cache_shapes(
    implementation: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(k_cache, v_cache) shapes of one layer for ``implementation``: the compiled CPU
    kernels' layout for ``cpp``, ``[num_blocks, block_size, num_kv_heads, head_dim]`` else."""
    if implementation == "cpp":
        return cpu_ops.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape


def copy_blocks(implementation: str, caches: Sequence[Tensor], copies: Tensor) -> None:
    """Copy whole KV blocks in every cache of ``implementation``'s layout (``kv_cache_shapes``):
    ``copies`` [n, 2] int64 on the caches' device, (source, destination) block ids."""
    dim = 1 if implementation == "cpp" else 0  # the cpp layout puts KV heads first
    source, destination = copies[:, 0], copies[:, 1]
    for cache in caches:
        cache.index_copy_(dim, destination, cache.index_select(dim, source))


class AttentionStep:
    """One step's attention, built once and called by every layer.

    ``__call__(q, k, v, k_cache, v_cache, scale)`` stores this step's k, v
    [T, kv_heads, dim] at ``slot_mapping`` and returns each row's attention over its own
    K/V (``own``, causal) and its shared segments (``prefixes``, one ``PrefixBatch`` per
    chain level, non-causal), merged by log-sum-exp: out [T, heads, dim] in q's dtype.
    Caches are in ``implementation``'s layout (``kv_cache_shapes``).
    """

    def __init__(
        self,
        implementation: str,
        own: OwnBatch,
        prefixes: Sequence[PrefixBatch],
        slot_mapping: Tensor,
        *,
        invariant: bool = False,
        softcap: float | None = None,
    ) -> None:
        """invariant: the batch-invariant mode of the compiled CPU attention and of the
        Triton one (``triton_attention.attend_invariant``): a row's bits do not depend on
        the step; segments must end on block boundaries, and a sliding-window layout must
        keep every row in every segment of its chain (``windowed(drop=False)``). The torch
        family ignores it. softcap: scores soft-capped as ``softcap * tanh(scores /
        softcap)`` (Gemma 2), on the torch family only."""
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
            )
        if softcap is not None and implementation != "torch":
            raise ValueError(
                f"soft-capped attention scores run on the torch kernels only, not "
                f"{implementation!r}"
            )
        self.implementation = implementation
        self.own, self.prefixes, self.slot_mapping = own, list(prefixes), slot_mapping
        self.softcap = softcap
        self.invariant = invariant and implementation != "torch"
        self.split_keys = cpu_ops.SPLIT_KEYS
        if implementation == "cpp":
            self.module = cpu_extension.loaded()
            if self.module is None:
                raise RuntimeError(
                    "the compiled CPU kernels are not loaded (cpu_extension.load loads them): "
                    f"{cpu_extension.failure() or 'never loaded'}"
                )
            step_keys = None
            if invariant:
                self.split_keys = cpu_ops.invariant_split_keys(own.block_size, self.prefixes)
                step_keys = cpu_ops.INVARIANT_STEP_KEYS if self.split_keys < 0 else None
            self.work = cpu_ops.attention_items(own, self.prefixes, step_keys)
        elif implementation == "triton":
            from llm_operator.kernels import triton_attention

            self.module = triton_attention
            if invariant:  # every item's keys from a multiple of the softmax step
                self.own, self.prefixes = triton_attention.invariant_batches(own, self.prefixes)
        else:
            self.module = torch_attention

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float
    ) -> Tensor:
        self.store(k, v, k_cache, v_cache)
        return self.attend(q, k_cache, v_cache, scale)

    def store(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Write this step's k, v [T, kv_heads, dim] at ``slot_mapping``."""
        if self.implementation == "cpp":
            cpu_ops.store_kv(self.module, k_cache, v_cache, k, v, self.slot_mapping)
        else:
            self.module.store_kv(k_cache, v_cache, k, v, self.slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
        """Each row's attention over its own K/V and its segments, merged (K/V stored)."""
        if self.implementation == "cpp":
            return cpu_ops.attention(
                self.module, q, k_cache, v_cache, self.work, scale, self.split_keys
            )
        module = self.module
        if self.implementation == "triton":
            if self.invariant:  # one softmax state carried through the levels, then own
                return module.attend_invariant(q, k_cache, v_cache, self.own, self.prefixes, scale)
            # own part, then each level merged in place
            return module.attend(q, k_cache, v_cache, self.own, self.prefixes, scale)
        softcap = self.softcap
        parts = [module.own_attention(q, k_cache, v_cache, self.own, scale, softcap)]
        for batch in self.prefixes:
            parts.append(module.prefix_attention(q, k_cache, v_cache, batch, scale, softcap))
        return parts[0].out if len(parts) == 1 else module.merge_attention_states(parts).out
