"""The systems ``llm-operator bench`` compares, and how each one is run.

Every system runs in a subprocess of its own (``bench.core.worker`` in this Python, or
``bench.baselines.vllm_runner`` in the vLLM venv), so load time, peak memory and warm caches never
leak from one system into the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SystemSpec:
    """One system: kind "static" (HF generate, fixed batches), "operator" (LLMOperator),
    "vllm" (vLLM's offline engine) or "llamacpp" (llama.cpp's server, fed by a client with
    requests in flight: ``bench.baselines.llama_cpp``); ``shuffled`` submits the rows in a seeded random order.

    ``choices``: each row's output is constrained to its labels (``Workload.choices``; our
    ``SamplingParams(choices=...)``, vLLM's structured outputs); such a system runs only the
    workloads that have labels (classify). The other systems generate freely there, up to
    the workload's stop strings.

    The operator systems run float weights (``quantization="none"``) unless their options
    say otherwise (``native-gguf``, ``native-int8``).

    ``dtype`` (None: float32 for vLLM, the library's "auto" otherwise) and ``block_size``
    (vLLM's KV block in tokens, vLLM systems only; None: ``--vllm-block-size``, else vLLM's
    own) let systems that differ only there run side by side in one benchmark.
    """

    name: str
    kind: str
    description: str
    options: dict[str, Any] = field(default_factory=dict)
    shuffled: bool = False
    python: str = "self"  # "vllm": the worker runs in the vLLM venv (backend="vllm")
    dtype: str | None = None
    block_size: int | None = None
    choices: bool = False

    def __post_init__(self) -> None:
        if self.choices and self.kind == "static":
            raise ValueError(f"system {self.name!r}: HF generate takes no choices")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"system {self.name!r}: dtype={self.dtype!r}; use one of {DTYPES}")
        if self.block_size is not None:
            if self.kind != "vllm" and self.python != "vllm":
                raise ValueError(f"system {self.name!r}: block_size is for vLLM systems only")
            if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
                raise TypeError(f"system {self.name!r}: block_size must be an int")
            if self.block_size < 1:
                raise ValueError(f"system {self.name!r}: block_size={self.block_size} < 1")


SYSTEMS: dict[str, SystemSpec] = {
    spec.name: spec
    for spec in (
        SystemSpec(
            "hf-static",
            "static",
            "HF generate on fixed batches in input order, each run to completion (a pandas UDF)",
        ),
        SystemSpec(
            "hf-static-bf16",
            "static",
            "hf-static with bfloat16 weights and activations (the baseline of the bf16 systems)",
            dtype="bfloat16",
        ),
        SystemSpec(
            "hf-static-shuffled",
            "static",
            "hf-static with the rows shuffled",
            shuffled=True,
        ),
        SystemSpec(
            "hf",
            "operator",
            "llm-operator, hf backend: global prefix sharing, decode-first, BATON re-batching",
            {"backend": "hf"},
        ),
        SystemSpec(
            "hf-noshare",
            "operator",
            "hf without global prefix sharing (ablation)",
            {"backend": "hf", "share_prefixes": False},
        ),
        SystemSpec(
            "hf-nodecodefirst",
            "operator",
            "hf without decode-first order (ablation)",
            {"backend": "hf", "decode_first": False},
        ),
        SystemSpec(
            "native",
            "operator",
            "llm-operator, native backend: paged KV, pinned prefixes, token batching, "
            "shared-prefix attention",
            {"backend": "native"},
        ),
        SystemSpec(
            "native-noshare",
            "operator",
            "native without global prefix sharing (ablation)",
            {"backend": "native", "share_prefixes": False},
        ),
        SystemSpec(
            "native-nodecodefirst",
            "operator",
            "native without decode-first order (ablation)",
            {"backend": "native", "decode_first": False},
        ),
        SystemSpec(
            "native-notokenbatch",
            "operator",
            "native without token batching: waves of 16 requests, each run to its end "
            "before the next is admitted (ablation)",
            {"backend": "native", "token_batching": False, "max_batch_size": 16},
        ),
        SystemSpec(
            "native-choices",
            "operator",
            "native with each row's labels as choices (a token trie, decided rows jump "
            "forward); workloads with labels only",
            {"backend": "native"},
            choices=True,
        ),
        SystemSpec(
            "native-bf16",
            "operator",
            "native with bfloat16 weights, activations and KV cache",
            {"backend": "native"},
            dtype="bfloat16",
        ),
        SystemSpec(
            "native-det",
            "operator",
            "native with deterministic=True: batch-invariant kernels (the packed GEMM at every "
            "row count, attention block by block through block-aligned segments)",
            {"backend": "native", "deterministic": True},
        ),
        SystemSpec(
            "native-det-bf16",
            "operator",
            "native-det with bfloat16 weights, activations and KV cache",
            {"backend": "native", "deterministic": True},
            dtype="bfloat16",
        ),
        SystemSpec(
            "native-nondet",
            "operator",
            "native with deterministic=False: the fastest kernels per shape, shared segments "
            "not aligned to KV blocks",
            {"backend": "native", "deterministic": False},
        ),
        SystemSpec(
            "native-nondet-bf16",
            "operator",
            "native-nondet with bfloat16 weights, activations and KV cache",
            {"backend": "native", "deterministic": False},
            dtype="bfloat16",
        ),
        SystemSpec(
            "native-gguf",
            "operator",
            "native on the GGUF file's own quantized weights, kept quantized (SmolLM2: Q4_1 "
            "projections, Q8_0 embedding and head): int8 dot products, fp32 activations",
            {"backend": "native", "quantization": "gguf"},
        ),
        SystemSpec(
            "native-int8",
            "operator",
            "native with every projection and the head quantized to 8 bits at load (groups "
            "of 32): int8 dot products, fp32 activations",
            {"backend": "native", "quantization": "int8"},
        ),
        SystemSpec(
            "vllm-plan",
            "operator",
            "llm-operator, vllm backend: the plan fed to vLLM group by group, in waves the "
            "KV cache holds (prefix caching on, 32-token blocks on CPU)",
            {"backend": "vllm"},
            python="vllm",
        ),
        SystemSpec(
            "vllm",
            "vllm",
            "vLLM offline, prefix caching on, rows in input order",
            {"prefix_caching": True},
        ),
        SystemSpec(
            "vllm-shuffled",
            "vllm",
            "vLLM offline, prefix caching on, rows shuffled",
            {"prefix_caching": True},
            shuffled=True,
        ),
        SystemSpec(
            "vllm-noprefix",
            "vllm",
            "vLLM offline, prefix caching off, rows in input order",
            {"prefix_caching": False},
        ),
        SystemSpec(
            "vllm-choices",
            "vllm",
            "vLLM offline, prefix caching on, each row's labels as structured-output choices; "
            "workloads with labels only",
            {"prefix_caching": True},
            choices=True,
        ),
        SystemSpec(
            "vllm-bf16",
            "vllm",
            "vllm in bfloat16",
            {"prefix_caching": True},
            dtype="bfloat16",
        ),
        SystemSpec(
            "vllm-b32",
            "vllm",
            "vllm with 32-token KV blocks (finer prefix reuse)",
            {"prefix_caching": True},
            block_size=32,
        ),
        SystemSpec(
            "vllm-b32-bf16",
            "vllm",
            "vllm with 32-token KV blocks, in bfloat16",
            {"prefix_caching": True},
            dtype="bfloat16",
            block_size=32,
        ),
        SystemSpec(
            "llamacpp",
            "llamacpp",
            "llama.cpp's llama-server on the model's own GGUF (SmolLM2: Q4_1): continuous "
            "batching, 16 slots, prompt caching, 16 requests in flight",
            {"gguf": "own"},
        ),
        SystemSpec(
            "llamacpp-1slot",
            "llamacpp",
            "llamacpp with one slot, one request in flight: each prompt reuses the last one's "
            "cached prefix",
            {"gguf": "own", "parallel": 1},
        ),
        SystemSpec(
            "llamacpp-f32",
            "llamacpp",
            "llamacpp on an F32 GGUF converted from the same weights (llama.cpp's f16 KV)",
            {"gguf": "f32"},
        ),
        SystemSpec(
            "llamacpp-f32-1slot",
            "llamacpp",
            "llamacpp-f32 with one slot, one request in flight (its best configuration on "
            "shared prefixes)",
            {"gguf": "f32", "parallel": 1},
        ),
    )
}

DEFAULT_SYSTEMS = tuple(SYSTEMS)
"""``--systems all``: every system (the choices systems run only on workloads with labels)."""
BASELINE = "hf-static"
VLLM_REFERENCE = "vllm"


def runs_on(spec: SystemSpec, workload: dict) -> bool:
    """Whether ``spec`` runs ``workload`` (a prepared workload): a choices system needs labels."""
    return not spec.choices or workload.get("choices") is not None


def parse_systems(text: str | None) -> list[SystemSpec]:
    """A comma-separated list of system names (None or "all": every system), in that order."""
    if text is None or text.strip() == "all":
        return [SYSTEMS[name] for name in DEFAULT_SYSTEMS]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names:
        raise ValueError(
            f"unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)} or 'all'"
        )
    return [SYSTEMS[name] for name in dict.fromkeys(names)]
