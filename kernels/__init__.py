"""Attention operations of the native engine over a paged KV cache (``llm_operator.kernels``).

Shared-prefix attention: ``prefix_attention`` (every row sharing a prefix segment against
one copy of its K/V, non-causal) plus ``own_attention`` (each request against its own K/V,
causal), merged by log-sum-exp in ``merge_attention_states``; ``store_kv`` writes a step's
K/V into the cache. Shapes and contracts are in each function's docstring.

Today every name is the torch reference (``reference.py``): the CPU path and the oracle.
Planned: ``triton_*.py`` kernels with the same signatures and a dispatch here, where CUDA
tensors go to Triton, CPU tensors to the reference, and the environment variable
``LLM_OPERATOR_KERNELS=torch|triton`` forces one implementation.
"""

from __future__ import annotations

from llm_operator.kernels.reference import (
    AttentionOutput,
    merge_attention_states,
    own_attention,
    prefix_attention,
    store_kv,
)

__all__ = [
    "AttentionOutput",
    "merge_attention_states",
    "own_attention",
    "prefix_attention",
    "store_kv",
]
