"""Rotary position embedding (RoPE) for the native Llama-family forward, as Hugging Face computes it.

Inverse frequencies and attention scaling come from transformers (`ROPE_INIT_FUNCTIONS`;
"default" is HF's one-line formula), so scaled variants follow HF without re-deriving them.
cos/sin are computed from the positions in fp32 with HF's arithmetic, then cast to the
activation dtype (on the CPU read from tables built once, so that a position's values never
depend on the step it is in).

Rope types: "default", "linear", "llama3", "yarn"; "dynamic", which equals the unscaled rope
below max_position_embeddings (HF rescales only past it; the engine keeps sequences within);
"longrope" (Phi-3.5, Phi-4-mini) with its short factors, which HF uses while a sequence stays
within ``original_max_position_embeddings`` (the engine keeps its rows there:
``longrope_positions``). Parameters given per layer type (Gemma 3: a local base for
sliding-window layers) are read per ``layer_type``. A partial rotary factor (Phi-4-mini: 0.75)
rotates the first dimensions of each head only (``rotary_dim``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def per_layer_type(hf_config: Any) -> bool:
    """Whether the config gives rope parameters per layer type (Gemma 3)."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in parameters.values())


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """A copy of the config's flat `rope_parameters` (transformers 5); for a config that gives
    them per layer type, those of ``layer_type``."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if per_layer_type(hf_config):
        if not isinstance(parameters.get(layer_type), dict):
            raise ValueError(
                f"model_type={getattr(hf_config, 'model_type', None)!r}: rope parameters per "
                f"layer type {sorted(parameters)} have none for layer type {layer_type!r}"
            )
        parameters = parameters[layer_type]
    return dict(parameters)


def rope_type(hf_config: Any, layer_type: str | None = None) -> str:
    """The config's rope type; ValueError unless it is in SUPPORTED_ROPE_TYPES."""
    parameters = rope_parameters(hf_config, layer_type)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model_type={getattr(hf_config, 'model_type', None)!r}: rope_type={kind!r} is not "
            f"supported by the native engine; supported rope types: {SUPPORTED_ROPE_TYPES}"
        )
    return kind


def rotary_dim(hf_config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """Dimensions of each head that RoPE rotates: head_dim times the partial rotary factor
    (HF's rounding), an even number."""
    parameters = rope_parameters(hf_config, layer_type)
    partial = parameters.get(
        "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)
    )
    dim = int(head_dim * (1.0 if partial is None else float(partial)))
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(
            f"partial_rotary_factor={partial!r} rotates {dim} of {head_dim} head dimensions; the "
            "native engine needs an even number of at least 2"
        )
    return dim


def longrope_positions(hf_config: Any, layer_type: str | None = None) -> int | None:
    """For a "longrope" config, the positions its short factors serve
    (``original_max_position_embeddings``); None for every other rope type."""
    if rope_type(hf_config, layer_type) != "longrope":
        return None
    parameters = rope_parameters(hf_config, layer_type)
    original = parameters.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    return int(original) if original else None


def rope_inverse_frequencies(
    hf_config: Any, head_dim: int, layer_type: str | None = None
) -> tuple[Tensor, float]:
    """(inv_freq [rotary dims // 2] fp32 on CPU, attention_scaling) of this config (and
    ``layer_type``, where it gives rope parameters per layer type), as HF computes them."""
    kind = rope_type(hf_config, layer_type)
    dim = rotary_dim(hf_config, head_dim, layer_type)
    with torch.device("cpu"):  # also when the model is being built under torch.device("meta")
        if kind == "default":
            base = rope_parameters(hf_config, layer_type).get("rope_theta") or 10_000.0
            exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
            return 1.0 / (base**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # The init functions standardize (mutate) the config's rope dict: give them a copy.
        extra = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](
            copy.deepcopy(hf_config), torch.device("cpu"), **extra
        )
    assert inv_freq.shape == (dim // 2,), (
        f"rope {kind!r} gave inv_freq of shape {tuple(inv_freq.shape)} for {dim} rotary dims"
    )
    return inv_freq.float(), float(attention_scaling)


# cos/sin of CPU steps come from tables built in blocks of about this many elements (whole
# positions, at fixed starts), so a position's values never depend on where it falls in a
# step (ATen computes a loop's tail with the scalar function, which rounds differently).
TABLE_BLOCK_ELEMENTS = 1 << 14


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; `inv_freq` is a non-persistent fp32 buffer.

    On the CPU they are read from fp32 tables grown block by block (batch-invariant: the
    same bits for a position whichever step asks); elsewhere computed per call."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling
        self._tables: tuple[Tensor, Tensor] | None = None  # CPU (cos, sin) [positions, dim]

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 (cos, sin) [T, head_dim] of positions [T], as HF computes them."""
        frequencies = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((frequencies, frequencies), dim=-1)  # [T, head_dim]
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def _table(self, count: int) -> tuple[Tensor, Tensor]:
        """The CPU tables, grown to at least ``count`` positions."""
        have = 0 if self._tables is None else self._tables[0].shape[0]
        if have < count:
            block = max(1, TABLE_BLOCK_ELEMENTS // (2 * self.inv_freq.shape[0]))
            parts = [self._tables] if self._tables else []
            parts += [
                self._angles(torch.arange(start, start + block, device=self.inv_freq.device))
                for start in range(have, count, block)
            ]
            self._tables = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
        return self._tables

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim] in `dtype` (computed in fp32)."""
        if positions.device.type == "cpu" and positions.numel():
            cos, sin = self._table(int(positions.max()) + 1)
            return cos[positions].to(dtype), sin[positions].to(dtype)
        cos, sin = self._angles(positions)
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """HF's convention: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim], cos/sin [T, rotary dims] -> rotated x, same shape and dtype;
    with fewer rotary dims than head_dim (a partial rotary factor) the first ones rotate
    and the rest pass through, as HF's ``apply_rotary_pos_emb``."""
    rotated = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rotated < x.shape[-1]:
        head, rest = x[..., :rotated], x[..., rotated:]
        return torch.cat(((head * cos) + (rotate_half(head) * sin), rest), dim=-1)
    return (x * cos) + (rotate_half(x) * sin)
