"""What one model iteration costs: its features, and a linear model of its seconds.

An iteration computes some tokens (decodes, prefill chunks) and samples some rows. Its
seconds are modelled as a sum over ``FEATURES``, each with a non-negative coefficient
fitted to measured runs on this machine (``CostModel.fit``):

    seconds = c_iteration                                 fixed: weights streamed once, host work
            + c_token             * tokens computed         linear layers, norms, K/V store
            + c_first_tokens      * min(tokens, 1024)       what small batches pay more a token
            + c_sampled           * rows sampled            output head and sampler
            + c_chunk             * chunks (sequences)      per-sequence attention and metadata
            + c_prefill_attention * prefill (query, key) pairs
            + c_decode_own        * decode rows' own keys   (prompt suffix and output)
            + c_decode_shared     * decode rows' shared-prefix keys

A decode step of B rows is ``c_iteration + B * (c_token + c_sampled + c_chunk + keys...)``:
the memory-bound floor plus what each row adds; a prefill chunk of T tokens is dominated
by ``T * c_token`` (compute-bound) and its attention.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

FEATURES = (
    "iterations",
    "tokens",
    "first_tokens",
    "sampled",
    "chunks",
    "prefill_attention",
    "decode_own_keys",
    "decode_shared_keys",
)
"""The features of an iteration, in the order of feature vectors."""


def chunk_features(
    start: int, length: int, prefix_length: int, *, sample: bool, decode: bool
) -> tuple[float, ...]:
    """Features of one scheduled chunk (without the per-iteration 1): its own tokens
    ``start .. start+length`` after ``prefix_length`` shared tokens; a query at own position
    ``i`` attends to ``prefix_length + i + 1`` keys. A decode row's keys are split into its
    own and the shared prefix's (which the native engine reads once for all its rows)."""
    sampled = 1.0 if sample else 0.0
    if decode:
        return (0.0, float(length), 0.0, sampled, 1.0, 0.0, start + 1.0, float(prefix_length))
    pairs = length * (prefix_length + start) + length * (length + 1) / 2
    return (0.0, float(length), 0.0, sampled, 1.0, pairs, 0.0, 0.0)


FIRST_TOKENS = 1024
"""An iteration's first this many tokens may cost more each than the rest (``first_tokens``):
some GEMMs (bf16 on a CPU) run faster per row the more rows they get."""


def iteration_total(chunks: list[tuple[float, ...]]) -> list[float]:
    """An iteration's features: its chunks' summed, with the per-iteration 1 and
    ``first_tokens`` (its tokens up to ``FIRST_TOKENS``)."""
    total = [sum(column) for column in zip(*chunks)] or [0.0] * len(FEATURES)
    total[0] = 1.0
    total[2] = min(total[1], FIRST_TOKENS)
    return total


@dataclass(frozen=True)
class CostModel:
    """Seconds of an iteration as a linear function of ``FEATURES`` (coefficients >= 0)."""

    coefficients: tuple[float, ...]  # seconds per unit of each feature, in ``FEATURES`` order
    relative_error: float = 0.0  # median |predicted - measured| / measured over the fitted runs

    def seconds(self, features: Sequence[float]) -> float:
        """Predicted seconds of an iteration (or of a sum of iterations' features)."""
        return sum(c * f for c, f in zip(self.coefficients, features))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))

    @classmethod
    def from_dict(cls, values: Mapping[str, float], relative_error: float = 0.0) -> CostModel:
        return cls(tuple(float(values[name]) for name in FEATURES), float(relative_error))

    @classmethod
    def fit(
        cls,
        rows: Sequence[Sequence[float]],
        seconds: Sequence[float],
        features: Iterable[str] | None = None,
    ) -> CostModel:
        """Non-negative least squares of ``seconds`` on the feature ``rows``, each row's
        residual relative to its own seconds (so short decode steps count as much as long
        prefill chunks). ``features``: the ones fitted (default all; the others get 0)."""
        import torch

        if len(rows) != len(seconds) or not rows:
            raise ValueError(
                f"need one measured seconds per feature row, got {len(rows)} rows and {len(seconds)} seconds"
            )
        x = torch.tensor([list(map(float, row)) for row in rows], dtype=torch.float64)
        y = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
        w = 1 / y.clamp_min(1e-6).sqrt()
        allowed = set(FEATURES if features is None else features)
        active = [
            k for k in range(x.shape[1]) if FEATURES[k] in allowed and bool((x[:, k] != 0).any())
        ]
        coefficients = torch.zeros(x.shape[1], dtype=torch.float64)
        while active:  # drop the most negative coefficient and refit until none is negative
            scale = x[:, active].abs().amax(dim=0).clamp_min(1e-12)  # conditioning
            a = x[:, active] / scale * w[:, None]
            solution = torch.linalg.lstsq(a, (y * w)[:, None]).solution[:, 0] / scale
            if bool((solution >= 0).all()):
                coefficients[active] = solution
                break
            del active[int(torch.argmin(solution))]
        predicted = x @ coefficients
        errors = ((predicted - y).abs() / y.clamp_min(1e-6)).tolist()
        return cls(tuple(coefficients.tolist()), float(statistics.median(errors)))
