"""The per-row token sampler.

A seeded row samples by Gumbel-max: each step's noise is a hash of the row's seed
(derived from its seed and its prompt), the step and the token id (``row_step_key``,
``gumbel_noise``), so it samples the same tokens whatever batch, partition, device or
retry it runs in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from llm_operator.sampling import SamplingParams


def row_seed(seed: int, prompt_token_ids: Sequence[int], occurrence: int = 0) -> int:
    """The generator seed of one row: a hash of the base seed, the prompt and
    which occurrence of that prompt (within one call) the row is."""
    text = f"{seed}|{occurrence}|{','.join(map(str, prompt_token_ids))}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


# -- batched sampling on the logits' device ---------------------------------------------
# A sampled row takes argmax(logits / temperature + Gumbel noise) over the tokens its top_k
# and top_p keep: a draw from that distribution. The noise of (row, step, token) is a hash
# of the row's seed, its step and the token id (31-bit integer mixing in int64, exact on
# every device), so a row's draw depends on nothing else: not its batch, not the device's
# random state, and every row of a step samples in a handful of kernels with no host loop.
_MASK31 = (1 << 31) - 1
_MIX = 0x45D9F3B  # < 2**27: a 31-bit value times it stays below 2**58 in int64


def _mix(x):
    """A 31-bit integer hash of a Python int or, element-wise, an int64 tensor."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK31
    x = (((x >> 16) ^ x) * _MIX) & _MASK31
    return (x >> 16) ^ x


def row_step_key(seed: int, step: int) -> int:
    """The 31-bit key of a row's ``step``-th draw (``step``: tokens generated so far)."""
    return _mix((seed & _MASK31) ^ _mix(((seed >> 31) & _MASK31) ^ _mix(step & _MASK31)))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [rows] int64 (``row_step_key``) -> Gumbel(0, 1) noise [rows, vocab] float32 on
    ``keys``' device: each token's uniform draw is a hash of its row's key and its id."""
    index = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix(keys[:, None] ^ index[None, :])  # [rows, vocab], 31-bit
    uniform = ((x >> 7).to(torch.float32) + 0.5) * 2.0**-24  # 24 bits: exact, in (0, 1)
    return -torch.log(-torch.log(uniform))


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int | None],
) -> torch.Tensor:
    """One token per row, on the logits' device, without a host sync.

    logits: [rows, vocab] (any float dtype; computed in fp32).
    params: each row's sampling; greedy rows (``params.greedy``) take the argmax.
    keys:   each sampled row's ``row_step_key`` (None for greedy rows).
    Returns token ids [rows] int64 on logits' device.
    """
    rows = logits.shape[0]
    assert len(params) == rows and len(keys) == rows, "one SamplingParams and key per row"
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    device = logits.device
    index = torch.tensor(sampled, device=device)
    chosen = [params[row] for row in sampled]
    temperature = torch.tensor([p.temperature for p in chosen], device=device)
    scores = logits[index] / temperature[:, None]  # [sampled, vocab]
    top_k = [p.top_k if 0 < p.top_k < scores.shape[1] else 0 for p in chosen]
    if any(top_k):
        kth = torch.topk(scores, max(top_k), dim=-1).values  # [sampled, max k] descending
        k = torch.tensor(top_k, device=device)
        threshold = kth.gather(1, (k - 1).clamp(min=0)[:, None])  # [sampled, 1]
        threshold = torch.where(k[:, None] > 0, threshold, float("-inf"))
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    top_p = [p.top_p for p in chosen]
    if min(top_p) < 1.0:
        probs = torch.softmax(scores, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        limit = torch.tensor(top_p, device=device)[:, None]
        drop_sorted = (cumulative - sorted_probs) >= limit
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    noise = gumbel_noise(
        torch.tensor([keys[row] for row in sampled], device=device), scores.shape[1]
    )
    tokens[index] = torch.argmax(scores + noise, dim=-1)
    return tokens
