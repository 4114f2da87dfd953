"""What a run of a plan returns.

One ``RequestOutput`` per planned request, indexed by ``request_id``; the ``Run`` of
``engine.run`` collects them (the backends step, the run records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class RequestOutput(NamedTuple):
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    logprob: float | None = None  # with logprobs=True: sum over token_ids, unconstrained


class BackendResult(NamedTuple):
    outputs: list[RequestOutput]  # indexed by request_id
    prefill_tokens_computed: int  # prompt tokens run through the model (no padding)
    output_tokens: int


# progress(finished_rows, new_output_tokens): rows are input rows (a merged request counts each)
ProgressCallback = Callable[[int, int], None]
