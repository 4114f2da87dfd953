"""GGUF file -> Hugging Face safetensors directory, converted once and cached.

Cache layout (under the cache folder, see `registry.default_cache_dir`; this module is
below the registry: it imports nothing of it):

    converted/<gguf stem>-<fingerprint>/          a finished directory, never half-written
    converted/<gguf stem>-<fingerprint>.lock      held while one process converts
    converted/.<gguf stem>-<fingerprint>.tmp-*/   a conversion in progress (renamed when done)

The fingerprint hashes the file's name, size and first and last MiB, so a changed
GGUF gets a new entry, while a reinstall of the same file (new mtime, same bytes)
reuses the old one.
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

GgufConverter = Callable[[Path, Path], None]
"""A converter writes a complete Hugging Face model directory: (gguf_path, output_dir) -> None."""


def gguf_fingerprint(gguf_path: Path) -> str:
    """A 16-hex-digit fingerprint of the file's name, size, first and last MiB."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"{gguf_path.name}\0{size}\0".encode())
    with open(gguf_path, "rb") as handle:
        digest.update(handle.read(FINGERPRINT_CHUNK_BYTES))
        if size > FINGERPRINT_CHUNK_BYTES:
            handle.seek(max(FINGERPRINT_CHUNK_BYTES, size - FINGERPRINT_CHUNK_BYTES))
            digest.update(handle.read(FINGERPRINT_CHUNK_BYTES))
    return digest.hexdigest()[:16]


def converted_directory_for(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf_path` lives (or will live) under `cache_dir`."""
    return cache_dir / CONVERTED_SUBDIR / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def is_complete_model_directory(directory: Path) -> bool:
    """True when `directory` holds a config.json and at least one *.safetensors file."""
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def publish_directory(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Build `final_dir` at most once across threads and processes; return it.

    Contract: if `final_dir` is already complete it is returned at once. Otherwise a
    file lock next to it is taken (other callers wait), the check is repeated, and
    `build(temporary_dir)` fills a fresh temporary directory in the same parent,
    which is then renamed atomically onto `final_dir`. If `build` raises, the
    temporary directory is removed, `final_dir` is not created and the error
    propagates; a later call starts over. Leftover temporary directories of a
    killed process are removed under the lock.
    """
    if is_complete_model_directory(final_dir):
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final_dir) + ".lock"):
        if is_complete_model_directory(final_dir):
            return final_dir
        temporary_prefix = f".{final_dir.name}.tmp-"
        for stale in final_dir.parent.glob(temporary_prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final_dir.exists():
            logger.warning("removing incomplete cache entry %s", final_dir)
            shutil.rmtree(final_dir)
        temporary_dir = Path(tempfile.mkdtemp(prefix=temporary_prefix, dir=final_dir.parent))
        try:
            build(temporary_dir)
            assert is_complete_model_directory(temporary_dir), (
                f"builder left no config.json and *.safetensors in {temporary_dir}"
            )
            _make_readable_by_all(temporary_dir)
            os.rename(temporary_dir, final_dir)
        except BaseException:
            shutil.rmtree(temporary_dir, ignore_errors=True)
            raise
    return final_dir


def _make_readable_by_all(directory: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; a shared cache needs 755/644."""
    directory.chmod(0o755)
    for entry in directory.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def convert_gguf_cached(
    gguf_path: Path, cache_dir: Path, *, converter: GgufConverter | None = None
) -> Path:
    """The cached Hugging Face directory converted from `gguf_path`, converting if needed.

    `converter` defaults to `convert_gguf_to_directory` (about 30-60 s for SmolLM2-135M,
    about 65 s for Gemma 3 270M on 2 cores).
    """
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf_path={str(gguf_path)!r} is not a file")
    convert = converter if converter is not None else convert_gguf_to_directory
    final_dir = converted_directory_for(gguf_path, cache_dir)
    if not is_complete_model_directory(final_dir):
        ensure_writable_cache(cache_dir)  # a read-only cache still serves finished entries
        logger.warning("converting %s to %s (done once, then cached)", gguf_path, final_dir)
    return publish_directory(final_dir, lambda output_dir: convert(gguf_path, output_dir))


def ensure_writable_cache(cache_dir: Path) -> None:
    """Create `cache_dir`/converted if needed and check a file can be written there.

    Raises NotADirectoryError (the folder or a parent is a file), PermissionError (not
    writable: permissions or a read-only file system) or OSError, each naming the
    folder and LLM_OPERATOR_CACHE, instead of a bare error from deep in a conversion.
    """
    folder = Path(cache_dir) / CONVERTED_SUBDIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
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

    Raises ValueError when transformers cannot read the file's architecture, and
    when the converted tokenizer has no eos token. The chat template is taken
    from the GGUF metadata if transformers' conversion dropped it.
    """
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
    config_values.pop("quantization_config", None)
    config_values.pop("_model_name_or_path", None)
    config_values.pop("_name_or_path", None)
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
