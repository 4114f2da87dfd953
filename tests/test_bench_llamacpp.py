"""llama.cpp's server as a bench system (``bench.baselines.llama_cpp``).

Where ``.venv-llamacpp`` is missing (``make llamacpp-env`` builds llama-server from source,
about ten minutes) the run tests are skipped; the skip and the reasons a system is not
measured are tested everywhere. The run tests drive the real SmolLM2 alias (its Q4_1 GGUF,
and the F32 GGUF converted from the same weights) on the tiny workloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_operator.cli import main
from llm_operator.models.registry import locate_alias_file
from llm_operator_bench.baselines.llama_cpp import LlamaCppUnavailable, find_llamacpp_python
from llm_operator_bench.core.suite import _run_llamacpp
from llm_operator_bench.core.systems import SYSTEMS

ALIAS = "smollm2-135m-instruct"


def _no_log(message: str) -> None:
    pass


def test_without_its_venv_a_llamacpp_system_is_skipped_with_the_make_target(tmp_path):
    missing = str(tmp_path / "no-such-venv" / "bin" / "python")
    with pytest.raises(LlamaCppUnavailable, match="make llamacpp-env"):
        find_llamacpp_python(missing)
    result = _run_llamacpp(SYSTEMS["llamacpp-f32"], ALIAS, "/x", [], 1, missing, 4, _no_log)
    assert "make llamacpp-env" in result["skipped"]


def test_a_model_without_a_gguf_of_its_own_skips_the_gguf_system(tmp_path):
    result = _run_llamacpp(
        SYSTEMS["llamacpp"], str(tmp_path), str(tmp_path), [], 1, None, 4, _no_log
    )
    assert "not a GGUF alias" in result["skipped"]


@pytest.fixture(scope="module")
def llamacpp_report(tmp_path_factory):
    try:
        python = find_llamacpp_python()
    except LlamaCppUnavailable as error:
        pytest.skip(str(error))
    try:
        locate_alias_file(ALIAS)
    except (OSError, ValueError) as error:  # the SmolLM2 package: make setup-test
        pytest.skip(str(error))
    out = tmp_path_factory.mktemp("bench-llamacpp")
    argv = ["bench", "--size", "tiny", "--model", ALIAS, "--repeat", "1", "--out", str(out)]
    argv += ["--systems", "hf-static,llamacpp,llamacpp-f32", "--workloads", "etl-fewshot"]
    assert (
        main([*argv, "--name", "tiny", "--llamacpp-python", python, "--llamacpp-parallel", "4"])
        == 0
    )
    return json.loads((Path(out) / "tiny.json").read_text())


@pytest.mark.slow
def test_llamacpp_systems_run_the_workload_and_reuse_shared_prefixes(llamacpp_report):
    records = {r["system"]: r for r in llamacpp_report["results"]}
    for system in ("llamacpp", "llamacpp-f32"):
        record = records[system]
        assert record["status"] == "ok", record["error"]
        assert record["output_tokens"] > 0
        assert record["peak_rss_bytes"] > 50 * 2**20  # the server holds the model
        # the rows share few-shot prefixes: the server's prompt cache computes fewer tokens
        assert 0 < record["prefill_tokens_computed"] < record["prompt_tokens"]
    assert records["llamacpp"]["dtype"] == "gguf"
    assert records["llamacpp-f32"]["dtype"] == "float32"
    # the same weights at (nearly) the same precision: greedy answers mostly agree with HF's
    # (llama.cpp keeps its KV cache in f16, so a close call may go the other way)
    assert records["llamacpp-f32"]["agreement_with_hf_static"] >= 0.5
