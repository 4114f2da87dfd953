"""Per-row end-of-generation checks: EOS, stop strings, max_tokens, context.

``RowDecoder`` keeps a row's generated tokens and its decoded text, and says
after each new token whether the row is finished and why.
"""

from __future__ import annotations

from collections.abc import Collection

from llm_operator.results import FinishReason
from llm_operator.sampling import SamplingParams


class RowDecoder:
    """Tracks one row's output.

    The returned text stops before the first stop string; token_ids keep every
    generated token (including the EOS or the token that completed a stop string).
    """

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        prompt_length: int,
        max_context: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self._cut_at_stop_string = False
        # the row may not grow past the model's context
        self.max_tokens = max(1, min(params.max_tokens, max_context - prompt_length))

    def append(self, token_id: int) -> bool:
        """Add a sampled token; True when the row is finished."""
        assert self.finish_reason is None, "append after the row finished"
        self.token_ids.append(token_id)
        if token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif self.params.stop and self._hit_stop_string():
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _hit_stop_string(self) -> bool:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # only the tail can hold a stop string that was not there before
        search_from = max(0, len(self.text) - max(len(s) for s in self.params.stop))
        cut = min(
            (i for i in (text.find(s, search_from) for s in self.params.stop) if i >= 0),
            default=-1,
        )
        self.text = text if cut < 0 else text[:cut]
        self._cut_at_stop_string = cut >= 0
        return cut >= 0

    def end_with(self, reason: str, text: str) -> None:
        """The engine that produced the tokens ended the row first, with this text."""
        self.finish_reason, self.text, self._cut_at_stop_string = reason, text, True

    def final_text(self) -> str:
        if self._cut_at_stop_string:
            return self.text
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
