"""The per-row token sampler.

A seeded row draws from its own ``torch.Generator`` whose seed derives from the
row's seed and its prompt, so it samples the same tokens whatever batch,
partition or retry it runs in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from llm_operator.sampling import SamplingParams


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
