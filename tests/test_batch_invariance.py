"""Batch invariance (issue 30): a row's attention, linears and whole forward give the same
bits whatever else shares its step, however its prompt is cut into shared segments and
prefill chunks, and wherever the row sits.

The compiled CPU attention in its batch-invariant mode (``split_keys=0``) carries each
query's softmax state through its shared segments and its own keys one block at a time;
with segments starting on block boundaries (the planner's ``align``), the arithmetic of a
query is a function of its keys alone. These tests put one sequence's keys behind many
layouts and compare the bits; the default mode (key splits merged by log-sum-exp) is shown
to differ on the same layouts, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PagedLayout

from llm_operator.kernels import cpu_extension, cpu_ops, layout

DTYPES = [torch.float32, torch.bfloat16]
HEADS, KV_HEADS, DIM = 9, 3, 64


@pytest.fixture(scope="module")
def cpu_module():
    module = cpu_extension.load()
    assert module is not None, f"the CPU kernels did not load: {cpu_extension.failure()}"
    return module


class Layout(PagedLayout):
    """``PagedLayout`` with this module's heads; ``run`` returns the attention of every row
    through the compiled kernel."""

    def __init__(self, dtype, block_size, generator, num_blocks=None):
        super().__init__(block_size, KV_HEADS, DIM, generator, dtype, num_blocks)

    def run(self, module, split_keys: int) -> torch.Tensor:
        starts = [0]
        for *_, queries in self.requests:
            starts.append(starts[-1] + len(queries))
        shape = {"block_size": self.block_size, "num_blocks": self.k.shape[0]}
        own = layout.own_batch(
            starts, [r[1] for r in self.requests], [r[2] for r in self.requests], **shape
        )
        prefixes = []
        for level in sorted({s[2] for s in self.segments}):
            ids = [i for i, s in enumerate(self.segments) if s[2] == level]
            readers = [
                [row for r, request in enumerate(self.requests) if i in request[0]
                 for row in range(starts[r], starts[r + 1])]
                for i in ids
            ]  # fmt: skip
            prefixes.append(
                layout.prefix_batch(
                    readers,
                    [self.segments[i][0] for i in ids],
                    [self.segments[i][1] for i in ids],
                    num_rows=starts[-1],
                    **shape,
                )
            )
        q = torch.cat([r[3] for r in self.requests]).to(self.dtype)
        k_cpu, v_cpu = cpu_ops.to_cpu_layout(self.k, self.v)
        step_keys = cpu_ops.INVARIANT_STEP_KEYS if split_keys < 0 else None
        work = cpu_ops.attention_items(own, prefixes, step_keys)
        return cpu_ops.attention(module, q, k_cpu, v_cpu, work, DIM**-0.5, split_keys)


def _sequence(generator, length, dtype):
    def draw():
        return torch.randn(length, KV_HEADS, DIM, generator=generator).to(dtype)

    return draw(), draw(), torch.randn(length, HEADS, DIM, generator=generator).to(dtype)


def _layouts(dtype, block_size, seed):
    """(name, layout, row of the target's query at position 149) for one target sequence of
    150 tokens behind many layouts: alone, beside others, under one or two shared levels
    cut on block boundaries, as one row of a prefill chunk."""
    length = 150
    target = _sequence(torch.Generator().manual_seed(seed), length, dtype)
    keys, values, queries = target
    noise = torch.Generator().manual_seed(seed + 1)
    b = block_size

    def other(n_keys: int, n_rows: int):
        k, v, q = _sequence(noise, n_keys, dtype)
        return k, v, q[-n_rows:]

    cases = []
    alone = Layout(dtype, b, torch.Generator().manual_seed(1))
    alone.add([], keys, values, queries[-1:])
    cases.append(("alone", alone, 0))

    beside = Layout(dtype, b, torch.Generator().manual_seed(2))
    for n_keys, n_rows in [(40, 1), (300, 1), (7, 7)]:
        beside.add([], *other(n_keys, n_rows))
    beside.add([], keys, values, queries[-1:])
    cases.append(("beside 3 others, last", beside, 9))

    cut = 3 * b
    shared = Layout(dtype, b, torch.Generator().manual_seed(3))
    segment = shared.segment(keys[:cut], values[:cut], level=1)
    shared.add([segment], *other(20, 1))
    shared.add([segment], keys[cut:], values[cut:], queries[-1:])
    shared.add([], *other(90, 3))
    cases.append(("one shared level", shared, 1))

    first, second = b, 4 * b
    nested = Layout(dtype, b, torch.Generator().manual_seed(4))
    outer = nested.segment(keys[:first], values[:first], level=1)
    inner = nested.segment(keys[first:second], values[first:second], level=2)
    nested.add([outer], *other(30, 2))
    nested.add([outer, inner], keys[second:], values[second:], queries[-1:])
    nested.add([outer, inner], *other(11, 11))
    cases.append(("two shared levels", nested, 2))

    chunk = Layout(dtype, b, torch.Generator().manual_seed(5))
    chunk.add([], *other(64, 1))
    chunk.add([], keys, values, queries[-37:])
    cases.append(("last row of a 37-row prefill chunk", chunk, 1 + 36))

    big = Layout(dtype, b, torch.Generator().manual_seed(6))
    for _ in range(63):
        big.add([], *other(130, 1))
    big.add([], keys, values, queries[-1:])
    cases.append(("beside 63 decode rows", big, 63))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 8])
@pytest.mark.parametrize("split_keys", [-1, 0], ids=["aligned-steps", "block-steps"])
def test_invariant_attention_gives_a_row_the_same_bits_in_every_layout(
    cpu_module, dtype, block_size, split_keys
):
    """Both invariant modes: whole softmax steps over items aligned to them (the engine's,
    split_keys -1), and one block a step (0, for block sizes that do not tile a step)."""
    cases = _layouts(dtype, block_size, seed=block_size)
    outputs = {name: layout.run(cpu_module, split_keys)[row] for name, layout, row in cases}
    expected = outputs["alone"]
    for name, out in outputs.items():
        assert torch.equal(out, expected), f"{name}: differs from the row alone"
    # and it is the attention: close to the default mode's
    default = cases[0][1].run(cpu_module, cpu_ops.SPLIT_KEYS)[0]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (default.float() - expected.float()).abs().max() <= tolerance


def test_default_attention_depends_on_the_layout(cpu_module):
    """The default mode merges split keys and segments by log-sum-exp: the same row rounds
    differently across these layouts (what the invariant mode removes)."""
    cases = _layouts(torch.float32, 16, seed=16)
    outputs = [layout.run(cpu_module, 64)[row] for _, layout, row in cases]
    assert any(not torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_linear_gives_a_row_the_same_bits_at_every_row_count(cpu_module, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 96, generator=generator) * 0.1).to(dtype)
    packed = cpu_ops.pack_linear_weight(cpu_module, weight)
    x = torch.randn(64, 96, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    alone = [
        cpu_ops.packed_linear(cpu_module, x[i : i + 1], packed, bias, 200)[0] for i in range(64)
    ]
    for rows in (2, 7, 9, 64):
        out = cpu_ops.packed_linear(cpu_module, x[:rows], packed, bias, 200)
        for i in range(rows):
            assert torch.equal(out[i], alone[i]), f"row {i} of {rows}"


# ---------------------------------------------------------------- the engine


from helpers import REVIEWS  # noqa: E402
from test_faults import spark_available  # noqa: E402

from llm_operator import LLMOperator, SamplingParams  # noqa: E402

TASKS = (
    "You label customer reviews. Answer with one word: positive, negative or neutral. "
    "Examples: 'Great value' is positive; 'Arrived crushed' is negative.",
    "Extract the product name and the main complaint from the review below, then rate "
    "the urgency from 1 to 5.",
    "Summarize the review in one sentence.",
)


def _prompts(count: int) -> list[str]:
    """``count`` rows: three tasks (shared prefixes of different lengths) x the reviews."""
    return [
        f"{TASKS[i % len(TASKS)]}\nReview {i // len(TASKS)}: {REVIEWS[i % len(REVIEWS)]}"
        for i in range(count)
    ]


def _answers(model_dir, prompts, dtype, deterministic, **options):
    op = LLMOperator(
        model_dir, backend="native", dtype=dtype, deterministic=deterministic, **options
    )
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
    results = op.generate(prompts, sampling)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [(tuple(r.token_ids), r.logprob) for r in results]


# (name, input rows, engine options): one job's rows in other batches and chunkings
BATCHINGS = (
    ("alone", [[0], [4], [31], [63]], {}),
    ("in twos", [[0, 40], [4, 63], [31, 2]], {}),
    ("in sevens", [[0, 1, 2, 3, 4, 5, 6], [63, 31, 7, 8, 9, 10, 11]], {}),
    ("64-token iterations", [list(range(64))], {"prefill_batch_tokens": 64}),
    ("4 rows at a time", [list(range(64))], {"max_batch_size": 4}),
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("decoder", ["compiled", "eager"])
def test_deterministic_rows_get_the_same_bits_in_every_batch(
    tiny_llama_dir, dtype, decoder, monkeypatch
):
    """A row's greedy tokens and their log-probability (a function of every logit on the
    way) are bit-identical whether it runs in the 64-row job, alone, beside 1 or 6 others,
    in 64-token iterations or 4 rows at a time, on the compiled decoder or the eager path."""
    if decoder == "eager":  # the path of Gemma and Phi-3: eager layers, compiled kernels
        from llm_operator.models import cpu_decoder

        monkeypatch.setattr(cpu_decoder, "unsupported", lambda model: "told so")
    prompts = _prompts(64)
    whole = _answers(tiny_llama_dir, prompts, dtype, True)
    for name, batches, options in BATCHINGS:
        for rows in batches:
            answers = _answers(tiny_llama_dir, [prompts[r] for r in rows], dtype, True, **options)
            for row, answer in zip(rows, answers):
                assert answer == whole[row], f"{name}: row {row} differs"


def test_default_mode_rows_depend_on_their_batch(tiny_llama_dir):
    """Without deterministic, the same comparison finds a row whose log-probability
    changed with its batch (shared segments merged by log-sum-exp): the test above can
    fail."""
    prompts = _prompts(64)
    whole = _answers(tiny_llama_dir, prompts, "float32", False)
    alone = [_answers(tiny_llama_dir, [prompts[r]], "float32", False)[0] for r in (0, 4, 31, 63)]
    assert any(a != whole[r] for a, r in zip(alone, (0, 4, 31, 63)))


# ---------------------------------------------------------------- Spark retries, resumed checkpoints


@spark_available
def test_spark_partitions_and_a_retried_task_give_the_rows_of_one_partition(
    spark, tiny_llama_dir, tmp_path
):
    """40 rows in 4 Spark partitions of mixed tasks, one task SIGKILLed after its first
    output batch and retried, against the same rows in one partition: every row's text and
    log-probability are bit-identical (deterministic=True)."""
    import json
    import sys

    from pyspark import cloudpickle
    from test_faults import _job_group, _killing_llm_udf

    from llm_operator.integrations.spark import llm_infer

    cloudpickle.register_pickle_by_value(sys.modules["test_faults"])
    prompts = _prompts(40)
    options = dict(
        model=str(tiny_llama_dir), max_tokens=6, ignore_eos=True, logprobs=True,
        deterministic=True,
    )  # fmt: skip
    rows = [(i, prompt) for i, prompt in enumerate(prompts)]

    def collect(df, column) -> dict[int, tuple]:
        out = {}
        for row in df.select("id", column.alias("r")).collect():
            assert row["r"]["error"] is None, row["r"]["error"]
            out[row["id"]] = (row["r"]["text"], row["r"]["logprob"])
        return out

    one = spark.createDataFrame(spark.sparkContext.parallelize(rows, 1), "id int, prompt string")
    expected = collect(one, llm_infer("prompt", **options))
    mixed = rows[1::2] + rows[::2]  # partitions of other neighbours and other batch sizes
    four = spark.createDataFrame(spark.sparkContext.parallelize(mixed, 4), "id int, prompt string")
    marker = str(tmp_path / "killed")
    killing = _killing_llm_udf(options, marker, partition=1, after_frames=1)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "4")
    try:
        with _job_group(spark, "invariance-retry") as counts:
            got = collect(four, killing("prompt"))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert json.loads(open(marker).read())["attempt"] == 0  # the fault fired
    assert counts["failed_tasks"] >= 1  # and the task was retried
    assert sorted(got) == sorted(expected)
    assert [i for i in expected if got[i] != expected[i]] == []


def test_a_killed_checkpoint_job_resumes_to_the_rows_of_one_call(tiny_llama_dir, tmp_path):
    """``llm-operator run --deterministic --checkpoint``: kill -9 after the first chunks,
    rerun the same command (a new process computes the rest), and every row's tokens and
    log-probability equal a run of the whole table in one call, without a checkpoint."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_operator.cli import main

    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": _prompts(48)}), source)
    folder, out, clean = tmp_path / "ckpt", tmp_path / "out.jsonl", tmp_path / "clean.jsonl"

    def argv(output, *extra):
        return [
            "run", str(source), "--prompt-col", "text", "--output", str(output), "--model",
            str(tiny_llama_dir), "--max-tokens", "16", "--ignore-eos", "--temperature", "0",
            "--logprobs", "--deterministic", "--no-progress", *extra,
        ]  # fmt: skip

    resumable = argv(out, "--checkpoint", str(folder), "--checkpoint-rows", "3")
    env = dict(os.environ)
    command = [sys.executable, "-m", "llm_operator.cli", *resumable]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(folder.glob("part-*.jsonl"))) < 2 and time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the run ended before its chunks: {process.stderr.read()!r}")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert 2 <= len(list(folder.glob("part-*.jsonl"))) < 16
    assert main(resumable) == 0
    assert main(argv(clean)) == 0

    def rows(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    resumed, whole = rows(out), rows(clean)
    assert len(resumed) == len(whole) == 48
    assert all(r["out_logprob"] is not None for r in whole)
    assert resumed == whole


# ---------------------------------------------------------------- the option


def test_deterministic_resolves_per_backend_and_machine(monkeypatch):
    from llm_operator.config import EngineConfig
    from llm_operator.engine import factory

    monkeypatch.setattr(factory, "_has_amx", lambda: False)
    auto = EngineConfig(device="cpu")
    assert factory.invariant_kernels(auto, "native") is True
    assert factory.invariant_kernels(auto, "hf") is False  # hf: never batch-invariant
    off = EngineConfig(device="cpu", deterministic=False)
    assert factory.invariant_kernels(off, "native") is False
    monkeypatch.setattr(factory, "_has_amx", lambda: True)  # AMX: not measured, opt in
    assert factory.invariant_kernels(auto, "native") is False
    assert factory.invariant_kernels(EngineConfig(deterministic=True), "native") is True
    with pytest.raises(ValueError, match="native backend only; backend 'hf'"):
        EngineConfig(backend="hf", deterministic=True)
    with pytest.raises(ValueError, match="backend 'hf'"):  # auto that resolved to hf
        factory.invariant_kernels(EngineConfig(deterministic=True), "hf")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        EngineConfig(deterministic="yes")


def test_deterministic_rows_survive_preemption_bit_for_bit(tiny_llama_dir):
    """A KV budget of a few rows: requests are preempted and recomputed, and every row's
    tokens and log-probability still equal the unconstrained run's."""
    prompts = _prompts(24)
    whole = _answers(tiny_llama_dir, prompts, "float32", True)
    op = LLMOperator(
        tiny_llama_dir, backend="native", deterministic=True, kv_block_size=16,
        kv_cache_memory=24 * 16 * 512,  # 24 blocks of 16 tokens (512 bytes a token)
    )  # fmt: skip
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
    squeezed = [(tuple(r.token_ids), r.logprob) for r in op.generate(prompts, sampling)]
    assert op.backend().last_profile.preemptions > 0
    assert squeezed == whole


# ---------------------------------------------------------------- tail copies


def _columns_prompts() -> list[str]:
    """Short rows under a shared instruction, three levels deep (instruction, genre, year):
    most rows have a handful of tokens of their own, so a segment cut back to a block
    boundary would cost a large share of their work."""
    instruction = "Rate the movie for a family audience from 1 to 5. Answer with one digit."
    return [
        f"{instruction}\nGenre: {genre}\nYear: {year}\nTitle: {title}"
        for genre in ("comedy", "drama documentary")
        for year in (1994, 2011)
        for title in ("Heat", "Up", "Big Fish", "Arrival", "Ran")
    ]


@pytest.mark.parametrize("block_size", [16, 32])
def test_tail_copies_compute_no_shared_token_twice_and_keep_every_bit(tiny_llama_dir, block_size):
    """The batch-invariant mode plans as the default mode does (segments end where rows
    diverge, not on a block boundary) and copies each segment's partial last block into its
    readers' first block: it computes exactly the default mode's prefill tokens, and every
    row's tokens and log-probability are bit-identical to the row run alone (no sharing)."""
    prompts = _columns_prompts() + _prompts(12)
    options = {"kv_block_size": block_size}
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)

    def run(deterministic: bool, share: bool = True):
        op = LLMOperator(
            tiny_llama_dir, backend="native", deterministic=deterministic,
            share_prefixes=share, **options,
        )  # fmt: skip
        results = op.generate(prompts, sampling)
        assert all(r.error is None for r in results), [r.error for r in results]
        answers = [(tuple(r.token_ids), r.logprob) for r in results]
        return answers, op.last_stats.prefill_tokens_computed, op.backend().last_profile

    shared, prefill, profile = run(True)
    alone, alone_prefill, _ = run(True, share=False)
    _, default_prefill, default_profile = run(False)
    assert profile.tail_copies > 0 and profile.copied_tokens > 0
    assert default_profile.tail_copies == 0
    assert prefill == default_prefill < alone_prefill
    assert shared == alone
