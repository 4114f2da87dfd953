"""What every backend takes and returns.

A backend runs a planner ``Plan``: ``requests[i]`` of the plan gets
``params[i]`` and ``generators[i]``; the backend returns one
``RequestOutput`` per planned request, indexed by ``request_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from llm_operator.planner import Plan
from llm_operator.sampling import SamplingParams


class RequestOutput(NamedTuple):
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None


class BackendResult(NamedTuple):
    outputs: list[RequestOutput]  # indexed by request_id
    prefill_tokens_computed: int  # prompt tokens run through the model (no padding)
    output_tokens: int


# progress(finished_rows, new_output_tokens): rows are input rows (a merged request counts each)
ProgressCallback = Callable[[int, int], None]


class Backend(Protocol):
    name: str
    max_context: int

    def run(
        self,
        plan: Plan,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        progress: ProgressCallback | None = None,
    ) -> BackendResult: ...
