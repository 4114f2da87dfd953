"""llm-operator: LLM batch inference over dataframes with global prefix sharing.

Importing the package is cheap: torch and transformers load with the first
``LLMOperator``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["EngineConfig", "GenerationResult", "LLMOperator", "RunStats", "SamplingParams"]
__version__ = "0.1.0"

_LOCATIONS = {
    "EngineConfig": "llm_operator.config",
    "GenerationResult": "llm_operator.results",
    "RunStats": "llm_operator.results",
    "LLMOperator": "llm_operator.operator",
    "SamplingParams": "llm_operator.sampling",
}

if TYPE_CHECKING:
    from llm_operator.config import EngineConfig
    from llm_operator.operator import LLMOperator
    from llm_operator.results import GenerationResult, RunStats
    from llm_operator.sampling import SamplingParams


def __getattr__(name: str):
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'llm_operator' has no attribute {name!r}")
