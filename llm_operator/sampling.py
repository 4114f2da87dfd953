"""Sampling parameters and the per-row token sampler.

A seeded row draws from its own ``torch.Generator`` whose seed derives from the
row's seed and its prompt, so it samples the same tokens whatever batch,
partition or retry it runs in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    max_tokens: most tokens to generate (>= 1).
    temperature: 0 is greedy; otherwise logits are divided by it.
    top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
    top_k: keep the k most likely tokens; 0 keeps every token.
    stop: strings that end generation; the returned text stops before them.
    seed: makes sampling reproducible per row (None: not reproducible).
    ignore_eos: keep generating past the end-of-sequence token.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=0)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def row_seed(seed: int, prompt_token_ids: Sequence[int], occurrence: int = 0) -> int:
    """The generator seed of one row: a hash of the base seed, the prompt and
    which occurrence of that prompt (within one call) the row is."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(str(seed).encode())
    digest.update(b"|")
    digest.update(str(occurrence).encode())
    digest.update(b"|")
    digest.update(",".join(map(str, prompt_token_ids)).encode())
    return int.from_bytes(digest.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row.

    logits: [rows, vocab] (any float dtype; computed in fp32).
    Returns token ids: [rows] (int64, on the CPU).
    """
    # logits: [rows, vocab]
    logits = logits.float()
    rows = logits.shape[0]
    assert len(params) == rows and len(generators) == rows, (
        "one SamplingParams and generator per row"
    )
    out = torch.argmax(logits, dim=-1).cpu()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        out[row] = _sample_row(logits[row], p, generators[row])
    return out


def _sample_row(
    row_logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
) -> int:
    # row_logits: [vocab]
    scores = (row_logits / p.temperature).cpu()
    if p.top_k > 0 and p.top_k < scores.shape[0]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop_sorted = (cumulative - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator).item())
