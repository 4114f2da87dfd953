"""Embeddings on vLLM's pooling runner (the ``vllm`` backend's embedder).

``vllm.LLM(runner="pooling", pooler_config=PoolerConfig(seq_pooling_type=..., use_activation=False))``
pools the last hidden states per row; ``use_activation=False`` keeps them raw (no
normalization), so the operator truncates and normalizes them itself as for the other
backends. The rows go to ``LLM.embed`` as token ids in plan order, so rows that share a
prefix come one after the other.

vLLM fixes the pooling type when the engine starts, and caches prefixes only for causal
models with ``"last"`` pooling (full blocks): with ``"mean"`` or ``"cls"`` every row is
computed whole. One engine is kept, for the pooling of the last call; another pooling
starts a new one. Rows longer than the engine's ``max_model_len`` become error rows.
Tokens computed: each row's prompt tokens less vLLM's ``num_cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llm_operator.config import EngineConfig
from llm_operator.engine.vllm.driver import (
    CPU_BLOCK_SIZE,
    CPU_MAX_BATCHED_TOKENS,
    GPU_MAX_BATCHED_TOKENS,
    VLLMEngine,
    engine_max_model_len,
    llm_kwargs,
    require_vllm,
    start_engine,
    tokens_prompt,
)

POOLING_TYPES = {"last": "LAST", "mean": "MEAN", "cls": "CLS"}


def pooler_config(pooling: str) -> Any:
    """vLLM's ``PoolerConfig`` for our pooling name, without normalization."""
    from vllm.config import PoolerConfig

    return PoolerConfig(seq_pooling_type=POOLING_TYPES[pooling], use_activation=False)


def pooling_kwargs(
    model_path: str,
    config: EngineConfig,
    pooling: str,
    *,
    max_context: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` embedding with ``pooling``: the pooling runner,
    our dtype (fp32 on CPU), the KV budget, 32-token blocks on CPU, prefix caching where
    vLLM supports it (``"last"``), then ``config.vllm_options``; ``max_model_len`` fitted
    to ``max_context`` and the KV budget unless the options fix it."""
    from llm_operator.engine.vllm.driver import on_cpu

    cpu = on_cpu()
    options: dict[str, Any] = {
        "runner": "pooling",
        "pooler_config": pooler_config(pooling),
        # vLLM caches prefixes of causal "last" pooling only; elsewhere it would warn
        "enable_prefix_caching": pooling == "last",
        "max_num_batched_tokens": CPU_MAX_BATCHED_TOKENS if cpu else GPU_MAX_BATCHED_TOKENS,
    }
    if cpu:
        options["block_size"] = CPU_BLOCK_SIZE
    if config.max_batch_size is not None:
        options["max_num_seqs"] = int(config.max_batch_size)
    kwargs = llm_kwargs(
        model_path,
        dtype=config.dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        trust_remote_code=config.trust_remote_code,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        gpu_share=config.gpu_share,
        batch_job=False,
        options={**options, **dict(config.vllm_options)},
    )
    if kwargs.get("max_model_len") is None and max_context is not None:
        kwargs["max_model_len"] = engine_max_model_len(
            model_path, kwargs, max_context=max_context, trust_remote_code=config.trust_remote_code
        )
    return kwargs


class VLLMEmbedder:
    """Embeds plans on ``vllm.LLM``'s pooling runner (started on first use)."""

    name = "vllm"

    def __init__(self, path, config: EngineConfig, *, max_context: int | None = None) -> None:
        """config: its ``dtype``, ``kv_cache_memory``, ``max_batch_size`` (vLLM's
        ``max_num_seqs``), ``trust_remote_code``, parallel sizes, ``gpu_share`` and
        ``vllm_options`` apply. max_context: the model's context (caps ``max_model_len``)."""
        require_vllm()
        self.model_path = str(path)
        self.config = config
        self.max_context = max_context
        self._engine: VLLMEngine | None = None
        self._pooling: str | None = None
        self.engine_builds = 0
        self.last_profile: dict[str, Any] = {}

    def engine_options(self, pooling: str) -> dict[str, Any]:
        return pooling_kwargs(self.model_path, self.config, pooling, max_context=self.max_context)

    def engine(self, pooling: str) -> VLLMEngine:
        """The engine for ``pooling``: the one kept, or a new one (the old one closed)."""
        if self._engine is not None and self._pooling != pooling:
            self.close()
        if self._engine is None:
            self._engine = start_engine(self.engine_options(pooling))
            self._pooling = pooling
            self.engine_builds += 1
        return self._engine

    @property
    def llm(self):
        """The ``vllm.LLM`` once started, else None."""
        return None if self._engine is None else self._engine.llm

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            self._pooling = None

    def embed(
        self, plan, pooling: str, progress=None
    ) -> tuple[dict[int, torch.Tensor], dict[int, str], int]:
        """(vector by request id, error message by request id, prompt tokens computed) of
        ``plan``'s requests, pooled by vLLM in plan order (vectors neither truncated nor
        normalized)."""
        engine = self.engine(pooling)
        limit = engine.max_model_len
        if self.max_context is not None:
            limit = min(limit, self.max_context)
        failed: dict[int, str] = {}
        runnable = []
        for request in plan.requests:
            if len(request.token_ids) > limit:
                failed[request.request_id] = (
                    f"vLLM rejected the row: {len(request.token_ids)} prompt tokens, more than "
                    f"the engine's max_model_len {limit}"
                )
            else:
                runnable.append(request)
        vectors: dict[int, torch.Tensor] = {}
        computed = 0
        cached = 0
        if runnable:
            outputs = self.embed_token_ids([r.token_ids for r in runnable], engine)
            for request, output in zip(runnable, outputs):
                vectors[request.request_id] = torch.as_tensor(
                    output.outputs.embedding, dtype=torch.float32
                )
                hit = int(output.num_cached_tokens or 0)
                cached += hit
                computed += len(request.token_ids) - hit
        if progress is not None:
            progress([request.request_id for request in plan.requests])
        self.last_profile = {
            "requests": len(runnable),
            "cached_tokens": cached,
            "rejected": len(failed),
            "prefix_caching": bool(
                engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            ),
        }
        return vectors, failed, computed

    def embed_token_ids(self, token_ids: Sequence[Sequence[int]], engine: VLLMEngine | None = None):
        """vLLM's ``EmbeddingRequestOutput`` per row of ``token_ids``, in their order."""
        from vllm import PoolingParams

        engine = engine or self.engine(self._pooling or "last")
        outputs = engine.llm.embed(
            [tokens_prompt(ids) for ids in token_ids],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=False,
        )
        assert len(outputs) == len(token_ids), f"{len(outputs)} outputs for {len(token_ids)} rows"
        return outputs
