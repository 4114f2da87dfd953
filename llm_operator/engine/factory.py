"""Backend construction: which backend runs a model, building it from an EngineConfig, and
the native engine's one decision point (``native_paths``: how it runs a step)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from llm_operator.config import EngineConfig, check_single_gpu, physical_memory_bytes
from llm_operator.models.info import ModelInfo


def choose_backend(config: EngineConfig, info: ModelInfo) -> str:
    """``auto`` picks ``native`` for the architectures the native engine supports
    (``models.llama.SUPPORTED_MODEL_TYPES``), else ``hf``."""
    if config.backend != "auto":
        return config.backend
    return "native" if info.native_unsupported is None else "hf"


def max_context(info: ModelInfo, backend_name: str) -> int:
    """The longest row (prompt + output tokens) the backend runs: the model's context, or
    for the native engine a shorter one where it is exact only there (longrope's short
    factors)."""
    return info.native_max_context if backend_name == "native" else info.max_context


def invariant_kernels(config: EngineConfig, backend_name: str) -> bool:
    """Whether a run takes the batch-invariant kernels: ``deterministic`` resolved for the
    backend that runs. None (the default): on for the native engine on a CPU without AMX,
    off on CPUs with AMX and on GPUs (opt in). True: the compiled CPU kernels (attention
    and linears), or on the Triton kernels their invariant attention (``native_paths`` says
    what it covers there); with another backend: ValueError."""
    from llm_operator.config import NOT_INVARIANT

    if config.deterministic is False:
        return False
    if config.deterministic is None and config.kernels not in ("auto", "cpp"):
        return False  # torch has no invariant mode; Triton's is opt-in (deterministic=True)
    if backend_name != "native":
        if config.deterministic:
            raise ValueError(NOT_INVARIANT.format(backend=backend_name))
        return False
    if config.deterministic:
        return True
    from llm_operator.models import resolve_device

    return resolve_device(config.device).type == "cpu" and not _has_amx()


def _has_amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def build_backend(config: EngineConfig, info: ModelInfo, tokenizer):
    """The backend ``choose_backend`` names, its model loaded; every backend reads its
    settings from ``config`` (with ``kv_cache_memory`` resolved for the device)."""
    name = choose_backend(config, info)
    if name != "native" and not config.token_batching:
        raise ValueError(
            "token_batching=False is an ablation of the native backend; the "
            f"{name} backend (chosen here: backend={config.backend!r}) always re-batches"
        )
    if name == "openai":
        from llm_operator.engine.openai.backend import OpenAIBackend

        return OpenAIBackend(config, tokenizer, max_context=info.max_context)
    if name == "vllm":
        from llm_operator.engine.vllm.backend import VLLMBackend

        return VLLMBackend(str(info.path), tokenizer, config, max_context=info.max_context)
    check_single_gpu(config, name)
    from llm_operator.models import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if name == "native":
        return _native(config, info, tokenizer, device, dtype)
    from llm_operator.engine.hf.backend import HFBackend
    from llm_operator.models import load_causal_lm

    with _transformers_progress_bars(config.progress):
        model = load_causal_lm(
            info.path, device=device, dtype=dtype, trust_remote_code=config.trust_remote_code
        )
    return HFBackend(model, tokenizer, config, kv_cache_bytes=kv_budget(config, device))


def build_embedder(config: EngineConfig, info: ModelInfo, backend: Callable[[], Any]):
    """What embeds rows (``llm_operator.embedding``) on the backend ``choose_backend``
    names: native (causal decoders; ``backend()`` builds or returns the native backend,
    so ``generate`` and ``embed`` share one model), hf (``transformers.AutoModel``:
    encoders, and ``backend="auto"`` on a decoder whose attention is bidirectional), vllm
    (vLLM's pooling runner, ``engine.vllm.embed``)."""
    name = choose_backend(config, info)
    causal = getattr(info.config, "is_causal", True) is not False
    if name == "native" and not causal:
        if config.backend == "native":
            raise ValueError(
                "backend='native' embeds causal decoders only (rows that start alike share "
                "their K/V); this model's attention is bidirectional: use backend='hf'"
            )
        name = "hf"
    if name == "native":
        from llm_operator.engine.native.embed import NativeEmbedder

        return NativeEmbedder(backend())
    if name == "hf":
        from llm_operator.engine.hf.embed import HFEmbedder

        check_single_gpu(config, name)
        return HFEmbedder(info.path, config)
    if name == "vllm":
        from llm_operator.engine.vllm.embed import VLLMEmbedder

        return VLLMEmbedder(info.path, config, max_context=info.max_context)
    raise ValueError(f"backend={name!r} does not embed; use backend='native', 'hf' or 'vllm'")


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """The KV cache bytes of an engine on ``device``: ``kv_cache_memory``, or for "auto"
    ``auto_kv_cache_bytes`` (call it once the model is loaded: on CUDA it reads what is
    free then)."""
    return config.kv_cache_bytes or auto_kv_cache_bytes(device, share=config.gpu_share)


def _native(config: EngineConfig, info: ModelInfo, tokenizer, device, dtype):
    import faulthandler

    from llm_operator.engine.native.backend import NativeBackend
    from llm_operator.models.llama import LlamaModel

    if info.native_unsupported is not None:
        raise ValueError(info.native_unsupported)
    if not faulthandler.is_enabled():  # a crash in native code prints the Python frames
        faulthandler.enable(all_threads=True)
    model = LlamaModel.from_pretrained(info.path, device=device, dtype=dtype)
    paths = native_paths(config, model, device, dtype, gguf=info.gguf)
    if paths.quantization != "none":
        from llm_operator.models.quant import quantize_model
        from llm_operator.models.registry import cache_root

        model.quantization = quantize_model(
            model, paths.quantization, info.gguf, cache_root(config.cache_dir)
        )
    config = config.with_batch_defaults(gpu_memory(device, config.gpu_share))
    return NativeBackend(model, config, paths, kv_cache_bytes=kv_budget(config, device))


ONEDNN_ROWS = 64  # AMX bf16: steps of at least this many rows on oneDNN's linear


def native_paths(config: EngineConfig, model, device: torch.device, dtype: torch.dtype, gguf=None):
    """How the native engine runs ``model`` on ``device`` in ``dtype``: the one decision
    point (``engine.native.paths.EnginePaths``). Loads and self-checks the kernels it
    picks (once per process); a kernel family that fails falls back with one warning,
    but one that ``config.kernels`` names explicitly raises RuntimeError instead.
    ValueError for options this device or model cannot run (``cuda_graphs="on"`` without
    the Triton kernels, ``kernels="cpp"`` off the CPU, a quantization the run cannot
    take). ``gguf``: the GGUF file the model was converted from (None: not a GGUF)."""
    from llm_operator.engine.native.paths import EnginePaths
    from llm_operator.kernels import cpu_extension, cpu_ops
    from llm_operator.models import cpu_decoder

    c = model.config
    forced = config.kernels if config.kernels != "auto" else None
    fallbacks: list[str] = []
    if forced:
        attention = forced
    elif device.type == "cuda":
        attention = "triton"
    else:
        attention = "cpp" if device.type == "cpu" and dtype in cpu_ops.CPU_DTYPES else "torch"
    if attention == "cpp":
        if device.type != "cpu" or dtype not in cpu_ops.CPU_DTYPES:
            raise ValueError(
                f"kernels='cpp' runs fp32 and bf16 on the CPU, not {dtype} on {device}"
            )
        if cpu_extension.load() is None:
            reason = f"compiled CPU kernels unavailable: {cpu_extension.failure()}"
            if forced:
                raise RuntimeError(f"kernels='cpp' but the {reason}")
            attention = "torch"
            fallbacks.append(reason)
    windowed = c.sliding_window is not None
    if attention == "triton":
        reason = _triton_failure(device, dtype, c.num_heads, c.num_kv_heads, c.head_dim, windowed)
        if reason is not None:
            if forced:
                raise RuntimeError(f"kernels='triton' but the kernels failed: {reason}")
            attention = "torch"
            fallbacks.append(f"Triton attention failed its self-check: {reason}")
    if c.attn_softcap is not None and attention != "torch":
        fallbacks.append(f"soft-capped attention runs on the torch kernels, not {attention!r}")
        attention = "torch"
    elementwise = "eager"
    if attention == "triton":
        if (reason := _triton_fused_failure(device, dtype, c)) is None:
            elementwise = "triton"
        else:
            fallbacks.append(f"Triton elementwise kernels failed their self-check: {reason}")
    invariant = invariant_kernels(config, "native")
    gemm = "packed" if attention == "cpp" else "aten"
    if invariant and config.deterministic and attention == "triton":
        # asked for: the Triton attention's invariant mode; say what it leaves out
        linears = "the linear layers (torch's F.linear: cuBLAS picks its kernels by the rows)"
        if elementwise == "eager":
            linears += " and the eager elementwise ops"
        if windowed:  # the step builder leaves rows out of segments their window misses
            invariant = False
            covered = "the Triton attention has no batch-invariant mode for sliding windows yet"
        else:
            covered = "the Triton attention runs batch-invariant"
        warnings.warn(
            f"llm_operator: deterministic=True on {device}: {covered}, and {linears} are not "
            "batch-invariant: a row's tokens and log-probabilities may still depend on its batch",
            RuntimeWarning,
            stacklevel=3,
        )
    elif invariant and attention != "cpp":
        invariant = False
        if config.deterministic:  # asked for: say where it cannot hold (the run goes on)
            warnings.warn(
                f"llm_operator: deterministic=True makes outputs batch-invariant with the "
                f"compiled CPU kernels and the Triton attention only, but {device} runs the "
                f"{attention!r} attention kernels: a row's tokens may still depend on its batch",
                RuntimeWarning,
                stacklevel=3,
            )
    packed = gemm == "packed"
    quantization = _quantization(config.quantization, packed, gguf, device, fallbacks)
    amx_bf16 = (
        packed and dtype == torch.bfloat16 and not invariant and quantization == "none"
        and _has_amx()
    )  # fmt: skip
    return EnginePaths(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention=attention,
        forward="compiled" if packed and cpu_decoder.unsupported(model) is None else "eager",
        elementwise=elementwise,
        gemm=gemm,
        onednn_rows=ONEDNN_ROWS if amx_bf16 else None,
        graphs=_graphs(config, c, attention, device),
        overlap=config.overlap == "on" or (config.overlap == "auto" and device.type == "cuda"),
        invariant=invariant,
        profile_ops=config.profile_ops,
        quantization=quantization,
        fallbacks=tuple(fallbacks),
    )


def _quantization(asked: str, packed: bool, gguf, device, fallbacks: list[str]) -> str:
    """``quantization`` resolved: "auto" is "gguf" for a GGUF model where the compiled
    CPU kernels run the projections, else "none"; "gguf" and "int8" need those kernels
    (and "gguf" a GGUF model): ValueError otherwise."""
    if asked == "none":
        return "none"
    if asked == "auto":
        if gguf is None:
            return "none"
        if not packed:
            fallbacks.append(
                "the GGUF's quantization needs the compiled CPU kernels; its weights run "
                "dequantized"
            )
            return "none"
        return "gguf"
    if not packed:
        raise ValueError(
            f"quantization={asked!r} runs on the compiled CPU kernels (kernels 'auto' or "
            f"'cpp' on the CPU), not here ({device})"
        )
    if asked == "gguf" and gguf is None:
        raise ValueError(
            "quantization='gguf' keeps a GGUF file's quantization, but this model is not a "
            "GGUF file (an alias or a .gguf path); use quantization='int8' or 'none'"
        )
    return asked


def _graphs(config: EngineConfig, model_config, attention: str, device: torch.device) -> str:
    """``cuda_graphs`` resolved: "capture" on CUDA with the Triton kernels ("auto" or
    "on"), "replay" for "on" under the Triton interpreter (a test of the graph path),
    else "off"; never with op profiling. ValueError for "on" where graphs cannot run."""
    mode = config.cuda_graphs
    if mode == "off" or config.profile_ops:
        return "off"
    why_not = None
    if model_config.sliding_window is not None or model_config.attn_softcap is not None:
        why_not = (
            "decode graphs do not run sliding-window or soft-capped attention yet "
            f"(model_type={model_config.model_type!r})"
        )
    elif attention != "triton":
        why_not = (
            f"it needs the Triton kernels (a CUDA device; or, for tests, kernels='triton' "
            f"with TRITON_INTERPRET=1), but {device} runs the {attention!r} kernels"
        )
    if why_not is not None:
        if mode == "on":
            raise ValueError(f"cuda_graphs='on': {why_not}; use cuda_graphs='auto' or 'off'")
        return "off"
    return "capture" if device.type == "cuda" else "replay" if mode == "on" else "off"


@functools.cache
def _triton_failure(device, dtype, num_heads, num_kv_heads, head_dim, windowed) -> str | None:
    """The Triton attention kernels' self-check, once per process and shape (None: passed);
    a failure warns once."""
    from llm_operator.kernels import self_check

    reason = self_check.check_triton(
        device,
        dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        windowed=windowed,
    )
    if reason is not None:
        _warn_fallback("Triton attention kernels", device, dtype, reason)
    return reason


@functools.cache
def _triton_fused_failure(device, dtype, model_config) -> str | None:
    """The Triton elementwise kernels' self-check against the eager regions, once per
    process and model shape (None: passed); a failure warns once."""
    from llm_operator.kernels import self_check
    from llm_operator.models.fused import EAGER_OPS

    c = model_config
    reason = self_check.check_triton_fused(
        device,
        dtype,
        EAGER_OPS,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        eps=c.rms_norm_eps,
    )
    if reason is not None:
        _warn_fallback("Triton elementwise kernels", device, dtype, reason)
    return reason


def _warn_fallback(what: str, device, dtype, reason: str) -> None:
    warnings.warn(
        f"llm_operator: the {what} failed their self-check on {device} "
        f"({str(dtype).removeprefix('torch.')}): {reason}. The native engine runs their "
        "torch reference instead (correct, slower).",
        RuntimeWarning,
        stacklevel=4,
    )


def gpu_memory(device: torch.device, share: float | None = None) -> int | None:
    """The GPU memory an engine on ``device`` counts on (its ``share``); None on the CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * share) if share is not None else total


AUTO_KV_FRACTION = 0.8  # of the GPU memory an auto-sized KV cache may take


def auto_kv_cache_bytes(device: torch.device, share: float | None = None) -> int:
    """A quarter of RAM on CPU (at most 8 GiB); on CUDA 80% of the memory free now (call
    it after the model loaded: the weights are not free).

    share: the part of the GPU this engine may count on when it shares the GPU with other
    processes (Spark's fractional ``spark.task.resource.gpu.amount``, several Dask workers
    per GPU): the budget is then 80% of the smaller of what is free and ``share`` of the
    GPU's memory less what this process holds already (its weights, cached blocks), so
    the tenants of one GPU, each counting on its own share, fit together whichever
    starts first. ValueError when the process holds its whole share already.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = free
        if share is not None and share < 1:
            held = torch.cuda.memory_reserved(device)
            room = min(free, int(total * share) - held)
            if room <= 0:
                raise ValueError(
                    f"no GPU memory left for the KV cache on {device}: this process holds "
                    f"{held / 2**30:.2f} GiB (the model), its share is {share:g} of "
                    f"{total / 2**30:.2f} GiB (gpu_share; on Spark "
                    "spark.task.resource.gpu.amount); give it a larger share or set "
                    "kv_cache_memory"
                )
        return int(room * AUTO_KV_FRACTION)
    return min(physical_memory_bytes() // 4, 8 * 2**30)


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool):
    """transformers' own bars (e.g. "Loading weights") follow the operator's progress option."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
