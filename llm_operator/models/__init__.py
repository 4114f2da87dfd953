"""Model resolution (aliases, Hugging Face directories, GGUF -> safetensors cache) and loading."""

from __future__ import annotations

from llm_operator.models.gguf import (
    convert_gguf_cached,
    convert_gguf_to_directory,
    publish_directory,
)
from llm_operator.models.loading import (
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from llm_operator.models.registry import (
    KNOWN_MODELS,
    KnownModel,
    ResolvedModel,
    check_architecture,
    default_cache_dir,
    known_aliases,
    resolve_model,
    validate_model_directory,
)

__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "ResolvedModel",
    "check_architecture",
    "convert_gguf_cached",
    "convert_gguf_to_directory",
    "default_cache_dir",
    "known_aliases",
    "load_causal_lm",
    "load_tokenizer",
    "publish_directory",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "validate_model_directory",
]
