"""The estimate: the replay reproduces the engine's schedule, the cost model's fit, the
calibration cache, output lengths from a sample, and LLMOperator.estimate's figures."""

from __future__ import annotations

import pytest
from test_hf_backend import three_level_prompts

from llm_operator import LLMOperator, SamplingParams
from llm_operator.estimate.calibration import load_or_calibrate, schedule_settings
from llm_operator.estimate.cost import FEATURES, CostModel
from llm_operator.estimate.lengths import LengthModel, Observed, group_key, observed
from llm_operator.estimate.replay import replay

SYSTEM_PREFIX = "You are a careful assistant. Answer in one short sentence, politely."


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _samples(op, plan, valid, results):
    """Each planned request's sampled steps, as the run made them."""
    return [
        observed(
            results[valid[r.rows[0]]].completion_tokens,
            results[valid[r.rows[0]]].finish_reason,
            r.max_tokens,
        ).samples
        for r in plan.requests
    ]


@pytest.mark.parametrize(
    ("options", "ignore_eos"),
    [
        ({}, True),
        ({}, False),
        ({"prefill_batch_tokens": 24, "kv_block_size": 4}, True),  # chunked prefill
        # qwen3 tiny: 1 KiB of K/V a token; 48 blocks of 4 hold a few rows: preemption
        ({"kv_cache_memory": 48 * 4 * 1024, "kv_block_size": 4}, True),
        ({"token_batching": False, "max_batch_size": 2}, True),  # waves
    ],
    ids=["default", "eos", "chunked", "preempting", "waves"],
)
def test_replay_is_the_native_engines_schedule(tiny_qwen3_dir, cache, options, ignore_eos):
    """Given each request's sampled steps, the replay schedules exactly the iterations the
    engine ran: the same tokens and sampled rows, step by step."""
    op = LLMOperator(tiny_qwen3_dir, backend="native", **options)
    prompts = three_level_prompts()
    sampling = [
        SamplingParams(max_tokens=12 - i % 3, ignore_eos=ignore_eos) for i in range(len(prompts))
    ]
    results = op.generate(prompts, sampling)
    prepared = op.prepare(prompts, sampling)
    plan, valid = op._plan(prepared.token_ids, prepared.params)
    replayed = replay(
        plan,
        _samples(op, plan, valid, results),
        schedule_settings(op, op.backend()),
        keep_steps=True,
    )
    steps = op.backend().last_profile.steps
    assert [(int(f[1]), int(f[3])) for f in replayed.steps] == [(t, r) for t, r, _ in steps]
    assert replayed.prefill_tokens >= op.last_stats.prefill_tokens_computed
    assert replayed.preemptions == op.backend().last_profile.preemptions
    if "kv_cache_memory" in options:
        assert replayed.preemptions > 0, "the small pool should force preemption"


def test_cost_model_fit_recovers_coefficients():
    true = (0.01, 0.002, 0.0003, 0.0005, 0.0001, 1e-6, 3e-7, 1e-7)
    rows = [
        (1, t, min(t, 1024), s, c, a, d, e)
        for t, s, c, a, d, e in [
            (1, 1, 1, 0, 100, 0), (8, 8, 8, 0, 4000, 900), (32, 32, 32, 0, 9000, 4000),
            (512, 1, 2, 130000, 0, 0), (1024, 2, 3, 520000, 0, 0), (100, 20, 30, 5000, 2000, 0),
            (7, 0, 1, 28, 0, 0), (2048, 0, 128, 2100000, 0, 0), (4, 4, 4, 0, 50, 4000),
            (256, 128, 128, 0, 9000, 128),
        ]
    ]  # fmt: skip
    seconds = [sum(c * f for c, f in zip(true, row)) for row in rows]
    model = CostModel.fit(rows, seconds)
    for fitted, expected in zip(model.coefficients, true):
        assert fitted == pytest.approx(expected, rel=1e-6)
    assert model.relative_error < 1e-9
    # a feature that costs nothing is fitted to zero, never negative
    no_shared = [s - 1e-7 * row[7] for s, row in zip(seconds, rows)]
    model = CostModel.fit(rows, no_shared)
    assert all(c >= 0 for c in model.coefficients)
    assert model.as_dict()["decode_shared_keys"] == pytest.approx(0.0, abs=1e-12)
    assert set(model.as_dict()) == set(FEATURES)
    # features left out are 0
    subset = CostModel.fit(rows, seconds, features=("iterations", "tokens"))
    assert subset.as_dict()["sampled"] == 0.0 and subset.as_dict()["tokens"] > 0
    with pytest.raises(ValueError, match="one measured seconds per feature row"):
        CostModel.fit(rows, seconds[:-1])


def test_length_model_draws_from_the_same_group():
    from llm_operator.planner import build_plan

    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 8, 8, 7, 7, 6, 6]
    prompts = [a + [20 + i] for i in range(4)] + [b + [40 + i] for i in range(4)]
    plan = build_plan(prompts, [50] * 8)
    keys = {group_key(r) for r in plan.requests}
    assert len(keys) == 2 and "" not in keys
    key_a = group_key(next(r for r in plan.requests if list(r.token_ids[:8]) == a))
    key_b = group_key(next(r for r in plan.requests if list(r.token_ids[:8]) == b))
    model = LengthModel.of([(key_a, observed(3, "stop", 50)), (key_b, observed(30, "length", 30))])
    samples = model.samples(plan, [False] * 8)
    for request, n in zip(plan.requests, samples):
        # group a stops after 3 steps; group b's row was cut at 30: it runs to its max (50)
        assert n == (3 if list(request.token_ids[:8]) == a else 50)
    assert LengthModel().samples(plan, [False] * 8) == [50] * 8  # nothing sampled: the bound
    assert model.samples(plan, [True] * 8) == [50] * 8  # EOS ignored: max_tokens exactly
    assert observed(0, "stop", 5) == Observed(1, False, 5)


def test_estimate_with_known_lengths_is_the_plans_run(tiny_llama_dir, cache):
    """EOS ignored: no sample; output tokens, prefill and iterations are the run's own."""
    op = LLMOperator(tiny_llama_dir, backend="native")
    prompts = three_level_prompts() + [None]
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    first = op.estimate(prompts, sampling)
    assert not first.calibration["cached"] and first.calibration["path"]
    assert first.sample_rows == 0 and first.error_rows == 1 and first.rows == len(prompts)
    op.generate(prompts, sampling)
    stats = op.last_stats
    assert first.output_tokens == stats.output_tokens == 5 * (len(prompts) - 1)
    assert first.prefill_tokens == stats.prefill_tokens_computed
    assert first.iterations == op.backend().last_profile.iterations
    assert first.low_seconds <= first.seconds <= first.high_seconds
    assert first.seconds > 0 and first.machine_hours == pytest.approx(first.seconds / 3600)
    second = op.estimate(prompts, sampling, executors=2)
    assert second.calibration["cached"]
    # only prepare is re-measured: the rest is the cached cost model on the same plan
    assert second.seconds - second.prepare_seconds == pytest.approx(
        first.seconds - first.prepare_seconds, rel=1e-6
    )
    assert second.executor_seconds <= second.seconds <= second.machine_hours * 3600 * 1.001
    text = second.report()
    assert "on 2 executors" in text and f"{len(prompts):,}" in text


def test_estimate_samples_rows_for_lengths(tiny_llama_dir, cache):
    op = LLMOperator(tiny_llama_dir, backend="native")
    prompts = three_level_prompts()
    sampling = SamplingParams(max_tokens=8)
    estimate = op.estimate(prompts, sampling, sample_rows=3)
    assert estimate.sample_rows == 3 and estimate.sample_seconds > 0
    assert estimate.sample_predicted_seconds > 0
    assert 0 < estimate.output_tokens <= 8 * len(prompts)
    unsampled = op.estimate(prompts, sampling, sample_rows=0)
    assert unsampled.sample_rows == 0
    assert unsampled.output_tokens == 8 * len(prompts)
    assert any("upper bound" in a for a in unsampled.assumptions)
    assert unsampled.seconds >= estimate.seconds * 0.8


def test_calibration_cache_is_keyed_by_the_engine(tiny_llama_dir, cache):
    op = LLMOperator(tiny_llama_dir, backend="native")
    first = load_or_calibrate(op)
    assert load_or_calibrate(op).cached
    other = LLMOperator(tiny_llama_dir, backend="native", prefill_batch_tokens=128)
    assert not load_or_calibrate(other).cached
    assert not load_or_calibrate(op, recalibrate=True).cached
    assert first.measured and all(m["seconds"] > 0 for m in first.measured)
    assert len(list((cache / "calibration").glob("*.json"))) == 2


def test_hf_backend_estimates_too(tiny_llama_dir, cache):
    op = LLMOperator(tiny_llama_dir, backend="hf")
    estimate = op.estimate(three_level_prompts(), SamplingParams(max_tokens=4, ignore_eos=True))
    assert estimate.backend == "hf" and estimate.seconds > 0
    assert not estimate.calibration["per_iteration"]  # fitted to whole jobs


@pytest.mark.parametrize(
    ("options", "message"),
    [({"sample_rows": -1}, "sample_rows"), ({"sample_rows": "some"}, "sample_rows"),
     ({"executors": 0}, "executors"), ({"executors": 1.5}, "executors")],
)  # fmt: skip
def test_bad_options_name_themselves(tiny_llama_dir, cache, options, message):
    op = LLMOperator(tiny_llama_dir, backend="native")
    with pytest.raises(ValueError, match=message):
        op.estimate(["a prompt"], SamplingParams(max_tokens=2), **options)


def test_auto_sample_stays_within_its_cap_and_budget(tiny_llama_dir, cache):
    from llm_operator.estimate.estimate import auto_sample_size

    op = LLMOperator(tiny_llama_dir, backend="native")
    prompts = three_level_prompts()
    decode_heavy = op.estimate(prompts, SamplingParams(max_tokens=40))
    # forty tokens a row after short prompts: lengths decide the time, so rows are sampled
    assert 1 <= decode_heavy.sample_rows <= auto_sample_size(len(prompts))
    assert not any("upper bound" in a for a in decode_heavy.assumptions)
    # one token a row at most: lengths cannot matter, nothing is sampled
    one_token = op.estimate(prompts, SamplingParams(max_tokens=1))
    assert one_token.sample_rows == 0
    assert one_token.output_tokens == len(prompts)


def test_executors_split_a_large_group(tiny_llama_dir, cache):
    """One prefix group larger than an even share is cut over the executors (as
    co_locate cuts it): more executors finish sooner, and their machine time grows by the
    prefix each piece prefills again. Each row has a long own part, so the rows' work,
    not the per-step cost every executor pays alike, decides the time."""
    op = LLMOperator(tiny_llama_dir, backend="native")
    prompts = [
        f"{SYSTEM_PREFIX} question number {i}: "
        + " ".join(f"item{i * 31 + j} weather{j}" for j in range(12))
        for i in range(16)
    ]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    four = op.estimate(prompts, sampling, executors=4)
    assert four.error_rows == 0 and four.prompt_tokens > 16 * 60  # long own parts, all fit
    # ``seconds`` is the whole job on one machine at the same measured rates (two estimates
    # would each time their own rates on a shared, noisy machine)
    assert four.executor_seconds < 0.6 * four.seconds
    assert four.machine_hours * 3600 >= four.seconds * 0.99
