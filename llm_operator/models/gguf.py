"""GGUF file -> Hugging Face safetensors directory, converted once and cached.

Cache layout (under the cache folder, see `registry.default_cache_dir`; this module is
below the registry: it imports nothing of it):

    converted/<gguf stem>-<fingerprint>/          a finished directory, never half-written
    converted/<gguf stem>-<fingerprint>.lock      held while one process converts
    converted/.<gguf stem>-<fingerprint>.tmp-*/   a conversion in progress (renamed when done)
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

logger = logging.getLogger(__name__)

FINGERPRINT_CHUNK_BYTES = 1 << 20
CONVERTED_SUBDIR = "converted"
CACHE_ENV_VAR = "LLM_OPERATOR_CACHE"  # the cache folder's variable (registry.default_cache_dir)


def gguf_fingerprint(gguf_path: Path) -> str:
    """A 16-hex-digit fingerprint of the file's name, size, first and last MiB: a changed GGUF
    gets a new cache entry, a reinstall of the same bytes (a new mtime) reuses the old one."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"{gguf_path.name}\0{size}\0".encode())
    with open(gguf_path, "rb") as handle:
        digest.update(handle.read(FINGERPRINT_CHUNK_BYTES))
        if size > FINGERPRINT_CHUNK_BYTES:
            handle.seek(max(FINGERPRINT_CHUNK_BYTES, size - FINGERPRINT_CHUNK_BYTES))
            digest.update(handle.read(FINGERPRINT_CHUNK_BYTES))
    return digest.hexdigest()[:16]


def is_complete_model_directory(directory: Path) -> bool:
    """True when `directory` holds a config.json and at least one *.safetensors file."""
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def publish_once(target: Path, done: Callable[[Path], bool], build: Callable[[Path], Path]) -> Path:
    """Make the cache entry `target` (a file or a folder) at most once across threads and
    processes; return it. Unless `done(target)`, a file lock next to it is taken (others
    wait), the check repeated, and `build(temporary_dir)` makes the entry in a fresh folder
    beside it and returns its path, renamed onto `target`. If `build` raises, nothing is
    kept and the error propagates. A killed process's leftovers are removed under the lock.
    """
    if done(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if done(target):
            return target
        temporary_prefix = f".{target.name}.tmp-"
        for stale in target.parent.glob(temporary_prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.warning("removing incomplete cache entry %s", target)
            shutil.rmtree(target)
        temporary_dir = Path(tempfile.mkdtemp(prefix=temporary_prefix, dir=target.parent))
        try:
            os.replace(build(temporary_dir), target)
        finally:
            shutil.rmtree(temporary_dir, ignore_errors=True)  # gone already if it was the entry
    return target


def publish_directory(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Build the model directory `final_dir` at most once (`publish_once`): `build(folder)`
    fills a temporary folder with config.json and safetensors, made readable by all (a
    shared cache needs 755/644; mkdtemp makes it owner-only) and renamed onto `final_dir`."""

    def build_checked(temporary_dir: Path) -> Path:
        build(temporary_dir)
        assert is_complete_model_directory(temporary_dir), (
            f"builder left no config.json and *.safetensors in {temporary_dir}"
        )
        for entry in (temporary_dir, *temporary_dir.rglob("*")):
            entry.chmod(0o755 if entry.is_dir() else 0o644)
        return temporary_dir

    return publish_once(final_dir, is_complete_model_directory, build_checked)


def convert_gguf_cached(
    gguf_path: Path, cache_dir: Path, *, converter: Callable[[Path, Path], None] | None = None
) -> Path:
    """The cached Hugging Face directory converted from `gguf_path`, converting if needed with
    `converter(gguf_path, output_dir)`, by default `convert_gguf_to_directory`."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf_path={str(gguf_path)!r} is not a file")
    convert = converter if converter is not None else convert_gguf_to_directory
    final_dir = cache_dir / CONVERTED_SUBDIR / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"
    if not is_complete_model_directory(final_dir):
        ensure_writable_cache(cache_dir)  # a read-only cache still serves finished entries
        logger.warning("converting %s to %s (done once, then cached)", gguf_path, final_dir)
    return publish_directory(final_dir, lambda output_dir: convert(gguf_path, output_dir))


def ensure_writable_cache(cache_dir: Path) -> None:
    """Create `cache_dir`/converted if needed and check a file can be written there; else
    raise NotADirectoryError, PermissionError (also a read-only file system) or OSError
    naming the folder and LLM_OPERATOR_CACHE, not a bare error from deep in a conversion."""
    folder = Path(cache_dir) / CONVERTED_SUBDIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        from_env = os.environ.get(CACHE_ENV_VAR, "").strip()
        origin = (
            f"it comes from {CACHE_ENV_VAR}={from_env}"
            if from_env and Path(from_env).expanduser() == Path(cache_dir)
            else f"it comes from the cache_dir option, else {CACHE_ENV_VAR}, else "
            f"~/.cache/llm-operator"
        )
        if isinstance(error, (NotADirectoryError, FileExistsError)):
            problem, kind = "is not a directory (it or a parent is a file)", NotADirectoryError
        elif isinstance(error, PermissionError) or error.errno == errno.EROFS:
            problem, kind = "is not writable", PermissionError
        else:
            problem, kind = "cannot be used", OSError
        raise kind(
            f"the model cache folder {str(cache_dir)!r} {problem}: {error.strerror or error} "
            f"({origin}). Converted models are written there once. Set {CACHE_ENV_VAR} (or "
            f"cache_dir=) to a writable folder, e.g. {CACHE_ENV_VAR}=/tmp/llm-operator-cache"
        ) from error


def read_gguf_metadata_field(gguf_path: Path, key: str) -> Any:
    """One metadata value of a GGUF file (str, int, float, list), or None when absent."""
    from gguf import GGUFReader, GGUFValueType

    field = GGUFReader(str(gguf_path)).fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf releases: scalars and strings only
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def convert_gguf_to_directory(gguf_path: Path, output_dir: Path) -> None:
    """Dequantize `gguf_path` into `output_dir`: fp32 safetensors, tokenizer, generation config.
    The chat template and eos token come from the GGUF metadata where transformers' conversion
    dropped them. ValueError if transformers cannot read the file's architecture or no eos."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source_dir, gguf_file=file_name, local_files_only=True
        )
        gguf_model = AutoModelForCausalLM.from_pretrained(
            source_dir, gguf_file=file_name, dtype=torch.float32, local_files_only=True
        )
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(
            f"model={str(gguf_path)!r}: transformers could not convert this GGUF file: {error}"
        ) from error

    if not tokenizer.chat_template:
        template = read_gguf_metadata_field(gguf_path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
        else:
            logger.warning("%s has no chat template; chat prompts will be refused", gguf_path)
    if tokenizer.eos_token is None:
        eos_id = read_gguf_metadata_field(gguf_path, "tokenizer.ggml.eos_token_id")
        if eos_id is None:
            raise ValueError(f"model={str(gguf_path)!r}: the GGUF file names no eos token")
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # The GGUF-loaded model carries a GGUF quantizer and refuses save_pretrained, so its
    # (already dequantized) weights move into a plain model built from the same config.
    config_values = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config_values.pop(key, None)
    config = AutoConfig.for_model(**config_values)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    plain_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain_model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model

    generation_config = GenerationConfig.from_model_config(config)
    generation_config.eos_token_id = tokenizer.eos_token_id
    generation_config.pad_token_id = tokenizer.pad_token_id
    plain_model.generation_config = generation_config
    tokenizer.model_max_length = int(config.max_position_embeddings)

    plain_model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
