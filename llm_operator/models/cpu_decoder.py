"""The native model's decoder layers in one compiled call per step (CPU, fp32/bf16).

``CompiledDecoder`` hands the whole stack to ``decoder_forward`` in
``kernels/cpu_kernels.cpp``, which runs the eager forward's arithmetic (Hugging Face's
roundings, the packed GEMM, the paged attention) layer after layer without returning to
Python. The embedding lookup, the RoPE tables and the LM head stay in Python.

The engine runs it where the eager forward would take the same kernels
(``engine.factory.native_paths`` decides, with ``unsupported``): the compiled CPU kernels
run the attention (``AttentionStep`` of implementation ``cpp``) and every projection (the
packed GEMM), and the model has Llama's layer structure (SiLU, whole-head RoPE, one
attention layout for every layer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm_operator.kernels import AttentionStep
from llm_operator.models.llama import LlamaModel

# decoder_forward's per-layer tensors, in its order (kernels/cpu_kernels.cpp, LayerTensor)
LAYER_FIELDS = (
    "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
    "gate_up", "down",
)  # fmt: skip
# decoder_forward's timed kinds, in its order (TimedKind)
TIMED_KINDS = ("linear", "attention", "kv_store", "elementwise")


def unsupported(model: LlamaModel) -> str | None:
    """Why ``decoder_forward`` cannot run ``model``'s layers (None: it can; it also needs
    every projection packed, ``model.pack_weights``)."""
    config = model.config
    if config.num_layers == 0:
        return "no layers"
    if config.gemma:
        return "Gemma's layer structure"
    if config.partial_rotary:
        return "partial rotary embeddings"
    if config.attn_softcap is not None:
        return "soft-capped attention"
    if not all(layer.fuse_activation for layer in model.layers):
        return f"the {config.hidden_act} activation"
    if len(set(config.layer_windows)) != 1:
        return "layers with different attention windows"
    return None


class CompiledDecoder:
    """``model``'s layers as ``decoder_forward`` takes them (built once, after
    ``model.pack_weights()``, where ``unsupported(model)`` is None); ``__call__`` runs a
    step."""

    def __init__(self, model: LlamaModel) -> None:
        assert unsupported(model) is None, unsupported(model)
        linears = [linear for layer in model.layers for linear in layer.projections()]
        assert all(linear.packed is not None for linear in linears), "pack_weights() first"
        self.model = model
        self.config = model.config
        empty = torch.empty(0, dtype=model.embed_tokens.weight.dtype)
        self.layers: list[Tensor] = []
        for layer in model.layers:
            tensors = {
                "input_norm": layer.input_layernorm.weight,
                "qkv": layer.qkv_proj.packed,
                "qkv_bias": layer.qkv_proj.bias,
                "q_norm": None if layer.q_norm is None else layer.q_norm.weight,
                "k_norm": None if layer.k_norm is None else layer.k_norm.weight,
                "o_proj": layer.o_proj.packed,
                "o_bias": layer.o_proj.bias,
                "post_norm": layer.post_attention_layernorm.weight,
                "gate_up": layer.gate_up_proj.packed,
                "down": layer.down_proj.packed,
            }
            self.layers += [empty if tensors[f] is None else tensors[f] for f in LAYER_FIELDS]
        # the activations of a step, kept between steps (decoder_forward grows it)
        self.workspace = torch.empty(0, dtype=torch.uint8)

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        step: AttentionStep,
        k_caches: list[Tensor],
        v_caches: list[Tensor],
        seconds: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, hidden_size], as
        ``LlamaModel.forward`` returns it; stores the step's K/V in the caches. ``seconds``:
        float64 [4] accumulating (linear, attention, kv_store, elementwise) seconds."""
        model, config = self.model, self.config
        hidden = model.embed(input_ids)  # [T, hidden_size]
        cos, sin = model.rotary(positions, hidden.dtype)  # [T, head_dim] each
        work = step.work
        return step.module.decoder_forward(
            hidden, cos.contiguous(), sin.contiguous(), self.layers, model.norm.weight,
            k_caches, v_caches, step.slot_mapping, work.tables, work.items, work.item_rows,
            work.item_first,
            config.num_heads, config.num_kv_heads, config.intermediate_size, config.rms_norm_eps,
            config.scale,
            step.split_keys,
            torch.empty(0, dtype=torch.float64) if seconds is None else seconds,
            self.workspace,
        )  # fmt: skip
