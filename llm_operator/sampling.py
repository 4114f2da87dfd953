"""Sampling parameters: how to pick each next token, and when to stop.

Importing this module imports neither torch nor xgrammar (a Spark or Dask driver builds
``SamplingParams`` without them); the sampler itself is ``llm_operator.engine.sampler``.
"""

from __future__ import annotations

from llm_operator.options import options_dataclass

CONSTRAINTS = ("choices", "regex", "json_schema")


@options_dataclass("sampling")
class SamplingParams:
    """How to pick each next token, and when to stop (declared in ``llm_operator.options``)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, object] | None:
        """("choices" | "regex" | "json_schema", its value), or None when unconstrained."""
        for name in CONSTRAINTS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    def _check(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of choices, regex and json_schema; got {' and '.join(given)}"
            )
