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

            self._bar = tqdm(total=total, desc=description, unit="row", dynamic_ncols=True)

    def update(self, finished: int, new_tokens: int) -> None:
        if self._bar is None:
            return
        self.tokens += new_tokens
        if finished:
            self._bar.update(finished)
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            rate = self.tokens / max(now - self.started, 1e-9)
            self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
