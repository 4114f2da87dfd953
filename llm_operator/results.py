"""What ``LLMOperator.generate`` returns per row, and the run's statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple

FinishReason = Literal["stop", "length", "error"]
"""Why a row ended: "stop" (EOS or a stop string), "length" (max_tokens or the model's
context), "error" (the row could not run)."""


class GenerationResult(NamedTuple):
    """One input row's output (``finish_reason``: see ``FinishReason``; "error": see ``error``)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprob: float | None = None
    """With ``logprobs=True``: the log-probability of token_ids under the unconstrained model."""
    choice_logprobs: dict[str, float] | None = None
    """With ``choices`` and ``logprobs=True``: each choice's log-probability after the prompt."""

    @property
    def is_error(self) -> bool:
        """The row could not run."""
        return self.finish_reason == "error"

    @property
    def is_invalid(self) -> bool:
        """The row ran, but its constrained output was cut before it was valid (``error``
        says why; the text is kept)."""
        return self.finish_reason != "error" and self.error is not None

    @classmethod
    def failed(cls, message: str, prompt_tokens: int = 0) -> GenerationResult:
        return cls("", (), "error", prompt_tokens, 0, message)

    @classmethod
    def of(cls, output, prompt_tokens: int) -> GenerationResult:
        """The row's result from its request's ``RequestOutput``."""
        return cls(
            output.text,
            output.token_ids,
            output.finish_reason,
            prompt_tokens,
            len(output.token_ids),
            output.error,
            output.logprob,
        )


@dataclass
class RunStats:
    """Counters of one ``generate`` call (``LLMOperator.last_stats``)."""

    rows: int = 0
    error_rows: int = 0
    invalid_rows: int = 0  # constrained rows cut before their output was valid (max_tokens)
    requests: int = 0
    prompt_tokens: int = 0
    unique_prompt_tokens: int = 0
    planned_prefill_tokens: int = 0
    prefill_tokens_computed: int = 0
    output_tokens: int = 0
    # output tokens appended without sampling (jump-forward: a decided choice's tail, a
    # lone allowed token, a grammar's forced text); fed to the model with the row's next step
    forced_tokens: int = 0
    groups: int = 0
    saving_ratio: float = 0.0
    plan_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    generate_seconds: float = 0.0
    seconds: float = 0.0
    backend: str = ""
    engine_paths: str = ""  # how the engine ran its steps, where it says (EnginePaths.describe)
    # a model server's own counts (backend openai; 0 elsewhere): the prompt tokens it was
    # sent, those its prefix cache held, the tokens it generated
    server_prompt_tokens: int = 0
    server_cached_tokens: int = 0
    server_completion_tokens: int = 0

    @classmethod
    def of(cls, plan_stats, outputs, results, **timings) -> RunStats:
        """Counters of one call: the plan's statistics, the backend's counts, the rows."""
        return cls(
            rows=len(results),
            error_rows=sum(r.is_error for r in results),
            invalid_rows=sum(r.is_invalid for r in results),
            requests=plan_stats.requests,
            prompt_tokens=plan_stats.prompt_tokens,
            unique_prompt_tokens=plan_stats.unique_tokens,
            planned_prefill_tokens=plan_stats.prefill_tokens,
            prefill_tokens_computed=outputs.prefill_tokens_computed,
            output_tokens=outputs.output_tokens,
            groups=plan_stats.groups,
            saving_ratio=plan_stats.saving_ratio,
            plan_seconds=plan_stats.seconds,
            **{f"server_{name}": count for name, count in (outputs.usage or {}).items()},
            **timings,
        )

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rows_per_second"] = self.rows_per_second
        d["output_tokens_per_second"] = self.output_tokens_per_second
        return d
