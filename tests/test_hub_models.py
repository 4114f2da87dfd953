"""Hugging Face Hub ids as `model=`: resolved from a local Hub cache (offline), checked on
the driver before any job, and the error of an unusable LLM_OPERATOR_CACHE.

The Hub cache is built by hand, laid out as huggingface_hub reads it:
``models--org--name/snapshots/<40-hex commit>/<files>`` and ``refs/<branch or tag>``
holding the commit; HF_HUB_OFFLINE=1 (conftest), so nothing touches the network.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llm_operator import LLMOperator, SamplingParams
from llm_operator.models import registry
from llm_operator.models.registry import (
    HUB_ALLOW_PATTERNS,
    HUB_IGNORE_PATTERNS,
    check_model_available,
    resolve_model,
)

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40
PROMPTS = ["The battery lasts", "Shipping took 12 days and", "Great value for"]
SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


def _publish(cache: Path, repo_id: str, model_dir: Path, commit: str, refs=("main",)) -> Path:
    """Put `model_dir`'s files into the Hub cache as snapshot `commit` of `repo_id`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it raw
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache that huggingface_hub uses now, offline. huggingface_hub reads
    HF_HUB_CACHE and HF_HUB_OFFLINE into `constants` at import, so both are patched."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def published(hub_cache: Path, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> dict[str, Path]:
    """REPO: main = the tiny Llama (COMMIT_MAIN), tag v2 = the tiny Qwen2 (COMMIT_V2)."""
    return {
        "main": _publish(hub_cache, REPO, tiny_llama_dir, COMMIT_MAIN),
        "v2": _publish(hub_cache, REPO, tiny_qwen2_dir, COMMIT_V2, refs=("v2",)),
    }


def _tokens(model, **options) -> tuple[list[tuple[int, ...]], LLMOperator]:
    op = LLMOperator(model, backend="hf", device="cpu", **options)
    return [tuple(r.token_ids) for r in op.generate(PROMPTS, SAMPLING)], op


def test_a_hub_id_generates_what_its_directory_generates(published, tiny_llama_dir) -> None:
    resolved = resolve_model(REPO)
    assert resolved.source == "hub" and resolved.name == REPO
    assert resolved.path == published["main"]
    from_hub, op = _tokens(REPO)
    from_dir, _ = _tokens(str(tiny_llama_dir))
    assert op.model.path == published["main"] and op.model_info.path == published["main"]
    assert op.model_config.model_type == "llama"
    assert from_hub == from_dir and all(len(t) == SAMPLING.max_tokens for t in from_hub)


def test_a_revision_selects_another_snapshot(published, hub_cache, tiny_qwen2_dir) -> None:
    from_v2, op = _tokens(REPO, revision="v2")
    assert op.model.path == published["v2"] and op.model_config.model_type == "qwen2"
    assert from_v2 == _tokens(str(tiny_qwen2_dir))[0]
    assert from_v2 != _tokens(REPO)[0]  # main is the Llama: another model, other tokens
    assert resolve_model(REPO, revision=COMMIT_V2).path == published["v2"]  # a commit hash
    assert resolve_model(REPO, revision=COMMIT_MAIN).path == published["main"]
    with pytest.raises(ValueError, match="revision 'nope'") as caught:
        resolve_model(REPO, revision="nope")
    assert str(hub_cache) in str(caught.value)  # the cache it looked in
    check_model_available(REPO, "v2")
    # a revision applies to Hub ids only: a directory resolves to itself whatever it says
    assert resolve_model(str(tiny_qwen2_dir), revision="v2").path == tiny_qwen2_dir.resolve()
    with pytest.raises(ValueError, match="revision 'nope'"):
        check_model_available(REPO, "nope")


def _assert_says_what_to_do(message: str, repo_id: str, cache: Path) -> None:
    assert repr(repo_id) in message and str(cache) in message
    for hint in ("HF_TOKEN", "HF_HUB_OFFLINE", f"hf download {repo_id}", "huggingface-cli"):
        assert hint in message, (hint, message)


def test_a_missing_hub_id_fails_on_the_driver_naming_cache_and_fix(published, hub_cache) -> None:
    from llm_operator.integrations.infer_options import make_options

    missing = "tiny-org/missing"
    with pytest.raises(ValueError) as caught:
        check_model_available(missing)
    _assert_says_what_to_do(str(caught.value), missing, hub_cache)
    assert "not in the local Hub cache" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        make_options(model=missing, max_tokens=4)
    _assert_says_what_to_do(str(caught.value), missing, hub_cache)
    with pytest.raises(ValueError) as caught:  # and on a worker, the same message
        resolve_model(missing)
    _assert_says_what_to_do(str(caught.value), missing, hub_cache)

    # what the driver lets through: a cached Hub id, paths (they may exist only on the
    # workers), aliases and bare names (checked where the model loads)
    assert make_options(model=REPO, revision="v2").engine.revision == "v2"
    for model in ("/no/such/model", "m", "smollm2-135m-instruct", str(published["main"])):
        assert make_options(model=model).model == model

    # a bare name is a (legacy) Hub id too: looked up in the cache, refused naming the aliases
    with pytest.raises(ValueError, match="not a known alias") as caught:
        resolve_model("no-such-model")
    _assert_says_what_to_do(str(caught.value), "no-such-model", hub_cache)
    assert "smollm2-135m-instruct" in str(caught.value) and ".gguf" in str(caught.value)


def test_a_cached_config_without_weights_is_refused_offline(hub_cache, tiny_llama_dir) -> None:
    snapshot = hub_cache / "models--tiny-org--no-weights" / "snapshots" / COMMIT_MAIN
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_llama_dir / "config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT_MAIN)
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights.*HF_HUB_OFFLINE"):
        check_model_available("tiny-org/no-weights")
    with pytest.raises(ValueError, match="Hub model 'tiny-org/no-weights'.*safetensors"):
        resolve_model("tiny-org/no-weights")


def test_spark_and_dask_refuse_a_missing_hub_id_before_any_job(hub_cache, spark) -> None:
    import dask.dataframe as dd
    import pandas as pd
    from helpers import job_group

    from llm_operator.integrations import dask as llm_dask
    from llm_operator.integrations.spark import llm_infer

    frame = spark.createDataFrame([("a",), ("b",)], ["prompt"])
    with job_group(spark, "hub-missing") as tracker:
        with pytest.raises(ValueError, match="'org/missing'.*Hub cache") as caught:
            frame.withColumn("out", llm_infer("prompt", model="org/missing", max_tokens=4))
        assert list(tracker.getJobIdsForGroup("hub-missing")) == []
    _assert_says_what_to_do(str(caught.value), "org/missing", hub_cache)
    ddf = dd.from_pandas(pd.DataFrame({"prompt": ["a", "b"]}), npartitions=1)
    with pytest.raises(ValueError, match="'org/missing'.*Hub cache"):
        llm_dask.llm_infer(ddf, "prompt", output="out", model="org/missing")


DRIVER_SCRIPT = """
import json, sys
from llm_operator.integrations.infer_options import make_options
try:
    make_options(model="org/missing", max_tokens=4)
    raised = None
except ValueError as error:
    raised = str(error)
heavy = [name for name in ("torch", "transformers", "xgrammar") if name in sys.modules]
print(json.dumps({"raised": raised, "heavy": heavy}))
"""


def test_the_driver_check_imports_no_torch(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    _assert_says_what_to_do(report["raised"], "org/missing", tmp_path)


def test_only_the_files_a_model_needs_are_downloaded() -> None:
    """snapshot_download gets HUB_ALLOW_PATTERNS less HUB_IGNORE_PATTERNS; huggingface_hub
    filters a repository's files with them like this."""
    from huggingface_hub.utils import filter_repo_objects

    repo_files = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
        "chat_template.jinja", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5",
        "flax_model.msgpack", "flax_model.msgpack.index.json", "model.onnx", "onnx/model.onnx",
        "onnx/config.json",
        "original/consolidated.00.pth", "original/params.json", "consolidated.safetensors",
        "model.Q4_K_M.gguf", ".gitattributes", "README.md",
    ]  # fmt: skip
    kept = set(
        filter_repo_objects(
            repo_files,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            ignore_patterns=list(HUB_IGNORE_PATTERNS),
        )
    )
    assert kept == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
        "chat_template.jinja", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    }  # fmt: skip


def test_revision_is_an_engine_option_on_the_command_line() -> None:
    from llm_operator import options as option_table
    from llm_operator.cli.main import build_parser

    argv = ["run", "in.csv", "--prompt-col", "p", "--output", "o", "--revision", "v2"]
    assert option_table.from_arguments(build_parser().parse_args(argv))["revision"] == "v2"
    with pytest.raises(TypeError, match="revision"):
        LLMOperator(REPO, revision=2)


# -- an unusable LLM_OPERATOR_CACHE ---------------------------------------------------
@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    """A .gguf path; the cache is checked before anything reads it as GGUF."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_a_cache_that_is_a_file_names_llm_operator_cache(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    monkeypatch.setenv(registry.CACHE_ENV_VAR, str(not_a_folder))
    with pytest.raises(NotADirectoryError) as caught:
        resolve_model(str(gguf_file))
    message = str(caught.value)
    assert "LLM_OPERATOR_CACHE" in message and str(not_a_folder) in message
    assert "not a directory" in message and "writable folder" in message


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder no file can be created in, even by root (whom permissions do not stop)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o555)
        return folder
    folder = Path("/sys/llm-operator-test-cache")  # sysfs: mkdir fails even for root
    try:
        folder.mkdir()
    except OSError:
        return folder
    folder.rmdir()
    pytest.skip("no read-only folder to test with")


def test_a_read_only_cache_names_llm_operator_cache(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _read_only_folder(tmp_path)
    monkeypatch.setenv(registry.CACHE_ENV_VAR, str(folder))
    with pytest.raises(PermissionError) as caught:
        resolve_model(str(gguf_file))
    message = str(caught.value)
    assert "LLM_OPERATOR_CACHE" in message and str(folder) in message
    assert "not writable" in message and "writable folder" in message
