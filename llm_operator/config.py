"""Engine configuration: frozen, validated on construction."""

from __future__ import annotations

import os

from llm_operator.options import BACKENDS, options_dataclass, parse_memory_size

__all__ = ["BACKENDS", "EngineConfig", "parse_memory_size", "physical_memory_bytes"]


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
