"""The backend contract: what a backend offers and what a run of a plan returns.

A backend (``hf``, ``native``, ``vllm``, ``openai``) is a step runner: ``backend.start(run)`` gives its
``Steps`` for one run (both protocols live in ``engine.run``, beside ``Run``), and
``engine.run.run_plan`` calls ``steps.step()`` until it returns False, then
``steps.close()``. One ``RequestOutput`` per planned request, indexed by ``request_id``;
the ``Run`` of ``engine.run`` collects them (the backends step, the run records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from llm_operator.results import FinishReason


class RequestOutput(NamedTuple):
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    error: str | None = None
    logprob: float | None = None  # with logprobs=True: sum over token_ids, unconstrained


class BackendResult(NamedTuple):
    outputs: list[RequestOutput]  # indexed by request_id
    prefill_tokens_computed: int  # prompt tokens run through the model (no padding)
    output_tokens: int
    # a model server's counts (backend openai): prompt_tokens, cached_tokens, completion_tokens
    usage: dict[str, int] | None = None


# progress(finished_rows, new_output_tokens): rows are input rows (a merged request counts each)
ProgressCallback = Callable[[int, int], None]
