"""Where a native iteration's time goes, kind of work by kind of work (opt-in, for the bench).

With ``profile_ops=True`` (an engine option), a ``NativeBackend`` times every
linear layer (the LM head included), the attention, the K/V store, the elementwise regions
(norms, RoPE, SiLU) and the sampling of each iteration, and lists them in
``last_profile.ops``, one ``{kind: seconds}`` dict per iteration beside
``last_profile.steps``. ``host`` is what is left of the iteration: Python and dispatch
between the ops, the scheduler and the step's metadata. Timing costs about a microsecond
per op, so it stays off unless asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from llm_operator.models.fused import FusedOps

KINDS = ("linear", "attention", "kv_store", "elementwise", "sampling", "host")


class OpProfile:
    """Accumulates seconds by kind for the current iteration (``begin`` .. ``end``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self._started: list[float] = []

    def begin(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def end(self, iteration_seconds: float) -> dict[str, float]:
        """This iteration's split; ``host`` gets what the timed kinds leave of it."""
        timed = sum(v for k, v in self.seconds.items() if k != "host")
        self.seconds["host"] = max(0.0, iteration_seconds - timed)
        return dict(self.seconds)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds

    def timed(self, kind: str, function: Callable) -> Callable:
        """``function`` with its calls' seconds added to ``kind``."""

        def run(*args: Any, **kwargs: Any):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - started

        return run

    def watch_linears(self, model: nn.Module, linear_type: type) -> None:
        """Time every ``linear_type`` module of ``model`` (forward hooks)."""

        def before(module: nn.Module, inputs: Any) -> None:
            self._started.append(time.perf_counter())

        def after(module: nn.Module, inputs: Any, output: Any) -> None:
            self.seconds["linear"] += time.perf_counter() - self._started.pop()

        for module in model.modules():
            if isinstance(module, linear_type):
                module.register_forward_pre_hook(before)
                module.register_forward_hook(after)


class TimedOps(FusedOps):
    """``ops``'s elementwise regions, each call's seconds added to ``profile``'s
    ``elementwise``."""

    def __init__(self, ops: FusedOps, profile: OpProfile) -> None:
        self.ops, self.profile = ops, profile

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.profile.timed("elementwise", self.ops.rms_norm)(x, weight, eps)

    def add_rms_norm(self, hidden: Tensor, delta: Tensor, weight: Tensor, eps: float):
        return self.profile.timed("elementwise", self.ops.add_rms_norm)(hidden, delta, weight, eps)

    def qkv_rope(self, *args: Any):
        return self.profile.timed("elementwise", self.ops.qkv_rope)(*args)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self.profile.timed("elementwise", self.ops.silu_mul)(gate_up)
