"""Engine configuration: frozen, validated on construction."""

from __future__ import annotations

import os
import re

from llm_operator.options import BACKENDS, options_dataclass

__all__ = ["BACKENDS", "EngineConfig", "parse_memory_size", "physical_memory_bytes"]
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


@options_dataclass("engine")
class EngineConfig:
    """Options of one ``LLMOperator`` (declared in ``llm_operator.options``)."""

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_memory_size(self.kv_cache_memory)
