"""The native engine's own forward for Llama-family models: Llama, Qwen2, Qwen3, Mistral,
Phi-3, Gemma 2 and Gemma 3.

Token-packed: one forward takes the rows of many requests concatenated ([T]
input_ids and positions, no padding, no batch axis). The model knows nothing of
KV caches or pages: each layer hands its rotated q, k and v to the caller's
`attention` function, which stores K/V and attends however the engine wants.

Numerics follow Hugging Face (RMSNorm in fp32 cast back, rotate_half RoPE with
cos/sin from fp32, logits in the model dtype then float32). Two changes of layout
only: q/k/v and gate/up projections are fused into one matmul each at load time.
The elementwise work between the linear layers (norms, residual adds, q/k/v split,
RoPE, SiLU(gate) * up) runs as three regions per layer (models/fused.py), eagerly or as
Triton kernels (models/triton_ops.py), as the caller's ``ops`` says; on the CPU the engine
runs whole steps of Llama-structured models in C++ instead (models/cpu_decoder.py).

    family       q/k/v bias  o_proj bias  q/k RMSNorm  sliding window
    llama        config      config       -            -
    qwen2        yes         -            -            layer_types
    qwen3        config      config       per head     layer_types
    mistral      -           -            -            config.sliding_window (every layer)
    phi3         -           -            -            config.sliding_window (every layer)
    gemma2       config      config       -            layer_types
    gemma3_text  config      config       per head     layer_types

Phi-3's checkpoints hold qkv_proj and gate_up_proj already fused. Gemma ("gemma" below):
RMSNorms scale by (1 + weight) in fp32 (``GemmaNorm``), the attention and the MLP each have
a norm before and after them, the activation is GeGLU, the embedding is scaled by
sqrt(hidden_size) (rounded to the model dtype), the softmax scale is
query_pre_attn_scalar ** -0.5; Gemma 3 rotates sliding-window layers with a local base;
Gemma 2 soft-caps the attention scores (torch attention only) and the logits.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llm_operator.models import fused
from llm_operator.models.fused import FusedOps
from llm_operator.models.gemm import ATEN_GEMM, Gemm, pack_weight
from llm_operator.models.quant import unpack_rows
from llm_operator.models.rope import (
    RotaryEmbedding,
    apply_rotary,
    longrope_positions,
    per_layer_type,
    rope_inverse_frequencies,
    rope_type,
    rotary_dim,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# attention(layer_index, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim],
#           v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim]; q, k, v contiguous.
# With ``fused_store=True`` (the Triton regions and kernels) it must also have
# ``cache(layer) -> (k_cache, v_cache, slot_mapping)`` (the reference paged layout) and
# ``attend(layer, q) -> out``: a layer then stores k and v in the launch that rotates
# them (``ops.qkv_rope_store``) and calls ``attend`` (engine/native/step_builder.py
# ``LayerAttention``).
AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class NativeConfig:
    """The shape of a Llama-family model, as the native engine needs it.

    layer_windows: per layer, None when it attends to all earlier tokens, else its
    window w: a query at position p sees keys at positions > p - w (HF's sliding window).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    layer_windows: tuple[int | None, ...]
    max_position_embeddings: int
    hidden_act: str = "silu"
    gemma: bool = False  # Gemma's norms, GeGLU, scaled embedding (module docstring)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    local_rope: bool = False  # sliding-window layers have their own rope (Gemma 3)
    rotary_dim: int | None = None  # head dims RoPE rotates (None: all; Phi-4-mini: 3/4)
    # longrope: positions its short factors serve (the native engine keeps rows within)
    rope_positions: int | None = None

    @property
    def partial_rotary(self) -> bool:
        return self.rotary_dim is not None and self.rotary_dim < self.head_dim

    @property
    def scale(self) -> float:
        """Softmax scale of q.k: head_dim ** -0.5 unless the config says otherwise."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (one for all), or None without any."""
        windows = {w for w in self.layer_windows if w is not None}
        return max(windows) if windows else None


def native_config(hf_config: Any) -> NativeConfig:
    """Read a transformers config; ValueError for model types and features the engine lacks."""
    from transformers.activations import ACT2FN

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = ""
        if model_type == "gemma3":
            hint = " (the multimodal Gemma 3; its text model, model_type 'gemma3_text', runs)"
        raise ValueError(
            f"model_type={model_type!r} is not supported by the native engine{hint}; supported "
            f"model types: {SUPPORTED_MODEL_TYPES} (use backend='hf' for other models)"
        )
    gemma = model_type in GEMMA_TYPES
    local_rope = per_layer_type(hf_config)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    kinds = sorted(set(getattr(hf_config, "layer_types", None) or [])) if local_rope else [None]
    for kind in kinds:
        rope_type(hf_config, kind)  # raises for unsupported rope types
    rotary = {rotary_dim(hf_config, head_dim, kind) for kind in kinds}
    if len(rotary) != 1:
        raise ValueError(f"model_type={model_type!r}: rotary dims {sorted(rotary)} differ by layer")
    positions = {longrope_positions(hf_config, kind) for kind in kinds} - {None}
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"model_type={model_type!r} with mlp_bias=True is not supported")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(
            f"model_type={model_type!r} with use_bidirectional_attention=True (an encoder) is "
            "not supported by the native engine"
        )
    hidden_act = getattr(hf_config, "hidden_activation", None) if gemma else None
    hidden_act = hidden_act or hf_config.hidden_act
    if hidden_act not in ACT2FN:
        raise ValueError(f"hidden_act={hidden_act!r} is not a transformers activation")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of {num_kv_heads=}")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type in ("qwen2", "mistral", "phi3"):  # the config's value does not apply
        attention_bias = model_type == "qwen2"
    scalar = getattr(hf_config, "query_pre_attn_scalar", None) if gemma else None
    return NativeConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        layer_windows=_layer_windows(hf_config, model_type),
        max_position_embeddings=hf_config.max_position_embeddings,
        hidden_act=hidden_act,
        gemma=gemma,
        attention_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_softcap=_cap(getattr(hf_config, "attn_logit_softcapping", None)),
        final_softcap=_cap(getattr(hf_config, "final_logit_softcapping", None)),
        fused_checkpoint=model_type == "phi3",
        local_rope=local_rope,
        rotary_dim=rotary.pop(),
        rope_positions=min(positions) if positions else None,
    )


def _cap(value: Any) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def _layer_windows(hf_config: Any, model_type: str) -> tuple[int | None, ...]:
    layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if model_type == "llama" or window is None:
        return (None,) * layers
    if model_type in ("mistral", "phi3"):  # every layer slides
        return (int(window),) * layers
    # qwen2 / qwen3 (layers at index >= max_window_layers slide when use_sliding_window),
    # gemma2 / gemma3: per layer, as layer_types says
    layer_types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers)
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != layers:
        raise ValueError(
            f"model_type={model_type!r}: layer_types={sorted(set(layer_types))} for {layers} "
            "layers; the native engine runs full_attention and sliding_attention layers"
        )
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


class Linear(nn.Linear):
    """``nn.Linear`` through ``gemm`` (default ``F.linear``; ``LlamaModel.use_gemm`` sets the
    engine's); ``packed``: the weight packed for the compiled CPU kernel
    (``LlamaModel.pack_weights``)."""

    packed: Tensor | None = None
    gemm: Gemm = ATEN_GEMM

    def forward(self, x: Tensor) -> Tensor:
        return self.gemm(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    """HF's RMSNorm (``fused.rms_norm``): normalize in fp32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class GemmaNorm(RMSNorm):
    """Gemma's RMSNorm: normalize in fp32, times (1 + weight) in fp32, then cast back. The
    parameter holds 1 + weight in fp32, computed at load time from the weight in the model
    dtype (as HF computes it per call); in fp32 models that is ``fused.rms_norm``'s
    arithmetic with that weight, bit for bit, so the fused regions run it."""

    def forward(self, x: Tensor) -> Tensor:
        return gemma_norm(x, self.weight, self.eps)


def gemma_norm(x: Tensor, weight: Tensor, eps: float, ops: FusedOps = fused.EAGER_OPS) -> Tensor:
    """x [..., size] -> Gemma's RMSNorm with ``weight`` = 1 + w in fp32 (``GemmaNorm``)."""
    if x.dtype == torch.float32:
        return ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight).to(dtype)


def gemma_add_norm(
    hidden: Tensor, delta: Tensor, weight: Tensor, eps: float, ops: FusedOps
) -> tuple[Tensor, Tensor]:
    """(hidden + delta, gemma_norm(hidden + delta)): the residual add and the next norm."""
    if hidden.dtype == torch.float32:
        return ops.add_rms_norm(hidden, delta, weight, eps)
    hidden = hidden + delta
    return hidden, gemma_norm(hidden, weight, eps)


def _gemma_qkv_rope(qkv, cos, sin, q_norm, k_norm, eps, heads, kv_heads, dim):
    """``fused.qkv_rope`` with Gemma's q/k norms (``gemma_norm``), eagerly: (q, k, v)."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    if q_norm is not None and k_norm is not None:
        q, k = gemma_norm(q, q_norm, eps), gemma_norm(k, k_norm, eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q.contiguous(), k.contiguous(), v.reshape(tokens, kv_heads, dim).contiguous()


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU MLP, each with a residual add.

    The MLP's residual add is left to the caller, which fuses it with the next norm (the
    next layer's input norm, or the final norm): see ``forward``.
    """

    def __init__(self, config: NativeConfig, layer_index: int, hidden_act: str) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        hidden, dim, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * dim
        norm = GemmaNorm if config.gemma else RMSNorm
        self.input_layernorm = norm(hidden, eps)
        self.qkv_proj = Linear(hidden, qkv_size, bias=config.attention_bias)
        self.q_norm = norm(dim, eps) if config.qk_norm else None
        self.k_norm = norm(dim, eps) if config.qk_norm else None
        self.o_proj = Linear(config.num_heads * dim, hidden, bias=_has_o_proj_bias(config))
        self.post_attention_layernorm = norm(hidden, eps)
        if config.gemma:  # Gemma: the MLP's own pre-norm, and a norm after each block
            self.pre_feedforward_layernorm = norm(hidden, eps)
            self.post_feedforward_layernorm = norm(hidden, eps)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=False)
        self.act_fn = ACT2FN[hidden_act]
        self.fuse_activation = hidden_act == "silu"  # fused.silu_mul; eager act_fn otherwise

    def forward(
        self,
        hidden: Tensor,
        delta: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionFn,
        ops: FusedOps = fused.EAGER_OPS,
        fused_store: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``hidden + delta`` (``delta`` None: just ``hidden``).

        hidden, delta: [T, hidden_size]; cos, sin: [T, head_dim]; ``ops``: the elementwise
        regions; ``fused_store``: see ``AttentionFn``. Returns (residual stream after the attention block,
        the MLP's output), each [T, hidden_size]: the layer's output is their sum, which
        the caller forms inside its next norm (``ops.add_rms_norm``).
        """
        config = self.config
        gemma, tokens, eps = config.gemma, hidden.shape[0], config.rms_norm_eps
        norm = functools.partial(gemma_norm, ops=ops) if gemma else ops.rms_norm
        add_norm = functools.partial(gemma_add_norm, ops=ops) if gemma else ops.add_rms_norm
        if delta is None:  # the first layer: once per forward
            normed = norm(hidden, self.input_layernorm.weight, eps)
        else:
            hidden, normed = add_norm(hidden, delta, self.input_layernorm.weight, eps)
        qkv = self.qkv_proj(normed)  # [T, (heads + 2 * kv_heads) * dim]
        q_norm = None if self.q_norm is None else self.q_norm.weight
        k_norm = None if self.k_norm is None else self.k_norm.weight
        rope = (qkv, cos, sin, q_norm, k_norm, eps, *self.heads)
        if gemma and (hidden.dtype != torch.float32 or config.partial_rotary):
            q, k, v = _gemma_qkv_rope(*rope)  # Gemma's arithmetic, eagerly
            out = attention(self.layer_index, q, k, v)
        elif config.partial_rotary:  # the fused regions rotate whole heads: eagerly here
            q, k, v = fused.qkv_rope(*rope)
            out = attention(self.layer_index, q, k, v)
        elif fused_store and not gemma:
            # one launch splits qkv, rotates q and k and stores k, v in the paged cache
            q = ops.qkv_rope_store(*rope, *attention.cache(self.layer_index))[0]  # [T, heads, dim]
            out = attention.attend(self.layer_index, q)  # [T, heads, dim]
        else:
            q, k, v = ops.qkv_rope(*rope)  # q: [T, heads, dim]; k, v: [T, kv_heads, dim]
            out = attention(self.layer_index, q, k, v)  # [T, heads, dim]
        assert out.shape == q.shape, f"attention returned {tuple(out.shape)}, want {tuple(q.shape)}"
        attended = self.o_proj(out.reshape(tokens, config.num_heads * config.head_dim))
        if gemma:  # Gemma: norms after the attention and the MLP, and one before the MLP
            attended = norm(attended, self.post_attention_layernorm.weight, eps)
            mlp_norm = self.pre_feedforward_layernorm.weight
        else:
            mlp_norm = self.post_attention_layernorm.weight
        hidden, normed = add_norm(hidden, attended, mlp_norm, eps)
        mlp = self.down_proj(self._activate(self.gate_up_proj(normed), ops))  # [T, hidden]
        if gemma:
            mlp = norm(mlp, self.post_feedforward_layernorm.weight, eps)
        return hidden, mlp

    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv_proj, o_proj, gate_up_proj, down_proj."""
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def _activate(self, gate_up: Tensor, ops: FusedOps) -> Tensor:
        """gate_up [T, 2 * intermediate] -> act(gate) * up [T, intermediate]."""
        if self.fuse_activation:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _has_o_proj_bias(config: NativeConfig) -> bool:
    return config.attention_bias and config.model_type in ("llama", "qwen3")


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model.

    Build with `from_pretrained`; `forward` returns final-normed hidden states and
    `compute_logits` projects the rows the caller picks (e.g. each request's last).
    """

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = config = native_config(hf_config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, config.hidden_act) for index in range(config.num_layers)
        )
        norm = GemmaNorm if config.gemma else RMSNorm
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        def rotary(layer_type: str | None = None) -> RotaryEmbedding:
            return RotaryEmbedding(
                *rope_inverse_frequencies(hf_config, config.head_dim, layer_type)
            )

        local = config.local_rope  # per layer type: full attention's, and the sliding layers'
        self.rotary = rotary("full_attention" if local else None)
        self.local_rotary = rotary("sliding_attention") if local else None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, device: torch.device, dtype: torch.dtype
    ) -> LlamaModel:
        """Load config.json and the safetensors weights (single file or sharded) of `model_dir`."""
        from transformers import AutoConfig

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model_dir={str(model_dir)!r} is not a directory")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {SUPPORTED_DTYPES}")
        device = torch.device(device)
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with torch.device("meta"):
            model = cls(hf_config)
        state = _load_weights(model_dir, model.config, device, dtype)
        model.load_state_dict(state, strict=True, assign=True)
        model.generation_config = load_generation_config(model_dir)
        return model.to(device=device).eval().requires_grad_(False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionFn,
        ops: FusedOps = fused.EAGER_OPS,
        fused_store: bool = False,
    ) -> Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden_size].
        ``ops``: the elementwise regions (eager, or ``triton_ops.TRITON_OPS``);
        ``fused_store``: ``ops.qkv_rope_store`` stores K/V (see ``AttentionFn``)."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]"
        )
        config = self.config
        hidden = self.embed(input_ids)  # [T, hidden_size]
        cos, sin = self.rotary(positions, hidden.dtype)  # [T, head_dim] each
        local = None if self.local_rotary is None else self.local_rotary(positions, hidden.dtype)
        delta = None  # the last layer's MLP output, added inside the next norm
        for index, layer in enumerate(self.layers):
            slides = local is not None and config.layer_windows[index] is not None
            rope = local if slides else (cos, sin)
            hidden, delta = layer(hidden, delta, *rope, attention, ops, fused_store)
        if delta is None:  # no layers
            return self.norm(hidden)
        if config.gemma:
            return gemma_add_norm(hidden, delta, self.norm.weight, config.rms_norm_eps, ops)[1]
        return ops.add_rms_norm(hidden, delta, self.norm.weight, config.rms_norm_eps)[1]

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings [T, hidden_size] (Gemma: times sqrt(hidden_size) rounded to
        the model dtype, as HF scales them)."""
        if self.embed_packed is None:
            hidden = self.embed_tokens(input_ids)
        else:  # kept quantized (models.quant)
            hidden = unpack_rows(self.embed_packed, input_ids).to(self.norm.weight.dtype)
        if self.config.gemma:
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32 (matmul in the model
        dtype; soft-capped there where the config says, as HF does)."""
        logits = self.gemm(hidden, self.head_weight, None, self.head_packed)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @property
    def head_weight(self) -> Tensor:
        """The LM head's weight [vocab_size, hidden_size] (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    head_packed: Tensor | None = None
    embed_packed: Tensor | None = None  # the embedding table kept quantized (models.quant)
    quantization = None  # what models.quant.quantize_model did (None: float weights)
    gemm: Gemm = ATEN_GEMM  # the projections' and the head's (``use_gemm``)

    def named_linears(self) -> dict[str, Linear]:
        """Every projection by its module name ("layers.0.qkv_proj", ...)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    def weight_bytes(self) -> int:
        """The bytes the model's weights hold in memory: every parameter, packed copy and
        quantized table, each storage counted once."""
        tensors = [*self.parameters(), self.head_packed, self.embed_packed]
        tensors += [m.packed for m in self.modules() if isinstance(m, Linear)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t is not None}  # fmt: skip
        return sum(storages.values())

    def use_gemm(self, gemm: Gemm) -> None:
        """Run every projection and the head through ``gemm`` (``models.gemm``)."""
        self.gemm = gemm
        for module in self.modules():
            if isinstance(module, Linear):
                module.gemm = gemm

    def pack_weights(self) -> bool:
        """Pack every projection and the LM head for the compiled CPU GEMM
        (``gemm.pack_weight``); whether all of them could be (not where the kernels cannot
        run: not on the CPU, another dtype, kernels not loaded)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            if module.packed is None:  # (quantized ones are packed already)
                module.packed = pack_weight(module.weight)
        if self.head_packed is None:
            self.head_packed = pack_weight(self.head_weight)
        return self.head_packed is not None and all(m.packed is not None for m in linears)


def load_generation_config(model_dir: str | Path):
    """The directory's generation_config.json (EOS ids), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        return None


def _weight_sources(config: NativeConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF checkpoint tensors it is made of (concatenated on dim 0)."""
    sources: dict[str, tuple[str, ...]] = {
        "embed_tokens.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
    }
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    qkv = ("qkv",) if config.fused_checkpoint else ("q", "k", "v")  # Phi-3: stored fused
    gate_up = ("gate_up",) if config.fused_checkpoint else ("gate", "up")
    for index in range(config.num_layers):
        hf, ours = f"model.layers.{index}.", f"layers.{index}."
        attention = hf + "self_attn."
        for suffix in ["weight"] + (["bias"] if config.attention_bias else []):
            sources[f"{ours}qkv_proj.{suffix}"] = tuple(
                f"{attention}{n}_proj.{suffix}" for n in qkv
            )
        sources[ours + "o_proj.weight"] = (attention + "o_proj.weight",)
        if _has_o_proj_bias(config):
            sources[ours + "o_proj.bias"] = (attention + "o_proj.bias",)
        if config.qk_norm:
            sources[ours + "q_norm.weight"] = (attention + "q_norm.weight",)
            sources[ours + "k_norm.weight"] = (attention + "k_norm.weight",)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.gemma:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            sources[f"{ours}{norm}.weight"] = (f"{hf}{norm}.weight",)
        sources[ours + "gate_up_proj.weight"] = tuple(f"{hf}mlp.{n}_proj.weight" for n in gate_up)
        sources[ours + "down_proj.weight"] = (hf + "mlp.down_proj.weight",)
    return sources


def _load_weights(
    model_dir: Path, config: NativeConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, Tensor]:
    """Read, fuse and convert the weights one parameter at a time (CPU holds one at a time)."""
    from safetensors import safe_open

    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        file_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        file_names = ["model.safetensors"]
    else:
        raise ValueError(
            f"model_dir={str(model_dir)!r} has neither model.safetensors nor "
            f"model.safetensors.index.json"
        )
    state: dict[str, Tensor] = {}
    with ExitStack() as stack:
        handles = {}
        for file_name in file_names:
            handle = stack.enter_context(
                safe_open(str(model_dir / file_name), framework="pt", device="cpu")
            )
            handles.update(dict.fromkeys(handle.keys(), handle))
        for name, hf_names in _weight_sources(config).items():
            missing = [hf_name for hf_name in hf_names if hf_name not in handles]
            if missing:
                raise ValueError(
                    f"model_dir={str(model_dir)!r}: the checkpoint lacks {missing} "
                    f"(model_type={config.model_type!r})"
                )
            parts = [handles[hf_name].get_tensor(hf_name) for hf_name in hf_names]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            tensor = tensor.to(device=device, dtype=dtype)
            if config.gemma and name.endswith("norm.weight"):  # GemmaNorm holds 1 + w, fp32
                tensor = 1.0 + tensor.float()
            state[name] = tensor
    return state
