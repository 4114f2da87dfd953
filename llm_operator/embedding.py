"""Embeddings: one vector per row, pooled from the model's last hidden states.

``LLMOperator.embed(prompts, pooling=..., normalize=..., dimensions=...)`` plans the rows
as ``generate`` does (the prefix tree over every row; identical rows computed once) and
runs them on a backend that pools instead of sampling:

- ``native`` (decoder models with causal attention: Llama, Qwen 2/3, Mistral, ...): each
  shared segment is prefilled once and each row computes only its own tokens
  (``engine.native.embed``). A row's vector pools over all of its tokens: its last
  token's hidden state (``"last"``), their mean (``"mean"``: each segment's hidden states
  are summed once, and every row under it adds that sum), or its first token's
  (``"cls"``).
- ``hf``: ``transformers.AutoModel`` on batches of rows sorted by length
  (``engine.hf.embed``): encoders (BERT-style, bidirectional) and anything else.

Then ``dimensions`` keeps the first that many values (Matryoshka truncation) and
``normalize`` scales each vector to unit L2 norm, in that order. Each vector equals the
one ``AutoModel`` gives for that row alone, pooled the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # this module imports torch only in the functions that compute
    import torch

POOLINGS = ("last", "mean", "cls")


class EmbeddingResult(NamedTuple):
    """One input row's vector (None where the row could not run: ``error`` says why)."""

    embedding: list[float] | None
    prompt_tokens: int
    error: str | None = None

    @property
    def is_error(self) -> bool:
        return self.embedding is None


def check_embedding_options(
    pooling: str = "last", normalize: bool = True, dimensions: int | None = None
) -> tuple[str, bool, int | None]:
    """The options checked (ValueError or TypeError naming the one at fault)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {normalize!r}")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise TypeError(f"dimensions must be a positive integer or None, got {dimensions!r}")
        if dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {dimensions}")
    return pooling, normalize, dimensions


def hidden_size(model_config) -> int:
    text = (
        model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    )
    return int(text.hidden_size)


def finish_vectors(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[rows, hidden] pooled float32 -> [rows, dimensions or hidden]: truncated, then L2
    normalized (a zero vector stays zero)."""
    import torch

    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
    return vectors


def pool_padded(hidden: torch.Tensor, lengths: Sequence[int], pooling: str) -> torch.Tensor:
    """[rows, width, hidden] right-padded last hidden states -> [rows, hidden] float32."""
    import torch

    hidden = hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    index = torch.as_tensor(lengths, device=hidden.device)
    if pooling == "last":
        return hidden[torch.arange(len(lengths), device=hidden.device), index - 1]
    width = hidden.shape[1]
    mask = torch.arange(width, device=hidden.device)[None, :] < index[:, None]
    return (hidden * mask[..., None]).sum(1) / index[:, None].to(hidden.dtype)


def embed(
    op: Any,
    prompts: Sequence[Any],
    pooling: str = "last",
    normalize: bool = True,
    dimensions: int | None = None,
) -> list[EmbeddingResult]:
    """``LLMOperator.embed`` (``op``): prepare and plan the rows, run the plan on the
    operator's embedder, and give each input row its vector or its error."""
    import torch

    from llm_operator.progress import ProgressBar
    from llm_operator.results import RunStats
    from llm_operator.sampling import SamplingParams

    pooling, normalize, dimensions = check_embedding_options(pooling, normalize, dimensions)
    width = hidden_size(op.model_config)
    if dimensions is not None and dimensions > width:
        raise ValueError(f"dimensions={dimensions} is more than the model's {width} values")
    started = time.perf_counter()
    prepared = op.prepare(prompts, SamplingParams(max_tokens=1))  # one budgeted, none sampled
    plan, valid = op._plan(prepared.token_ids, prepared.params)
    results = [
        EmbeddingResult(None, 0, prepared.errors.get(row, "the row could not be prepared"))
        for row in range(len(prepared.token_ids))
    ]
    vectors: dict[int, torch.Tensor] = {}
    failed: dict[int, str] = {}
    computed = 0
    embed_started = time.perf_counter()
    embedder = op.embedder() if plan.requests else None
    if embedder is not None:
        with ProgressBar(plan.stats.rows, enabled=op.config.progress) as bar:

            def progress(request_ids: Sequence[int]) -> None:
                bar.update(sum(len(plan.requests[r].rows) for r in request_ids), 0)

            vectors, failed, computed = embedder.embed(plan, pooling, progress)
    embed_seconds = time.perf_counter() - embed_started
    done = [request for request in plan.requests if request.request_id in vectors]
    stacked = [vectors[request.request_id].detach().float().cpu() for request in done]
    finished = finish_vectors(
        torch.stack(stacked) if stacked else torch.zeros((0, width)), dimensions, normalize
    ).tolist()
    for request, vector in zip(done, finished):
        for plan_row in request.rows:
            results[valid[plan_row]] = EmbeddingResult(vector, len(request.token_ids))
    for request in plan.requests:
        message = failed.get(request.request_id)
        if message is not None:
            for plan_row in request.rows:
                results[valid[plan_row]] = EmbeddingResult(None, len(request.token_ids), message)
    stats = plan.stats
    paths = getattr(embedder, "paths", None)
    op.last_stats = RunStats(
        rows=len(results),
        error_rows=sum(result.is_error for result in results),
        requests=stats.requests,
        prompt_tokens=stats.prompt_tokens,
        unique_prompt_tokens=stats.unique_tokens,
        planned_prefill_tokens=stats.prefill_tokens,
        prefill_tokens_computed=computed,
        groups=len(plan.groups),
        saving_ratio=1 - computed / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        tokenize_seconds=prepared.seconds,
        generate_seconds=embed_seconds,
        seconds=time.perf_counter() - started,
        backend=getattr(embedder, "name", op.backend_name),
        engine_paths=paths.describe() if paths is not None else "",
    )
    return results
