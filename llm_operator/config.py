"""Engine configuration: frozen, validated on construction."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "hf", "native", "vllm")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_size(value: int | str, *, name: str = "kv_cache_memory") -> int | None:
    """Bytes from an int or a string such as "2GiB" or "512 MB"; None for "auto"."""
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be a number of bytes, a size such as '2GiB', or 'auto'; got {value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", text)
        if match:
            number = float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
            if number >= 1:
                return int(number)
    raise ValueError(
        f"{name} must be a number of bytes, a size such as '2GiB', or 'auto'; got {value!r}"
    )


def physical_memory_bytes() -> int:
    """Installed RAM (falls back to 8 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


@dataclass(frozen=True)
class EngineConfig:
    """Options of one ``LLMOperator``.

    backend: "auto" (native for Llama, Qwen2, Qwen3 and Mistral, hf otherwise), "hf"
        (transformers' forward), "native" (our own forward over a paged KV cache with
        pinned prefixes), "vllm" (vLLM's engine fed in plan order; needs the vllm
        package; "auto" never picks it).
    kv_cache_memory: bytes (or "2GiB") the KV cache may hold at once; "auto"
        takes a quarter of RAM on CPU (at most 8 GiB) or 80% of free GPU memory.
    max_batch_size: most rows decoding at once.
    prefill_batch_tokens: most (padded) tokens in one prefill forward pass (hf); most
        tokens in one iteration, decodes included (native).
    kv_block_size: tokens per KV block of the native backend's paged cache.
    min_shared_tokens: shortest prefix worth sharing between rows.
    share_prefixes / decode_first: the planner's optimizations (off for ablations).
    token_batching: native: new requests join the running batch in the iteration their
        KV blocks free (BATON); off (an ablation), requests run in waves of
        max_batch_size and a wave starts once the previous one has ended.
    vllm_options: keyword arguments for ``vllm.LLM`` (backend "vllm"), over the
        backend's batch defaults; given as a mapping, kept as sorted (name, value) pairs
        so the config stays hashable (values must be hashable too).
    """

    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | str = "auto"
    max_batch_size: int = 256
    prefill_batch_tokens: int = 4096
    kv_block_size: int = 16
    min_shared_tokens: int = 4
    share_prefixes: bool = True
    decode_first: bool = True
    token_batching: bool = True
    trust_remote_code: bool = False
    progress: bool = False
    vllm_options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        object.__setattr__(self, "vllm_options", _option_items(self.vllm_options))
        parse_memory_size(self.kv_cache_memory)
        for name in (
            "max_batch_size",
            "prefill_batch_tokens",
            "kv_block_size",
            "min_shared_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        for name in (
            "share_prefixes",
            "decode_first",
            "token_batching",
            "trust_remote_code",
            "progress",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_memory_size(self.kv_cache_memory)


def _option_items(options) -> tuple[tuple[str, Any], ...]:
    """vllm_options as sorted (name, value) pairs, from a mapping or such pairs."""
    if options is None:
        return ()
    try:
        items = dict(options)
    except (TypeError, ValueError):
        raise TypeError(
            f"vllm_options must be a mapping of vllm.LLM keyword arguments, got {options!r}"
        ) from None
    for name in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"vllm_options names must be keyword names, got {name!r}")
    return tuple(sorted(items.items()))
