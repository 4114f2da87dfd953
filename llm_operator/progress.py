"""A progress bar for long runs: rows done and output tokens per second."""

from __future__ import annotations

import time


class ProgressBar:
    """tqdm when enabled, nothing otherwise. ``update(finished, new_tokens)``."""

    def __init__(self, total: int, *, enabled: bool, description: str = "generate") -> None:
        self.enabled = enabled and total > 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._last_postfix = 0.0
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm

            # smoothing=0: rate and ETA from the average since the start (rows finish in
            # bursts under decode-first order, which an moving average turns into wild ETAs)
            self._bar = tqdm(
                total=total,
                desc=description,
                unit="row",
                dynamic_ncols=True,
                smoothing=0,
                mininterval=0.5,
            )

    def update(self, finished: int, new_tokens: int) -> None:
        if self._bar is None:
            return
        self.tokens += new_tokens
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:  # the token rate shown with the next redraw
            self._last_postfix = now
            self._bar.set_postfix_str(self._rate(now), refresh=False)
        if finished:
            self._bar.update(finished)

    def _rate(self, now: float) -> str:
        return f"{self.tokens / max(now - self.started, 1e-9):.1f} tok/s"

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._rate(time.perf_counter()), refresh=True)
            self._bar.close()
