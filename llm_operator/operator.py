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
from llm_operator.engine.base import Backend
from llm_operator.engine.run import Run, run_plan
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
    way); a list of chat messages goes through the model's chat template. Spark, Dask
    and the command line wrap strings as chat messages themselves when the model has a
    chat template (their ``chat="auto"``).
    model: an alias (``llm_operator.models.known_aliases()``), a Hugging Face
        model directory, a ``.gguf`` file, or a Hugging Face Hub id (``"org/name"``,
        taken from the Hub cache or downloaded into it; ``revision`` picks a branch,
        tag or commit).
    The tokenizer loads at once; the model loads on the first ``generate``.
    """

    def __init__(self, model: str | os.PathLike, **options) -> None:
        from llm_operator.models import load_tokenizer, resolve_model
        from llm_operator.models.info import read_model_info

        option_table.split(options, ["engine"])  # TypeError naming an unknown option
        self.config = EngineConfig(**options)
        if self.config.backend == "vllm":
            from llm_operator.engine.vllm.backend import require_vllm

            require_vllm()
        trust = self.config.trust_remote_code
        self.model = resolve_model(
            model,
            cache_dir=self.config.cache_dir,
            trust_remote_code=trust,
            revision=self.config.revision,
        )
        self.tokenizer = load_tokenizer(self.model.path, trust_remote_code=trust)
        self.model_info = read_model_info(self.model.path, self.tokenizer, trust_remote_code=trust)
        self.model_config = self.model_info.config
        self.max_context = self.model_info.max_context
        self.last_stats = RunStats()
        self._backend: Backend | None = None
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

            config = self.model_config
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            vocab_size = getattr(text, "vocab_size", None) or len(self.tokenizer)
            self._constraints = Constraints(
                self.tokenizer,
                vocab_size,
                self.model_info.eos_token_ids,
                jump_forward=self.config.jump_forward,
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
        # rows with choices and logprobs: one scoring request per choice, planned with the
        # rows (they share the row's prompt), feeding the choice's tokens instead of sampling
        scoring = self._scoring_rows(prepared) if constrained else []
        token_ids = [*prepared.token_ids, *(prepared.token_ids[row] for row, _, _ in scoring)]
        params = [
            *prepared.params,
            *(SamplingParams(max_tokens=len(ids), ignore_eos=True) for _, _, ids in scoring),
        ]
        plan, valid = self._plan(token_ids, params, scoring_from=rows)
        forced = {
            r.request_id: scoring[valid[r.rows[0]] - rows][2]
            for r in plan.requests
            if valid[r.rows[0]] >= rows
        }
        backend = self.backend() if plan.requests else None
        generate_started = time.perf_counter()
        user_rows = sum(1 for row in valid if row < rows)  # not the scoring requests
        with ProgressBar(user_rows, enabled=self.config.progress) as bar:
            run = Run(
                plan,
                [params[valid[r.rows[0]]] for r in plan.requests],
                tokenizer=self.tokenizer,
                eos_token_ids=self.model_info.eos_token_ids,
                max_context=self.max_context,
                progress=bar.update,
                constraints=self.constraints() if constrained else None,
                forced=forced,
            )
            outputs = run_plan(backend, run) if backend is not None else run.result()
        generate_seconds = time.perf_counter() - generate_started
        results: list[GenerationResult | None] = [None] * rows
        scores: dict[int, dict[str, float]] = {}
        for row, message in prepared.errors.items():
            results[row] = GenerationResult.failed(message)
        for request, output in zip(plan.requests, outputs.outputs):
            for plan_row in request.rows:
                row = valid[plan_row]
                if row >= rows:
                    source, choice, _ = scoring[row - rows]
                    scores.setdefault(source, {})[choice] = output.logprob
                else:
                    results[row] = GenerationResult.of(output, len(request.token_ids))
        for row, choice_logprobs in scores.items():
            results[row] = results[row]._replace(choice_logprobs=choice_logprobs)
        assert all(r is not None for r in results), "every row has a result"
        self.last_stats = RunStats.of(
            plan.stats,
            outputs,
            results,
            forced_tokens=run.forced_tokens,
            tokenize_seconds=prepared.seconds,
            generate_seconds=generate_seconds,
            seconds=time.perf_counter() - started,
            backend=self.backend_name,
        )
        return results

    def estimate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        sample_rows: int | str = "auto",
        executors: int = 1,
        seed: int = 0,
        recalibrate: bool = False,
    ):
        """What ``generate(prompts, sampling)`` would cost here, without running it whole:
        an ``llm_operator.estimate.Estimate`` (seconds with a range, rows/s, output tokens,
        machine-hours on ``executors`` machines like this one, and what it assumed).

        It loads the model, calibrates the backend on this machine once (10-20 s on a
        2-core CPU, cached per model, backend, dtype and device), generates ``sample_rows``
        rows spread over the prefix groups for their output lengths, and replays the
        plan's schedule against the calibrated costs. ``"auto"``: 4 rows, one per prefix
        group in turn, then more while the sample costs at most 5% of the job (at most 2%
        of the rows, or 64); none when output lengths barely move its time; 0: none,
        every row then runs to its max_tokens. Rows with ``ignore_eos`` need no sample. ``seconds`` excludes loading
        the model (``load_seconds`` says what that took here)."""
        from llm_operator.estimate import estimate

        return estimate(
            self,
            prompts,
            sampling,
            sample_rows=sample_rows,
            executors=executors,
            seed=seed,
            recalibrate=recalibrate,
        )

    def _scoring_rows(self, prepared: PreparedPrompts) -> list[tuple[int, str, tuple[int, ...]]]:
        """(input row, choice, the choice's tokens) for each choice of each valid row that
        asks for choices and logprobs."""
        scoring = []
        for row, (ids, p) in enumerate(zip(prepared.token_ids, prepared.params)):
            if ids is not None and p.choices is not None and p.logprobs:
                trie = self.constraints().trie(p.choices)
                tokens = self.constraints().choice_tokens(p.choices)
                scoring.extend((row, choice, tuple(t)) for choice, t in zip(trie.choices, tokens))
        return scoring

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
            segment_align=self.segment_align(),
        )
        return plan, valid

    def segment_align(self) -> int:
        """``engine.factory.segment_align`` for this operator's backend."""
        from llm_operator.engine.factory import segment_align

        return segment_align(self.config, self.backend_name)


option_table.keyword_signature(LLMOperator.__init__, ["engine"])
LLMOperator.__doc__ += f"\n    Options:\n{option_table.describe(['engine'])}\n"
