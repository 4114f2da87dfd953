"""Embeddings on ``transformers.AutoModel`` (the ``hf`` backend's embedder).

Rows are sorted by length and cut into batches of at most ``max_batch_size`` rows and
``prefill_batch_tokens`` padded tokens, so a batch pads little; each batch is right
padded with an attention mask, and the last hidden states are pooled per row
(``embedding.pool_padded``). Encoders (BERT-style, bidirectional attention) embed here;
so does any decoder, without prefix sharing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_operator.config import EngineConfig
from llm_operator.embedding import pool_padded

DEFAULT_BATCH_TOKENS = 4096
DEFAULT_BATCH_ROWS = 64


class HFEmbedder:
    """``AutoModel`` in inference mode on one device."""

    name = "hf"

    def __init__(self, path, config: EngineConfig, pad_token_id: int | None = None) -> None:
        from transformers import AutoModel

        from llm_operator.models import resolve_device, resolve_dtype

        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = AutoModel.from_pretrained(
            path,
            dtype=self.dtype,
            trust_remote_code=config.trust_remote_code,
            local_files_only=True,
        ).to(self.device)
        self.model.eval()
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.batch_rows = config.max_batch_size or DEFAULT_BATCH_ROWS
        self.batch_tokens = config.prefill_batch_tokens or DEFAULT_BATCH_TOKENS

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices in batches: shortest first, each within the row and token budgets."""
        order = sorted(range(len(lengths)), key=lambda row: lengths[row])
        batches: list[list[int]] = []
        current: list[int] = []
        for row in order:
            width = lengths[row]  # the longest so far: rows come shortest first
            if current and (
                len(current) + 1 > self.batch_rows or (len(current) + 1) * width > self.batch_tokens
            ):
                batches.append(current)
                current = []
            current.append(row)
        if current:
            batches.append(current)
        return batches

    def embed(self, plan, pooling: str, progress=None):
        """(vector by request id, {} (no row fails here), tokens computed) of ``plan``'s
        requests, each run whole (nothing shared)."""
        requests = plan.requests
        pooled = self.embed_rows([request.token_ids for request in requests], pooling)
        if progress is not None:
            progress([request.request_id for request in requests])
        vectors = {request.request_id: vector for request, vector in zip(requests, pooled)}
        return vectors, {}, sum(len(request.token_ids) for request in requests)

    @torch.inference_mode()
    def embed_rows(
        self, token_ids: Sequence[Sequence[int]], pooling: str, progress=None
    ) -> list[torch.Tensor]:
        """One pooled float32 vector per row of ``token_ids``, in their order."""
        lengths = [len(ids) for ids in token_ids]
        vectors: list[torch.Tensor | None] = [None] * len(token_ids)
        for batch in self.batches(lengths):
            width = max(lengths[row] for row in batch)
            ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for index, row in enumerate(batch):
                ids[index, : lengths[row]] = torch.as_tensor(token_ids[row])
                mask[index, : lengths[row]] = 1
            out = self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).last_hidden_state
            pooled = pool_padded(out, [lengths[row] for row in batch], pooling)
            for index, row in enumerate(batch):
                vectors[row] = pooled[index]
            if progress is not None:
                progress(len(batch))
        return vectors  # type: ignore[return-value]
