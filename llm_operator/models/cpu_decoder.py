"""The native model's decoder layers in one compiled call per step (CPU, fp32/bf16).

Eagerly, a decode step of SmolLM2 makes ~330 calls from Python (per layer: two norms, four
linears, RoPE, the K/V store, attention, SiLU); at one row that host work was a quarter of
the step. ``CompiledDecoder`` hands the whole stack to ``decoder_forward`` in
``kernels/cpu_kernels.cpp``, which runs the same arithmetic (Hugging Face's roundings, the
packed GEMM, the paged attention) layer after layer without returning to Python. The
embedding lookup, the RoPE tables and the LM head stay in Python (once per step).

It runs a step only where the eager forward would have taken the same kernels: the
compiled CPU kernels are loaded, the attention is the compiled one (``AttentionStep`` of
implementation ``cpp``), the activation is SiLU, and the model's GEMM (``model.gemm``) takes
the packed kernel for every projection at this step's row count: always for the
batch-invariant ``InvariantGemm``; for the measured ``GemmChoice`` where it chose so
(elsewhere, e.g. oneDNN with AMX on a long bf16 prefill, the eager forward runs that step). ``LLM_OPERATOR_COMPILED_DECODER=0``
turns it off.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from llm_operator.kernels import AttentionStep, cpu_extension
from llm_operator.models.gemm import GemmChoice
from llm_operator.models.llama import LlamaModel

DECODER_ENV = "LLM_OPERATOR_COMPILED_DECODER"
# decoder_forward's per-layer tensors, in its order (kernels/cpu_kernels.cpp, LayerTensor)
LAYER_FIELDS = (
    "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
    "gate_up", "down",
)  # fmt: skip
# decoder_forward's timed kinds, in its order (TimedKind)
TIMED_KINDS = ("linear", "attention", "kv_store", "elementwise")


def requested() -> bool:
    """Whether ``LLM_OPERATOR_COMPILED_DECODER`` allows the compiled decoder (default on)."""
    return os.environ.get(DECODER_ENV, "").strip().lower() not in ("0", "off", "false")


class CompiledDecoder:
    """``model``'s layers as ``decoder_forward`` takes them (built once, after
    ``model.pack_weights()``); ``__call__`` runs a step, ``runs(rows, step)`` says whether
    it may (see the module docstring)."""

    def __init__(self, model: LlamaModel, gemm: GemmChoice | None = None) -> None:
        """gemm: whose choices decide where it runs (None: the model's, ``model.gemm``)."""
        self.model, self._gemm = model, gemm
        self.config = config = model.config
        empty = torch.empty(0, dtype=model.embed_tokens.weight.dtype)
        self.layers: list[Tensor] = []
        self.projections: list[tuple[Tensor, Tensor | None, bool]] = []
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
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                self.projections.append((linear.weight, linear.packed, linear.bias is not None))
        self.available = (
            requested()
            and cpu_extension.loaded() is not None
            and config.num_layers > 0
            and all(layer.fuse_activation for layer in model.layers)
            and not config.gemma  # Llama's layer structure only
            and not config.partial_rotary  # its RoPE rotates whole heads
            and config.attn_softcap is None
            and len(set(config.layer_windows)) == 1  # one attention layout for every layer
            and all(packed is not None for _, packed, _ in self.projections)
        )
        # (gemm, rows.bit_length()) -> all projections packed
        self._by_rows: dict[tuple[int, int], bool] = {}
        # the activations of a step, kept between steps (decoder_forward grows it)
        self.workspace = torch.empty(0, dtype=torch.uint8)

    @property
    def gemm(self) -> GemmChoice:
        return self.model.gemm if self._gemm is None else self._gemm

    def runs(self, rows: int, step: AttentionStep) -> bool:
        """Whether this step (``rows`` tokens, attention ``step``) may run compiled."""
        if not self.available or step.implementation != "cpp":
            return False
        gemm = self.gemm
        bucket = (id(gemm), rows.bit_length())
        known = self._by_rows.get(bucket)
        if known is not None:
            return known
        answers = [
            gemm.prefers_packed(rows, weight, packed, bias)
            for weight, packed, bias in self.projections
        ]
        if False in answers:
            self._by_rows[bucket] = False
        elif None not in answers:  # an unmeasured shape: the eager step measures it first
            self._by_rows[bucket] = True
        return self._by_rows.get(bucket, False)

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
