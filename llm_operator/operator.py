"""LLMOperator: resolve the model, plan the batch, run a backend, return rows in input order.

prompts --prepare_prompts--> token ids per row (bad rows: error messages)
        --build_plan-------> Plan (shared segments, requests, groups; decode-first order)
        --run_plan---------> one output per planned request (the backend steps; the Run
                             owns stop rules, outputs, error rows, progress)
        --------------------> one GenerationResult per input row, in input order
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from llm_operator import options as option_table
from llm_operator.config import EngineConfig
from llm_operator.embedding import EmbeddingResult
from llm_operator.engine.run import Backend, Run, run_plan
from llm_operator.engine.scoring import add_scoring, forced_tokens, row_results
from llm_operator.planner import Plan, build_plan
from llm_operator.progress import ProgressBar
from llm_operator.prompts.encode import PreparedPrompts, Prompt, prepare_prompts
from llm_operator.results import GenerationResult, RunStats
from llm_operator.sampling import SamplingParams


class LLMOperator:
    """Runs one LLM over a batch of prompts, sharing common prefixes.

    >>> op = LLMOperator("smollm2-135m-instruct")
    >>> results = op.generate(["Classify: ...", ...], SamplingParams(max_tokens=8))

    Prompts: a string is the text the model sees, as it is (``vllm.LLM.generate``'s
    way); a list of chat messages goes through the model's chat template (Spark, Dask
    and the CLI wrap strings as chat messages where the model has one: ``chat="auto"``).
    model: an alias (``llm_operator.models.known_aliases()``), a Hugging Face model
    directory, a ``.gguf`` file, or a Hub id (``"org/name"``; ``revision`` picks one).
    The tokenizer loads at once; the model on the first ``generate`` or ``embed``.
    """

    def __init__(self, model: str | os.PathLike, **options) -> None:
        from llm_operator.engine.factory import max_context
        from llm_operator.models.info import open_model

        option_table.split(options, ["engine"])  # TypeError naming an unknown option
        self.config = EngineConfig(**options)
        if self.config.backend == "vllm":  # before the tokenizer: say how to get vLLM
            from llm_operator.engine.vllm.backend import require_vllm

            require_vllm()
        self.model, self.tokenizer, self.model_info = open_model(model, self.config)
        self.model_config = self.model_info.config
        self.max_context = max_context(self.model_info, self.backend_name)
        self.last_stats = RunStats()
        self._backend: Backend | None = None
        self._embedder = None
        self._constraints = None

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (``chat="auto"`` uses it then)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def backend_name(self) -> str:
        """The backend that runs (``engine.factory.choose_backend``)."""
        from llm_operator.engine.factory import choose_backend

        return choose_backend(self.config, self.model_info)

    def backend(self) -> Backend:
        """The backend, loading the model on first use."""
        if self._backend is None:
            from llm_operator.engine.factory import build_backend

            self._backend = build_backend(self.config, self.model_info, self.tokenizer)
        return self._backend

    # -- public ----------------------------------------------------------
    def constraints(self):
        """Compiles choices, regex and JSON schema constraints for this model (cached)."""
        if self._constraints is None:
            from llm_operator.engine.constraints import Constraints

            self._constraints = Constraints.for_model(
                self.tokenizer, self.model_info, jump_forward=self.config.jump_forward
            )
        return self._constraints

    def prepare(self, prompts: Sequence[Prompt], sampling=None) -> PreparedPrompts:
        """Token ids, sampling parameters and errors per row (``prompts.prepare_prompts``)."""
        return prepare_prompts(self.tokenizer, prompts, sampling, self.max_context)

    def plan(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Plan:
        """The prefix-sharing plan of these prompts, without loading the model (bad rows left out)."""
        prepared = self.prepare(prompts, sampling)
        return self._plan(prepared.token_ids, prepared.params)[0]

    def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int] | None]:
        """The token ids each prompt runs with (chat template applied); None where the row
        would fail (null, empty, too long, not a prompt)."""
        return self.prepare(prompts).token_ids

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in input order; bad rows get finish_reason="error"."""
        started = time.perf_counter()
        prepared = self.prepare(prompts, sampling)
        rows = len(prepared.token_ids)
        constrained = any(p.constraint is not None for p in prepared.params)
        constraints = self.constraints() if constrained else None
        token_ids, params, scoring = add_scoring(prepared, constraints)
        plan, valid = self._plan(token_ids, params, scoring_from=rows)
        backend = self.backend() if plan.requests else None
        generate_started = time.perf_counter()
        user_rows = sum(1 for row in valid if row < rows)  # not the scoring requests
        sources = [*prompts, *(prompts[s.row] for s in scoring)]  # what each plan row asked
        with ProgressBar(user_rows, enabled=self.config.progress) as bar:
            run = Run(
                plan,
                [params[valid[r.rows[0]]] for r in plan.requests],
                tokenizer=self.tokenizer,
                eos_token_ids=self.model_info.eos_token_ids,
                max_context=self.max_context,
                progress=bar.update,
                constraints=constraints,
                forced=forced_tokens(plan, valid, scoring, rows),
                sources=[sources[valid[r.rows[0]]] for r in plan.requests],
            )
            outputs = run_plan(backend, run) if backend is not None else run.result()
        generate_seconds = time.perf_counter() - generate_started
        results = row_results(prepared, plan, valid, outputs, scoring)
        self.last_stats = RunStats.of(
            plan.stats,
            outputs,
            results,
            forced_tokens=run.forced_tokens,
            tokenize_seconds=prepared.seconds,
            generate_seconds=generate_seconds,
            seconds=time.perf_counter() - started,
            backend=self.backend_name,
            engine_paths=paths.describe() if (paths := getattr(backend, "paths", None)) else "",
        )
        return results

    def embed(
        self, prompts: Sequence[Prompt], pooling="last", normalize=True, dimensions=None
    ) -> list[EmbeddingResult]:
        """One vector per prompt in input order, planned like ``generate`` ("last", "mean" or
        "cls" pooling; ``dimensions``, then ``normalize``; see ``llm_operator.embedding``)."""
        from llm_operator.embedding import embed

        return embed(self, prompts, pooling, normalize, dimensions)

    def embedder(self):
        """The backend's embedder (``factory.build_embedder``), loaded on first use."""
        from llm_operator.engine.factory import build_embedder as build

        self._embedder = self._embedder or build(self.config, self.model_info, self.backend)
        return self._embedder

    def estimate(self, prompts: Sequence[Prompt], sampling=None, **options):
        """What ``generate(prompts, sampling)`` would cost here, without running it whole:
        an ``llm_operator.estimate.Estimate`` (seconds with a range, rows/s, machine-hours),
        from a calibration of the backend and a few sample rows. Options: those of
        ``llm_operator.estimate.estimate`` (``sample_rows``, ``executors``, ``seed``, ...)."""
        from llm_operator.estimate import estimate

        return estimate(self, prompts, sampling, **options)

    def _plan(self, token_ids, params, scoring_from: int | None = None) -> tuple[Plan, list[int]]:
        """The plan over the valid rows, and the input row of each plan row (rows from
        ``scoring_from`` on are scoring requests: never merged)."""
        valid = [row for row, ids in enumerate(token_ids) if ids is not None]
        plan = build_plan(
            [token_ids[row] for row in valid],
            [params[row].max_tokens for row in valid],
            merge_keys=[
                params[row]
                if params[row].greedy and (scoring_from is None or row < scoring_from)
                else None
                for row in valid
            ],
            min_shared_tokens=self.config.min_shared_tokens,
            decode_first=self.config.decode_first,
            share_prefixes=self.config.share_prefixes,
        )
        return plan, valid


option_table.keyword_signature(LLMOperator.__init__, ["engine"])
LLMOperator.__doc__ += f"\n    Options:\n{option_table.describe(['engine'])}\n"
