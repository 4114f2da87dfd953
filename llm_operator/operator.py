"""LLMOperator: resolve the model, plan the batch, run a backend, return rows in input order."""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from llm_operator.config import EngineConfig, physical_memory_bytes
from llm_operator.engine.base import Backend, RequestOutput
from llm_operator.planner import Plan, build_plan
from llm_operator.progress import ProgressBar
from llm_operator.results import GenerationResult, RunStats
from llm_operator.sampling import SamplingParams, row_seed

Prompt = str | Sequence[Mapping[str, Any]]


class LLMOperator:
    """Runs one LLM over a batch of prompts, sharing common prefixes.

    >>> op = LLMOperator("smollm2-135m-instruct")
    >>> results = op.generate(["Classify: ...", ...], SamplingParams(max_tokens=8))

    model: an alias (``llm_operator.models.known_aliases()``), a Hugging Face
        model directory, or a ``.gguf`` file.
    The tokenizer loads at once; the model loads on the first ``generate``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        backend: str = "auto",
        device: str = "auto",
        dtype: str = "auto",
        kv_cache_memory: int | str = "auto",
        max_batch_size: int = 256,
        prefill_batch_tokens: int = 4096,
        kv_block_size: int = 16,
        min_shared_tokens: int = 4,
        share_prefixes: bool = True,
        decode_first: bool = True,
        token_batching: bool = True,
        trust_remote_code: bool = False,
        progress: bool = False,
        cache_dir: str | os.PathLike | None = None,
        vllm_options: Mapping[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig

        from llm_operator.models import load_tokenizer, resolve_model

        self.config = EngineConfig(
            backend=backend,
            device=device,
            dtype=dtype,
            kv_cache_memory=kv_cache_memory,
            max_batch_size=max_batch_size,
            prefill_batch_tokens=prefill_batch_tokens,
            kv_block_size=kv_block_size,
            min_shared_tokens=min_shared_tokens,
            share_prefixes=share_prefixes,
            decode_first=decode_first,
            token_batching=token_batching,
            trust_remote_code=trust_remote_code,
            progress=progress,
            vllm_options=vllm_options or (),
        )
        if backend == "vllm":
            from llm_operator.engine.vllm_backend import require_vllm

            require_vllm()
        self.model = resolve_model(model, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        self.tokenizer = load_tokenizer(self.model.path, trust_remote_code=trust_remote_code)
        self.model_config = AutoConfig.from_pretrained(
            self.model.path, trust_remote_code=trust_remote_code, local_files_only=True
        )
        from llm_operator.engine.hf import model_context_length

        self.max_context = model_context_length(self.model_config, self.tokenizer)
        self.last_stats = RunStats()
        self._backend: Backend | None = None

    @property
    def backend_name(self) -> str:
        """The backend that runs. ``auto`` picks ``native`` for the architectures the native
        engine supports (Llama, Qwen2, Qwen3, Mistral; no sliding window shorter than the
        context), ``hf`` for every other model."""
        if self.config.backend != "auto":
            return self.config.backend
        return "native" if self._native_unsupported() is None else "hf"

    def _native_unsupported(self) -> str | None:
        """Why the native engine cannot run this model, or None when it can."""
        from llm_operator.models.llama import native_config

        try:
            config = native_config(self.model_config)
        except ValueError as error:
            return str(error)
        if config.sliding_window is not None and config.sliding_window < self.max_context:
            return (
                f"backend='native' does not run sliding-window attention (window "
                f"{config.sliding_window} < context {self.max_context}); use backend='hf'"
            )
        return None

    def backend(self) -> Backend:
        """The backend, loading the model on first use."""
        if self._backend is None and self.backend_name == "vllm":
            self._backend = self._vllm_backend()
        if self._backend is None and self.backend_name == "native":
            self._backend = self._native_backend()
        if self._backend is None and not self.config.token_batching:
            raise ValueError(
                "token_batching=False is an ablation of the native backend; the hf backend "
                f"(chosen here: backend={self.config.backend!r}) always re-batches"
            )
        if self._backend is None:
            from llm_operator.engine.hf import HFBackend
            from llm_operator.models import load_causal_lm, resolve_device, resolve_dtype

            device = resolve_device(self.config.device)
            dtype = resolve_dtype(self.config.dtype, device)
            with _transformers_progress_bars(self.config.progress):
                model = load_causal_lm(
                    self.model.path,
                    device=device,
                    dtype=dtype,
                    trust_remote_code=self.config.trust_remote_code,
                )
            self._backend = HFBackend(
                model,
                self.tokenizer,
                max_batch_size=self.config.max_batch_size,
                prefill_batch_tokens=self.config.prefill_batch_tokens,
                kv_cache_bytes=self.config.kv_cache_bytes or _auto_kv_cache_bytes(device),
            )
        return self._backend

    def _vllm_backend(self) -> Backend:
        from llm_operator.engine.hf import eos_token_ids
        from llm_operator.engine.vllm_backend import VLLMBackend
        from llm_operator.models.llama import load_generation_config

        return VLLMBackend(
            str(self.model.path),
            self.tokenizer,
            max_context=self.max_context,
            eos_token_ids=eos_token_ids(load_generation_config(self.model.path), self.tokenizer),
            dtype=self.config.dtype,
            kv_cache_bytes=self.config.kv_cache_bytes,
            max_batch_size=self.config.max_batch_size,
            trust_remote_code=self.config.trust_remote_code,
            options=dict(self.config.vllm_options),
        )

    def _native_backend(self) -> Backend:
        from llm_operator import kernels
        from llm_operator.engine.hf import eos_token_ids
        from llm_operator.engine.native.backend import NativeBackend
        from llm_operator.models import resolve_device, resolve_dtype
        from llm_operator.models.llama import LlamaModel

        reason = self._native_unsupported()
        if reason is not None:
            raise ValueError(reason)
        device = resolve_device(self.config.device)
        dtype = resolve_dtype(self.config.dtype, device)
        model = LlamaModel.from_pretrained(self.model.path, device=device, dtype=dtype)
        heads = model.config  # on CUDA: self-check the Triton kernels (torch path on failure)
        kernels.ensure_checked(
            device,
            dtype,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=heads.head_dim,
        )
        return NativeBackend(
            model,
            self.tokenizer,
            kv_cache_bytes=self.config.kv_cache_bytes or _auto_kv_cache_bytes(device),
            eos_token_ids=eos_token_ids(model.generation_config, self.tokenizer),
            max_context=self.max_context,
            block_size=self.config.kv_block_size,
            max_batched_tokens=self.config.prefill_batch_tokens,
            max_running=self.config.max_batch_size,
            share_prefixes=self.config.share_prefixes,
            token_batching=self.config.token_batching,
        )

    # -- preparation -----------------------------------------------------
    def _prepare(
        self, prompts: Sequence[Prompt], sampling
    ) -> tuple[list, list, dict[int, str], float]:
        """Token ids per row (None for bad rows), params per row, errors by row, seconds."""
        started = time.perf_counter()
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            if hasattr(prompts, "tolist"):
                prompts = prompts.tolist()
            elif isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
                raise TypeError(
                    f"prompts must be a list of strings or chat message lists, got {type(prompts).__name__}"
                )
            else:
                prompts = list(prompts)
        params = _params_per_row(sampling, len(prompts))
        errors: dict[int, str] = {}
        plain: dict[int, str] = {}
        chat: dict[int, str] = {}
        for row, prompt in enumerate(prompts):
            if prompt is None:
                errors[row] = "prompt is null"
            elif isinstance(prompt, str):
                if prompt == "":
                    errors[row] = "prompt is empty"
                else:
                    plain[row] = prompt
            elif _is_messages(prompt):
                try:
                    chat[row] = self._render_chat(prompt)
                except ValueError as error:
                    errors[row] = str(error)
            else:
                errors[row] = (
                    f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
                )
        token_ids: list[list[int] | None] = [None] * len(prompts)
        for texts, special in ((plain, True), (chat, False)):
            if texts:
                encoded = self.tokenizer(list(texts.values()), add_special_tokens=special)[
                    "input_ids"
                ]
                for row, ids in zip(texts, encoded):
                    token_ids[row] = ids
        for row, ids in enumerate(token_ids):
            if ids is None:
                continue
            if len(ids) == 0:
                errors[row] = "prompt has no tokens"
            elif len(ids) > self.max_context:
                errors[row] = (
                    f"prompt has {len(ids)} tokens, more than the model's context of {self.max_context}"
                )
            if row in errors:
                token_ids[row] = None
        return token_ids, params, errors, time.perf_counter() - started

    def _render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "chat messages need a chat template, and this model's tokenizer has none"
            )
        for message in messages:
            if not isinstance(message.get("content"), str) or not isinstance(
                message.get("role"), str
            ):
                raise ValueError("each chat message needs a string 'role' and a string 'content'")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # the template's own checks (e.g. role order)
            raise ValueError(f"chat template failed: {error}") from error

    def _plan(self, token_ids, params) -> tuple[Plan, list[int]]:
        """The plan over the valid rows, and the input row of each plan row."""
        valid = [row for row, ids in enumerate(token_ids) if ids is not None]
        return (
            build_plan(
                [token_ids[row] for row in valid],
                [params[row].max_tokens for row in valid],
                merge_keys=[params[row] if params[row].greedy else None for row in valid],
                min_shared_tokens=self.config.min_shared_tokens,
                decode_first=self.config.decode_first,
                share_prefixes=self.config.share_prefixes,
            ),
            valid,
        )

    # -- public ----------------------------------------------------------
    def plan(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Plan:
        """The prefix-sharing plan of these prompts, without loading the model (bad rows left out)."""
        token_ids, params, _, _ = self._prepare(prompts, sampling)
        return self._plan(token_ids, params)[0]

    def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int] | None]:
        """The token ids each prompt runs with (chat template applied); None where the row
        would fail (null, empty, too long, not a prompt)."""
        return self._prepare(prompts, None)[0]

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in input order; bad rows get finish_reason="error"."""
        started = time.perf_counter()
        token_ids, params, errors, tokenize_seconds = self._prepare(prompts, sampling)
        plan, valid = self._plan(token_ids, params)
        backend = self.backend() if plan.requests else None
        request_params = [params[valid[r.rows[0]]] for r in plan.requests]
        generators = self._generators(plan, valid, token_ids, params)
        generate_started = time.perf_counter()
        if backend is not None:
            with ProgressBar(len(valid), enabled=self.config.progress) as bar:
                result = backend.run(plan, request_params, generators, progress=bar.update)
            outputs, prefilled, output_tokens = result
        else:
            outputs, prefilled, output_tokens = [], 0, 0
        generate_seconds = time.perf_counter() - generate_started
        results: list[GenerationResult | None] = [None] * len(token_ids)
        for row, message in errors.items():
            results[row] = GenerationResult.failed(message)
        for request, output in zip(plan.requests, outputs):
            for plan_row in request.rows:
                results[valid[plan_row]] = _result(output, len(request.token_ids))
        assert all(r is not None for r in results), "every row has a result"
        stats = plan.stats
        self.last_stats = RunStats(
            rows=len(token_ids),
            error_rows=sum(1 for r in results if r.finish_reason == "error"),
            requests=stats.requests,
            prompt_tokens=stats.prompt_tokens,
            unique_prompt_tokens=stats.unique_tokens,
            planned_prefill_tokens=stats.prefill_tokens,
            prefill_tokens_computed=prefilled,
            output_tokens=output_tokens,
            groups=stats.groups,
            saving_ratio=stats.saving_ratio,
            plan_seconds=stats.seconds,
            tokenize_seconds=tokenize_seconds,
            generate_seconds=generate_seconds,
            seconds=time.perf_counter() - started,
            backend=self.backend_name,
        )
        return results

    def _generators(self, plan: Plan, valid, token_ids, params) -> list[torch.Generator | None]:
        """A generator per planned request: seeded rows get one derived from seed and prompt."""
        seen: Counter = Counter()
        occurrence: dict[int, int] = {}
        for plan_row, row in enumerate(valid):
            if params[row].seed is not None:
                key = (params[row].seed, tuple(token_ids[row]))
                occurrence[plan_row] = seen[key]
                seen[key] += 1
        generators: list[torch.Generator | None] = []
        for request in plan.requests:
            plan_row = request.rows[0]
            row_params = params[valid[plan_row]]
            if row_params.seed is None or row_params.greedy:
                generators.append(None)
                continue
            generator = torch.Generator()
            generator.manual_seed(
                row_seed(row_params.seed, request.token_ids, occurrence[plan_row])
            )
            generators.append(generator)
        return generators


def _result(output: RequestOutput, prompt_tokens: int) -> GenerationResult:
    return GenerationResult(
        text=output.text,
        token_ids=output.token_ids,
        finish_reason=output.finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(output.token_ids),
        error=output.error,
    )


def _is_messages(prompt: object) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def _params_per_row(sampling, rows: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * rows
    if isinstance(sampling, SamplingParams):
        return [sampling] * rows
    if isinstance(sampling, Sequence) and all(isinstance(p, SamplingParams) for p in sampling):
        if len(sampling) != rows:
            raise ValueError(
                f"sampling has {len(sampling)} SamplingParams for {rows} prompts; give one or one per prompt"
            )
        return list(sampling)
    raise TypeError(
        f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}"
    )


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


def _auto_kv_cache_bytes(device: torch.device) -> int:
    """A quarter of RAM on CPU (at most 8 GiB); 80% of free memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return min(physical_memory_bytes() // 4, 8 * 2**30)
