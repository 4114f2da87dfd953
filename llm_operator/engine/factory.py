"""Backend construction: which backend runs a model, and building it from an EngineConfig."""

from __future__ import annotations

import contextlib

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
    where they measured as fast as the fastest-per-shape kernels (issue 30); off on CPUs
    with AMX (whose oneDNN bf16 GEMMs the packed kernel does not match; not measured) and
    on GPUs. True with another backend: ValueError."""
    from llm_operator.config import NOT_INVARIANT

    if config.deterministic is False:
        return False
    if backend_name != "native":
        if config.deterministic:
            raise ValueError(NOT_INVARIANT.format(backend=backend_name))
        return False
    if config.deterministic:
        return True
    from llm_operator.models import resolve_device

    return resolve_device(config.device).type == "cpu" and not _has_amx()


def segment_align(config: EngineConfig, backend_name: str) -> int:
    """Tokens every shared segment of a plan ends on a multiple of: the KV block size where
    the batch-invariant kernels run (they need segments on block boundaries), else 1."""
    return config.kv_block_size if invariant_kernels(config, backend_name) else 1


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


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """The KV cache bytes of an engine on ``device``: ``kv_cache_memory``, or for "auto"
    ``auto_kv_cache_bytes`` (call it once the model is loaded: on CUDA it reads what is
    free then)."""
    return config.kv_cache_bytes or auto_kv_cache_bytes(device, share=config.gpu_share)


def _native(config: EngineConfig, info: ModelInfo, tokenizer, device, dtype):
    from llm_operator import kernels
    from llm_operator.engine.native.backend import NativeBackend
    from llm_operator.kernels import artifact_proof
    from llm_operator.models.llama import LlamaModel

    if info.native_unsupported is not None:
        raise ValueError(info.native_unsupported)
    artifact_proof.prove_mode()  # a bad LLM_OPERATOR_PROVE fails here, naming it
    # Native code (compiled kernels, AOT packages, Triton) runs in this process from here
    # on: a crash there prints the Python frames to the task's log, not a bare exit.
    artifact_proof.enable_fault_handler()
    model = LlamaModel.from_pretrained(info.path, device=device, dtype=dtype)
    heads = model.config  # on CUDA: self-check the Triton kernels (torch path on failure)
    kernels.ensure_checked(
        device,
        dtype,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        windowed=heads.sliding_window is not None,
    )
    if kernels.triton_device(device):  # and the elementwise regions' kernels (eager on failure)
        try:
            from llm_operator.models import triton_ops
        except ImportError:
            triton_ops = None  # no Triton: the regions run eagerly there anyway
        if triton_ops is not None:
            triton_ops.ensure_checked(device, dtype, model.config)
    config = config.with_batch_defaults(gpu_memory(device, config.gpu_share))
    return NativeBackend(model, config, kv_cache_bytes=kv_budget(config, device))


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
