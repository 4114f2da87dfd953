"""Global prefix planner (BatchLLM): shared token segments, prefix groups, decode-first order.

Pure Python + numpy; it sees token ids only, never a tokenizer or a model.
"""

from __future__ import annotations

from llm_operator.planner.builder import build_plan
from llm_operator.planner.plan import Plan, PlannedRequest, PlanStats, PrefixGroup, Segment

__all__ = ["Plan", "PlanStats", "PlannedRequest", "PrefixGroup", "Segment", "build_plan"]
