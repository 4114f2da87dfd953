"""What the engine needs to know about a model, read once from its configs.

``ModelInfo``: the context length, the EOS ids that end a row, and whether the native
engine can run the architecture. Every backend and the prompt checks take these from
here instead of reading the configs again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

DEFAULT_CONTEXT = 2048  # when neither the config nor the tokenizer says


class ModelInfo(NamedTuple):
    path: Path
    config: Any  # transformers PretrainedConfig
    max_context: int  # tokens a row may span: prompt + generated
    eos_token_ids: frozenset[int]
    native_unsupported: str | None  # why backend="native" cannot run it (None: it can)
    # tokens a row may span on the native engine: max_context, or less where its rope is
    # exact only within a shorter length (longrope's short factors)
    native_max_context: int
    gguf: Path | None = None  # the GGUF file the model was converted from, if any


def read_model_info(
    path: Path, tokenizer, *, trust_remote_code: bool = False, gguf: Path | None = None
) -> ModelInfo:
    from transformers import AutoConfig

    from llm_operator.models.llama import load_generation_config

    config = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    max_context = model_context_length(config, tokenizer)
    unsupported, native_max_context = _native_support(config, max_context)
    eos = eos_token_ids(load_generation_config(path), tokenizer)
    return ModelInfo(Path(path), config, max_context, eos, unsupported, native_max_context, gguf)


def model_context_length(config, tokenizer) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**7:
        return limit
    return DEFAULT_CONTEXT


def eos_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """EOS ids of every backend: the generation config's (if any), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _native_support(config, max_context: int) -> tuple[str | None, int]:
    """(why backend="native" cannot run the model, or None; the context it runs rows to)."""
    from llm_operator.models.llama import native_config

    try:
        native = native_config(config)
    except ValueError as error:
        return str(error), max_context
    return None, min(max_context, native.rope_positions or max_context)


def open_model(model, config) -> tuple[Any, Any, ModelInfo]:
    """(the resolved model, its tokenizer, its ``ModelInfo``) for ``LLMOperator(model)``
    under an ``EngineConfig``: its cache_dir, revision and trust_remote_code."""
    from llm_operator.models import load_tokenizer, resolve_model

    trust = config.trust_remote_code
    resolved = resolve_model(
        model, cache_dir=config.cache_dir, trust_remote_code=trust, revision=config.revision
    )
    tokenizer = load_tokenizer(resolved.path, trust_remote_code=trust)
    info = read_model_info(resolved.path, tokenizer, trust_remote_code=trust, gguf=resolved.gguf)
    return resolved, tokenizer, info
