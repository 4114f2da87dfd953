"""How much arithmetic a benchmark run did: the work in FLOP (DESIGN.md, "Knowing the limit").

A decoder layer's matmuls cost 2 FLOP per weight per token, so one token through the model
costs 2 x its non-embedding linear weights (SmolLM2-135M: 106M weights, 212 MFLOP) plus
attention (4 x layers x heads x head_dim FLOP per key it attends to: QK^T and PV); each
sampled position adds the output head (2 x vocab x hidden). ``work_flop`` is the formula;
``attention_keys`` estimates the keys from the prompt and output lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class ModelShape(NamedTuple):
    """The sizes of a Llama-family decoder that its FLOP count depends on."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """One layer's projections as (name, in_features, out_features), q/k/v and gate/up fused."""
        attention = self.num_heads * self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return [
            ("qkv", self.hidden_size, qkv),
            ("o_proj", attention, self.hidden_size),
            ("gate_up", self.hidden_size, 2 * self.intermediate_size),
            ("down", self.intermediate_size, self.hidden_size),
        ]

    def linear_weights(self) -> int:
        """Non-embedding weights that a token multiplies (norms and biases left out)."""
        return self.num_layers * sum(rows * cols for _, rows, cols in self.linear_shapes())


def model_shape(config: Any) -> ModelShape:
    """The shape of a transformers config (or its dict); ValueError when a size is missing."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    required = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_heads": "num_attention_heads",
        "num_layers": "num_hidden_layers",
        "vocab_size": "vocab_size",
    }
    values = {field: get(key) for field, key in required.items()}
    missing = [required[field] for field, value in values.items() if not value]
    if missing:
        raise ValueError(
            f"model config lacks {', '.join(missing)}; FLOP figures need a Llama-family config"
        )
    num_kv_heads = get("num_key_value_heads") or values["num_heads"]
    head_dim = get("head_dim") or values["hidden_size"] // values["num_heads"]
    return ModelShape(
        hidden_size=int(values["hidden_size"]),
        intermediate_size=int(values["intermediate_size"]),
        num_heads=int(values["num_heads"]),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        num_layers=int(values["num_layers"]),
        vocab_size=int(values["vocab_size"]),
    )


def attention_keys(
    prompt_lengths: Sequence[int], output_lengths: Sequence[int]
) -> tuple[float, float]:
    """(keys per prefill token, keys per output token), averaged over a workload's rows.

    A prompt token at position p (from 0) attends to p + 1 keys, so over all prompt tokens
    the mean is sum(L (L + 1) / 2) / sum(L). An output token of a row with prompt length L
    and n outputs attends to about L + n / 2 keys; the mean is weighted by n. A workload
    without outputs gives 0.0 for the second figure.
    """
    if len(prompt_lengths) != len(output_lengths):
        raise ValueError(
            f"{len(prompt_lengths)} prompt lengths but {len(output_lengths)} output lengths"
        )
    prompt_tokens = sum(prompt_lengths)
    if prompt_tokens < 1:
        raise ValueError(f"prompt_lengths must hold at least one token, got {prompt_lengths!r}")
    prefill = sum(length * (length + 1) / 2 for length in prompt_lengths) / prompt_tokens
    outputs = sum(output_lengths)
    output = (
        sum(n * (length + n / 2) for length, n in zip(prompt_lengths, output_lengths)) / outputs
        if outputs
        else 0.0
    )
    return prefill, output


def work_flop(
    shape: ModelShape,
    *,
    prefill_tokens: int,
    output_tokens: int,
    prefill_keys: float,
    output_keys: float,
) -> float:
    """FLOP a job computed: prefill tokens x (per-token FLOP) + output tokens x (per-token
    FLOP + output-head FLOP).

    per-token FLOP = 2 x ``shape.linear_weights()`` + 4 x layers x heads x head_dim x keys,
    with ``prefill_keys`` keys for a prefill token and ``output_keys`` for an output token
    (``attention_keys``); the output head costs 2 x vocab x hidden. SmolLM2-135M at short
    contexts: about 212 MFLOP per prefill token and 268 MFLOP per output token.
    """
    if prefill_tokens < 0 or output_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prefill_tokens=}, {output_tokens=}")
    linear = 2 * shape.linear_weights()
    per_key = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    head = 2 * shape.vocab_size * shape.hidden_size
    return prefill_tokens * (linear + per_key * prefill_keys) + output_tokens * (
        linear + head + per_key * output_keys
    )
