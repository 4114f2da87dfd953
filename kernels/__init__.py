"""Attention of the native engine over a paged KV cache (``llm_operator.kernels``).

Shared-prefix attention: each row attends to its own K/V (causal) and, one batched call
per shared segment, to the segments it shares with other rows (non-causal); the parts
merge by log-sum-exp. The modules, each with its contract in its docstring:

    layout.py            one step's index layout (``OwnBatch``, ``PrefixBatch``), validated
                         once on the host; the cache layout; the argument checks
    attention_step.py    ``AttentionStep``: a step's attention on one kernel family
    torch_attention.py   the torch reference: the test oracle and the fallback
    triton_attention.py  Triton kernels (CUDA; the interpreter on CPU tensors in tests)
    triton_fused.py      the decoder layer's elementwise regions on Triton (dispatch)
    triton_fused_kernels.py  their Triton kernels
    cpu_kernels.cpp      compiled CPU kernels: attention, packed GEMM, the whole decoder
    cpu_extension.py     builds, loads and self-checks them; ``cpu_ops.py`` calls them
    self_check.py        each Triton kernel family against its reference, at start-up

This package imports nothing above it; this file only re-exports.
"""

from __future__ import annotations

from llm_operator.kernels.attention_step import (
    IMPLEMENTATIONS,
    AttentionStep,
    copy_blocks,
    kv_cache_shapes,
)
from llm_operator.kernels.layout import (
    AttentionOutput,
    OwnBatch,
    PrefixBatch,
    device_tensor,
    own_batch,
    own_batch_arrays,
    prefix_batch,
    prefix_batch_arrays,
    windowed,
)

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionOutput",
    "AttentionStep",
    "copy_blocks",
    "OwnBatch",
    "PrefixBatch",
    "device_tensor",
    "kv_cache_shapes",
    "own_batch",
    "own_batch_arrays",
    "prefix_batch",
    "prefix_batch_arrays",
    "windowed",
]
