"""Engine configuration: frozen, validated on construction.

Each field is one engine option (``option``: its doc, check and command-line spelling);
``llm_operator.options`` derives the CLI, the keyword signatures and the docs from these
fields, and every backend reads its settings from the ``EngineConfig`` it is given.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llm_operator.option_fields import (
    BACKENDS,
    boolean,
    check_fields,
    documented,
    folder_path,
    integer,
    keyword_items,
    memory_size,
    one_of,
    option,
    optional,
    parse_keyword_item,
    parse_memory_size,
    positive_number,
    probability_mass,
    text,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_PREFILL_BATCH_TOKENS",
    "EngineConfig",
    "batch_defaults",
    "parse_memory_size",
    "physical_memory_bytes",
]


NOT_INVARIANT = (
    "deterministic=True: batch-invariant kernels exist for the native backend only; backend "
    "{backend!r} computes a row differently beside other rows. Use backend='native' (Llama, "
    "Qwen2, Qwen3, Mistral) or leave deterministic unset"
)


def physical_memory_bytes() -> int:
    """Installed RAM (falls back to 8 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


# Batch sizes where the options leave them to the engine (None): the CPU's (and the hf and
# vllm backends' everywhere); a GPU's come from batch_defaults.
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_PREFILL_BATCH_TOKENS = 4096
# (GPU memory from which they apply, rows, tokens): larger batches keep a big GPU busy, but
# their logits and activations need memory a small GPU cannot spare.
GPU_BATCH_STEPS = ((70 * 2**30, 1024, 16384), (24 * 2**30, 512, 8192))


def batch_defaults(memory_bytes: int | None) -> tuple[int, int]:
    """(max_batch_size, prefill_batch_tokens) for an engine with ``memory_bytes`` of GPU
    memory (its share of the GPU), or None for the CPU: 256 rows and 4,096 tokens on the
    CPU and below 24 GiB, 512 and 8,192 from 24 GiB, 1,024 and 16,384 from 70 GiB."""
    if memory_bytes is not None:
        for least, rows, tokens in GPU_BATCH_STEPS:
            if memory_bytes >= least:
                return rows, tokens
    return DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_BATCH_TOKENS


def check_single_gpu(config: EngineConfig, backend: str) -> None:
    """ValueError naming the option when ``backend`` (not vllm) is asked for several GPUs."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(config, name)
        if value is not None and value > 1:
            raise ValueError(
                f"{name}={value}: the {backend} backend runs on one device; "
                'use backend="vllm" to split a model over several GPUs'
            )


@documented
@dataclass(frozen=True)
class EngineConfig:
    """Options of one ``LLMOperator``."""

    backend: str = option(
        "auto",
        doc='"native" (our paged-KV engine; Llama, Qwen 2/3, Mistral, Gemma 2/3, Phi-3), "hf" (transformers), '
        '"vllm" (needs vllm), "openai" (an OpenAI-compatible server at base_url), or '
        '"auto" (native where it runs, else hf)',
        check=one_of(*BACKENDS),
    )
    device: str = option("auto", doc='"cpu", "cuda", "cuda:N" or "auto"', check=text)
    dtype: str = option(
        "auto",
        doc='"float32", "bfloat16", "float16" or "auto" (float32 on CPU; on a GPU bfloat16 '
        "where it is supported, else float16)",
        check=text,
    )
    kv_cache_memory: int | str = option(
        "auto",
        doc='bytes or a size such as "2GiB" the KV cache may hold; "auto": a quarter of RAM '
        "on CPU (at most 8 GiB), 80% of the GPU memory free once the model is loaded (of "
        "its gpu_share of the GPU, less what the process holds)",
        check=memory_size,
    )
    gpu_share: float | None = option(
        None,
        doc="the part of a GPU shared with other workers (0 < x <= 1) this engine counts on "
        "when kv_cache_memory is auto (vllm: its gpu_memory_utilization); None: the whole "
        "GPU, or on Spark the task's spark.task.resource.gpu.amount",
        check=optional(probability_mass),
        cli_type=float,
    )
    max_batch_size: int | None = option(
        None,
        doc=f"most rows decoding at once; None: {DEFAULT_MAX_BATCH_SIZE}, or for the native "
        "engine on a GPU sized from its memory (batch_defaults)",
        check=optional(integer(1)),
        cli_type=int,
    )
    prefill_batch_tokens: int | None = option(
        None,
        doc="most tokens in one iteration (native: decodes included; hf: padded prefill "
        f"tokens); None: {DEFAULT_PREFILL_BATCH_TOKENS}, or for the native engine on a GPU "
        "sized from its memory (batch_defaults)",
        check=optional(integer(1)),
        cli_type=int,
    )
    kv_block_size: int = option(
        16, doc="tokens per KV block of the native paged cache", check=integer(1)
    )
    min_shared_tokens: int = option(
        4, doc="shortest prefix worth sharing between rows", check=integer(1)
    )
    share_prefixes: bool = option(
        True, doc="share common prefixes (off: an ablation)", check=boolean, cli="flag"
    )
    decode_first: bool = option(
        True,
        doc="run groups with the most decode work first (off: an ablation)",
        check=boolean,
        cli="flag",
    )
    jump_forward: str = option(
        "tokens",
        doc="constrained outputs: append the tokens a grammar forces without a model step: "
        '"tokens" where the mask admits one token only (outputs unchanged), "text" the '
        "grammar's forced text as the tokenizer splits it (fewer steps; a value can differ), "
        '"off"',
        check=one_of("tokens", "text", "off"),
    )
    token_batching: bool = option(
        True,
        doc="native: requests join the running batch as KV blocks free (BATON); off, they "
        "run in waves of max_batch_size (an ablation)",
        check=boolean,
        cli="flag",
    )
    cuda_graphs: str = option(
        "auto",
        doc='native: decode steps replayed as CUDA graphs, one per bucket of rows: "auto" '
        '(on for CUDA), "on", "off"',
        check=one_of("auto", "on", "off"),
    )
    kernels: str = option(
        "auto",
        doc='native: the kernels a step runs on: "cpp" (compiled CPU kernels: attention, '
        'packed GEMM, the whole decoder where the model allows), "triton" (Triton attention '
        'and elementwise kernels; CUDA, or the CPU under TRITON_INTERPRET=1), "torch" (the '
        'reference), or "auto" (cpp on the CPU in fp32/bf16, triton on CUDA, each after a '
        "self-check at start-up; torch where that fails, with a warning)",
        check=one_of("auto", "cpp", "triton", "torch"),
    )
    quantization: str = option(
        "auto",
        doc="native on the CPU: projections and LM head multiplied with int8 dot products "
        'on weights kept quantized in groups of 32: "auto" (a GGUF model keeps its file\'s '
        'quantization, Q4 and Q8 blocks as they are; other models none), "gguf" (the same, '
        'an error for a model that is not a GGUF file), "int8" (every projection and the LM '
        'head quantized to 8 bits at load), "none" (float weights in the model dtype)',
        check=one_of("auto", "none", "gguf", "int8"),
    )
    overlap: str = option(
        "auto",
        doc="native: schedule the next iteration while the device runs this one, for runs "
        'whose rows are all greedy: "auto" (on for CUDA), "on", "off"',
        check=one_of("auto", "on", "off"),
    )
    profile_ops: bool = option(
        False,
        doc="native: time each iteration's work by kind (linear, attention, kv_store, "
        "elementwise, sampling, host) into the run profile; costs about a microsecond per op",
        check=boolean,
        cli="flag",
    )
    deterministic: bool | None = option(
        None,
        doc="native on the CPU: batch-invariant kernels, so a row's tokens do not depend on "
        "its neighbours, partition, process or retry (the packed GEMM at every row count; "
        "attention in fixed steps through block-aligned shared segments); None: on for the "
        "native engine on a CPU without AMX, off elsewhere (not measured there); off: the "
        "fastest GEMM per shape (the same choice in every process of a machine kind). True "
        "with backend hf or vllm is an error",
        check=optional(boolean),
        cli="flag",
    )
    stats_log: str | None = option(
        None,
        doc="Spark, Dask and the CLI's engines: a file each partition appends one JSON line "
        "of statistics to (rows, distinct prompts, prompt, prefill and output tokens, "
        "seconds, process id)",
        check=optional(text),
    )
    trust_remote_code: bool = option(
        False, doc="allow code shipped with the model to run", check=boolean, cli="flag"
    )
    progress: bool = option(
        False,
        doc="show a progress bar (rows, output tokens/s)",
        check=boolean,
        cli="flag",
        cli_default=True,
    )
    cache_dir: str | None = option(
        None,
        doc="folder of converted models (default $LLM_OPERATOR_CACHE or ~/.cache/llm-operator)",
        check=optional(folder_path),
    )
    revision: str | None = option(
        None,
        doc="Hugging Face Hub model: the branch, tag or commit to use (default: main)",
        check=optional(text),
    )
    # given as a mapping, kept as sorted (name, value) pairs (hashable)
    vllm_options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = option(
        (),
        doc="keyword arguments for vllm.LLM (backend vllm), over the backend's defaults",
        check=keyword_items,
        cli="items",
        cli_type=parse_keyword_item,
    )

    base_url: str | None = option(
        None,
        doc='backend "openai": the server\'s API root, such as "http://localhost:8000/v1" '
        "(vLLM, SGLang or a hosted endpoint)",
        check=optional(text),
    )
    api_key: str | None = option(
        None,
        doc='backend "openai": the bearer key; None: $OPENAI_API_KEY, else none',
        check=optional(text),
        repr=False,
    )
    server_model: str | None = option(
        None,
        doc='backend "openai": the model name the server serves (its --served-model-name); '
        "None: the only model it lists. The model argument gives the tokenizer the plan uses",
        check=optional(text),
    )
    api: str = option(
        "auto",
        doc='backend "openai": "completions" (token ids, the plan\'s exact prompt), "chat" '
        '(messages), or "auto" (completions on a vLLM server, else chat)',
        check=one_of("auto", "completions", "chat"),
    )
    max_concurrency: int = option(
        32, doc='backend "openai": most requests in flight per worker', check=integer(1)
    )
    request_order: str = option(
        "plan",
        doc='backend "openai": "plan" (a prefix group\'s first row alone, then the rest; '
        'cached groups first) or "table" (the table\'s order, as SynapseML and ai_query '
        "send it; an ablation)",
        check=one_of("plan", "table"),
    )
    request_timeout: float = option(
        600.0,
        doc='backend "openai": seconds one request may take before it is retried',
        check=positive_number,
        cli_type=float,
    )
    max_retries: int = option(
        6,
        doc='backend "openai": retries of a request after 408, 409, 429, 500, 502, 503, 504, a timeout or a dropped '
        "connection (exponential backoff with jitter, or the server's Retry-After)",
        check=integer(0),
    )

    tensor_parallel_size: int | None = option(
        None,
        doc='GPUs each layer is split over (tensor parallelism; above 1: backend "vllm" '
        "only); None: vLLM's default, 1",
        check=optional(integer(1)),
    )
    pipeline_parallel_size: int | None = option(
        None,
        doc='GPUs the layers are split across in stages (above 1: backend "vllm" only); '
        "None: vLLM's default, 1",
        check=optional(integer(1)),
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.backend in ("native", "hf"):
            check_single_gpu(self, self.backend)
        if self.deterministic and self.backend in ("hf", "vllm", "openai"):
            raise ValueError(NOT_INVARIANT.format(backend=self.backend))
        if self.quantization in ("gguf", "int8") and self.backend in ("hf", "vllm", "openai"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on the native backend only (here "
                f"backend={self.backend!r}); use quantization='auto' or 'none'"
            )
        if self.backend == "openai" and not self.base_url:
            raise ValueError(
                'backend="openai" needs base_url: the server\'s API root, such as '
                '"http://localhost:8000/v1"'
            )
        if self.base_url and self.backend != "openai":
            raise ValueError(
                f'base_url={self.base_url!r} is for backend="openai" (here '
                f"backend={self.backend!r})"
            )

    def with_batch_defaults(self, memory_bytes: int | None) -> EngineConfig:
        """This config with ``max_batch_size`` and ``prefill_batch_tokens`` set: as given,
        else ``batch_defaults(memory_bytes)`` (None: the CPU's); itself when both are given."""
        if self.max_batch_size is not None and self.prefill_batch_tokens is not None:
            return self
        rows, tokens = batch_defaults(memory_bytes)
        return dataclasses.replace(
            self,
            max_batch_size=self.max_batch_size or rows,
            prefill_batch_tokens=self.prefill_batch_tokens or tokens,
        )

    @property
    def kv_cache_bytes(self) -> int | None:
        """``kv_cache_memory`` in bytes; None for "auto" (the backend sizes it)."""
        return parse_memory_size(self.kv_cache_memory)
