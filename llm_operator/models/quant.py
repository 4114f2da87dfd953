"""Quantized linears: weights kept in groups of 32 along the input features, multiplied by
the compiled CPU kernel with int8 dot products (``kernels/cpu_kernels.cpp``, "quantized
linear", which documents the packed layout and the arithmetic).

A group holds unsigned quants ``q`` (4 or 8 bits) and an fp16 ``scale`` and ``min`` per
output row: ``w = scale * q + min``. Where they come from:

    GGUF Q4_0, Q4_1, Q8_0    4 / 4 / 8 bits, exactly the file's values
    GGUF Q5_0, Q5_1          8 bits (the 5-bit quants as they are), exactly
    GGUF Q4_K                4 bits; each 32-group's scale d * sc and min dmin * m rounded
                             to fp16 (relative error below 2^-11 of the group's step)
    other GGUF types, and    8 bits, quantized here from the weights: scale max|w| / 127,
    float weights ("int8")   q = round(w / scale) + 128, min -128 * scale

``quantize_model`` replaces a loaded model's projections, LM head and (from a GGUF) its
embedding table by these packed tensors and frees their float copies; the engine then
runs every projection through ``packed_linear``, which reads the packed dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

GROUP = 32  # weights per group along the input features
LANES = 16  # output rows per packed block (the kernel's)
# GGUF types kept as they are (the rest are quantized to 8 bits from their values)
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KEPT_TYPES = EXACT_TYPES + ("Q4_K",)
FLOAT_TYPES = ("F32", "F16", "BF16")


class Quantized(NamedTuple):
    """One weight [N, K] as groups: w[n, k] = scale[n, k // 32] * q[n, k] + minimum[...]."""

    q: Tensor  # uint8 [N, K]
    scale: Tensor  # float16 [N, K // 32]
    minimum: Tensor  # float16 [N, K // 32]
    bits: int  # 4 or 8: the quants' range (4: 0..15)
    source: str  # what it was made from ("Q4_1", "int8", ...)

    def rows(self, index: Tensor) -> Quantized:
        return Quantized(self.q[index], self.scale[index], self.minimum[index], *self[3:])

    def dequantize(self) -> Tensor:
        """fp32 [N, K]: scale * q + min (the GGUF reference's arithmetic: exact there)."""
        groups = self.q.float().view(self.q.shape[0], -1, GROUP)
        values = self.scale.float()[..., None] * groups + self.minimum.float()[..., None]
        return values.view(self.q.shape)


def concat(parts: list[Quantized]) -> Quantized:
    """The parts' rows stacked (4-bit parts widen to 8 bits where others are 8: exact)."""
    bits = max(part.bits for part in parts)
    sources = sorted({part.source for part in parts})
    return Quantized(
        torch.cat([part.q for part in parts]),
        torch.cat([part.scale for part in parts]),
        torch.cat([part.minimum for part in parts]),
        bits,
        "+".join(sources),
    )


def quantize_int8(weight: Tensor) -> Quantized:
    """A float weight [N, K] (K a multiple of 32) quantized to 8 bits per group of 32:
    scale = max|w| / 127 in fp16, q = round(w / scale) + 128, min = -128 * scale."""
    w = weight.detach().float().view(weight.shape[0], -1, GROUP)
    scale = (w.abs().amax(dim=2) / 127).half()
    divisor = scale.float()[..., None]
    q = torch.where(divisor > 0, torch.round(w / divisor.clamp_min(1e-30)), 0.0)
    q = (q.clamp(-127, 127) + 128).to(torch.uint8).view(weight.shape)
    return Quantized(q, scale, (scale.float() * -128).half(), 8, "int8")


def pack(weight: Quantized) -> Tensor:
    """The kernel's layout: uint8 [ceil(N / 16), K / 32, 256 or 512 quant bytes + 64]."""
    q, scale, minimum = weight.q, weight.scale, weight.minimum
    n, k = q.shape
    blocks, groups = -(-n // LANES), k // GROUP
    pad = blocks * LANES - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, groups)])
        minimum = torch.cat([minimum, minimum.new_zeros(pad, groups)])
    q = q.view(blocks, LANES, groups, GROUP)
    if weight.bits == 4:  # chunk c, byte 4j + b: q[j][8c + b] | q[j][8c + 4 + b] << 4
        q = q.view(blocks, LANES, groups, 4, 2, 4)
        quants = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    else:  # chunk r, byte 4j + b: q[j][4r + b]
        quants = q.view(blocks, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)
    quants = quants.reshape(blocks, groups, -1)

    def per_group(values: Tensor) -> Tensor:  # fp16 [blocks * 16, groups] -> bytes
        return values.view(blocks, LANES, groups).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([quants, per_group(scale), per_group(minimum)], dim=2).contiguous()


def packed_bits(packed: Tensor) -> int:
    return 4 if packed.shape[2] == 256 + 64 else 8


def unpack_rows(packed: Tensor, rows: Tensor) -> Tensor:
    """fp32 [len(rows), K]: the dequantized rows (output features) `rows` of a packed
    weight (the embedding lookup of a quantized table; exact as ``Quantized.dequantize``)."""
    blocks, groups, _ = packed.shape
    quant_bytes = packed.shape[2] - 64
    data = packed[rows // LANES]  # [T, groups, bytes]
    lane = (rows % LANES).view(-1, 1, 1, 1)
    count = rows.shape[0]
    quants = data[..., :quant_bytes].view(count, groups, -1, LANES, 4)  # chunk, j, b
    mine = quants.gather(3, lane.unsqueeze(-1).expand(-1, groups, quants.shape[2], 1, 4))
    mine = mine.squeeze(3)  # [T, groups, chunks, 4]
    if packed_bits(packed) == 4:
        q = torch.stack([mine & 15, mine >> 4], dim=3)  # [T, groups, 4, 2, 4]
    else:
        q = mine
    q = q.reshape(count, groups, GROUP).float()

    def per_group(offset: int) -> Tensor:
        values = data[..., offset : offset + 32].contiguous().view(torch.float16)  # [T, g, 16]
        return values.gather(2, lane.view(-1, 1, 1).expand(-1, groups, 1)).float()

    values = per_group(quant_bytes) * q + per_group(quant_bytes + 32)
    return values.view(count, groups * GROUP)


# ---------------------------------------------------------------- GGUF blocks


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _low_high(nibbles: np.ndarray) -> np.ndarray:
    """qs [n, 16] -> q [n, 32]: elements 0..15 the low nibbles, 16..31 the high ones."""
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=1)


def _fifth_bits(blocks: np.ndarray, offset: int) -> np.ndarray:
    """Q5: the 32 high bits (little-endian uint32 at ``offset``) as [n, 32] of 0/16."""
    high = blocks[:, offset : offset + 4].copy().view(np.uint32)[:, 0]
    return (((high[:, None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def decode_gguf_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> Quantized:
    """A GGUF tensor's raw blocks (uint8 [n, bytes per row]) of a kept type, as groups."""
    groups = n * k // GROUP
    if type_name == "Q4_K":
        return _decode_q4_k(data.reshape(-1, 144), n, k)
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
    blocks = data.reshape(groups, sizes[type_name])
    d = _half(blocks, 0)
    if type_name == "Q4_0":
        q, bits, minimum = _low_high(blocks[:, 2:18]), 4, -8 * d
    elif type_name == "Q4_1":
        q, bits, minimum = _low_high(blocks[:, 4:20]), 4, _half(blocks, 2)
    elif type_name == "Q5_0":
        q, bits, minimum = _low_high(blocks[:, 6:22]) | _fifth_bits(blocks, 2), 8, -16 * d
    elif type_name == "Q5_1":
        q, bits, minimum = _low_high(blocks[:, 8:24]) | _fifth_bits(blocks, 4), 8, _half(blocks, 2)
    else:  # Q8_0: signed int8 quants
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, minimum = 8, -128 * d
    return Quantized(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).view(n, k),
        torch.from_numpy(d.astype(np.float16)).view(n, k // GROUP),
        torch.from_numpy(minimum.astype(np.float16)).view(n, k // GROUP),
        bits,
        type_name,
    )


def _decode_q4_k(blocks: np.ndarray, n: int, k: int) -> Quantized:
    """Q4_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales and mins, 128 of quants)
    as 8 groups of 32 each."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    packed = blocks[:, 4:16].astype(np.uint8)
    scales = np.empty((len(blocks), 8), np.float32)
    mins = np.empty((len(blocks), 8), np.float32)
    for j in range(8):
        if j < 4:
            sc, m = packed[:, j] & 63, packed[:, j + 4] & 63
        else:
            sc = (packed[:, j + 4] & 15) | ((packed[:, j - 4] >> 6) << 4)
            m = (packed[:, j + 4] >> 4) | ((packed[:, j] >> 6) << 4)
        scales[:, j], mins[:, j] = d * sc, -(dmin * m)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # pairs of groups: low nibbles, then high
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    return Quantized(
        torch.from_numpy(np.ascontiguousarray(q)).view(n, k),
        torch.from_numpy(scales.astype(np.float16)).view(n, k // GROUP),
        torch.from_numpy(mins.astype(np.float16)).view(n, k // GROUP),
        4,
        "Q4_K",
    )


def read_gguf_weight(tensor) -> Quantized | None:
    """A GGUF reader tensor [N, K] as groups: kept types as they are, other quantized types
    quantized to 8 bits from their values; None for float tensors (they stay float)."""
    from gguf import quants

    type_name = tensor.tensor_type.name
    k, n = (int(size) for size in tensor.shape[:2])
    if type_name in FLOAT_TYPES or k % GROUP:
        return None
    if type_name in KEPT_TYPES:
        return decode_gguf_blocks(np.asarray(tensor.data), type_name, n, k)
    values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    result = quantize_int8(torch.from_numpy(np.ascontiguousarray(values, np.float32)).view(n, k))
    return result._replace(source=f"{type_name}->int8")


# ---------------------------------------------------------------- the model


class ModelQuantization(NamedTuple):
    """What ``quantize_model`` did: e.g. "gguf Q4_1+Q8_0" or "int8"; the packed bytes."""

    mode: str
    description: str
    packed_bytes: int


def _reverse_permutation(rows: int, heads: int) -> Tensor:
    """GGUF (llama.cpp) stores Llama's q/k rows interleaved per head for its RoPE; HF row i
    is GGUF row perm[i]."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _match(part: Quantized, reference: Tensor, heads: int | None, name: str) -> Quantized:
    """``part``'s rows in ``reference``'s order (checked against the float weight the model
    loaded from the converted checkpoint): as stored, or un-interleaved (q/k, ``heads``)."""
    scale = reference.float().abs().max().clamp_min(1e-30)
    candidates = [part]
    if heads is not None and part.q.shape[0] % (2 * heads) == 0:
        candidates.append(part.rows(_reverse_permutation(part.q.shape[0], heads)))
    errors = [float((c.dequantize() - reference.float()).abs().max() / scale) for c in candidates]
    best = min(range(len(candidates)), key=errors.__getitem__)
    limit = 0.0 if part.source in EXACT_TYPES and reference.dtype == torch.float32 else 0.02
    if errors[best] > limit:
        raise ValueError(
            f"GGUF tensor {name} does not match the converted checkpoint's weight (max "
            f"relative error {errors[best]:.3g}, allowed {limit:g})"
        )
    return candidates[best]


def _freed(weight: Tensor) -> torch.nn.Parameter:
    """A stand-in for a packed weight: its shape and dtype, no storage."""
    stand_in = torch.zeros(1, 1, dtype=weight.dtype).expand(weight.shape)
    return torch.nn.Parameter(stand_in, requires_grad=False)


PACKED_FORMAT = "q32v1"  # the packed layout's version, in the cache file's name


def quantize_model(
    model, mode: str, gguf_path: Path | None, cache_dir: Path | None = None
) -> ModelQuantization:
    """Pack ``model``'s projections and LM head quantized (``mode`` "gguf": the GGUF file's
    own blocks, checked against the loaded weights; "int8": every weight quantized here)
    and free their float copies. From a GGUF, the embedding table is kept quantized too
    (``model.embed_packed``, looked up by ``unpack_rows``), and the packed tensors are
    cached in ``cache_dir``/quantized (read once from the file, which is slow to parse).
    ValueError where the file's tensors do not match the model."""
    linears = model.named_linears()
    if mode == "gguf":
        packed, sources = _gguf_packed(model, gguf_path, cache_dir)
    else:
        weights = {
            name: quantize_int8(module.weight)
            for name, module in linears.items()
            if module.weight.shape[1] % GROUP == 0
        }
        if model.config.hidden_size % GROUP == 0:
            weights["head"] = quantize_int8(model.head_weight)
        packed = {name: pack(weight) for name, weight in weights.items()}
        sources = {name: weight.source for name, weight in weights.items()}
    for name, module in linears.items():
        if name in packed:
            module.packed = packed[name]
            module.weight = _freed(module.weight)
    if "head" in packed:
        model.head_packed = packed["head"]
        if model.lm_head is not None:
            model.lm_head.weight = _freed(model.lm_head.weight)
    if "embed" in sources:  # from a GGUF: the table stays quantized (tied: the head's)
        model.embed_packed = packed.get("embed", model.head_packed)
        model.embed_tokens.weight = _freed(model.embed_tokens.weight)
    total = sum(tensor.nbytes for tensor in packed.values())
    kinds = sorted({part for source in sources.values() for part in source.split("+")})
    description = ("gguf " if mode == "gguf" else "") + "+".join(kinds)
    logger.info("quantized linears (%s): %.1f MB packed", description, total / 1e6)
    return ModelQuantization(mode, description, total)


def _gguf_packed(
    model, gguf_path: Path | None, cache_dir: Path | None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(name -> packed tensor, name -> its GGUF type) of the GGUF's weights; built once
    per file into ``cache_dir``/quantized (a tied embedding is the head: "embed" is then
    only in the sources)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from llm_operator.models.gguf import ensure_writable_cache, gguf_fingerprint, publish_once

    if gguf_path is None:
        raise ValueError("quantization='gguf' needs a GGUF model (an alias or a .gguf file)")

    def build() -> tuple[dict[str, Tensor], dict[str, str]]:
        weights = _gguf_weights(model, gguf_path)
        tied = weights.get("embed") is not None and weights.get("embed") is weights.get("head")
        packed = {name: pack(w) for name, w in weights.items() if not (tied and name == "embed")}
        return packed, {name: w.source for name, w in weights.items()}

    if cache_dir is None:
        return build()
    target = (
        Path(cache_dir) / "quantized"
        / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}-{PACKED_FORMAT}.safetensors"
    )  # fmt: skip
    if not target.is_file():
        try:
            ensure_writable_cache(Path(cache_dir))
        except OSError as error:
            logger.warning("not caching the packed weights: %s", error)
            return build()

        def write(folder: Path) -> Path:
            packed, sources = build()
            path = folder / target.name
            save_file(packed, str(path), metadata=sources)
            path.chmod(0o644)
            return path

        publish_once(target, Path.is_file, write)
    with safe_open(str(target), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata() or {}


def _gguf_weights(model, gguf_path: Path) -> dict[str, Quantized]:
    """Our module name -> its weight from the GGUF file (q, k, v and gate, up concatenated
    as the model fuses them; "head" and "embed" for the LM head and the embedding)."""
    from gguf import GGUFReader

    config = model.config
    tensors = {tensor.name: tensor for tensor in GGUFReader(str(gguf_path)).tensors}

    def read(name: str) -> Quantized | None:
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(
                f"{gguf_path}: no tensor {name!r} for model_type {config.model_type!r}"
            )
        return read_gguf_weight(tensor)

    weights: dict[str, Quantized] = {}
    for index, layer in enumerate(model.layers):
        blk, ours = f"blk.{index}.", f"layers.{index}."
        fused = {
            "qkv_proj": [("attn_q", config.num_heads), ("attn_k", config.num_kv_heads),
                         ("attn_v", None)],
            "o_proj": [("attn_output", None)],
            "gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
            "down_proj": [("ffn_down", None)],
        }  # fmt: skip
        if config.fused_checkpoint:  # Phi-3: stored fused
            fused["qkv_proj"] = [("attn_qkv", None)]
            fused["gate_up_proj"] = [("ffn_up", None)]
        for module_name, parts in fused.items():
            module = getattr(layer, module_name)
            read_parts = [read(blk + part + ".weight") for part, _ in parts]
            if any(part is None for part in read_parts):
                continue  # a float tensor: the module stays float
            offset, matched = 0, []
            for (part_name, heads), part in zip(parts, read_parts, strict=True):
                rows = part.q.shape[0]
                reference = module.weight[offset : offset + rows]
                matched.append(_match(part, reference, heads, blk + part_name))
                offset += rows
            if offset != module.weight.shape[0]:
                raise ValueError(f"{gguf_path}: {blk}{module_name} rows do not match the model")
            weights[ours + module_name] = concat(matched)
    embed = read("token_embd.weight")
    if embed is not None:
        weights["embed"] = _match(embed, model.embed_tokens.weight, None, "token_embd")
    if model.lm_head is None:
        if embed is not None:
            weights["head"] = weights["embed"]
    elif "output.weight" in tensors and (head := read("output.weight")) is not None:
        weights["head"] = _match(head, model.lm_head.weight, None, "output")
    return weights
