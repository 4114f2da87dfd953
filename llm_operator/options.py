"""Every option of the library, declared once.

Each ``Option`` is one keyword: its scope, default, one line of doc, how it is checked and
how the command line spells it. Built from this table:

- ``EngineConfig`` (the ``engine`` options) and ``SamplingParams`` (``sampling``): frozen
  dataclasses whose fields, defaults, checks and docs come from here (``options_dataclass``);
- ``LLMOperator(model, **engine options)``;
- Spark and Dask ``llm_infer(..., model, **options)``: every engine, sampling and prompt
  option (``prompt``: how a column value becomes a prompt) as a keyword;
- the CLI's option groups (``add_arguments`` / ``from_arguments``).

So a new option is one entry here, and no two entry points can disagree on a default.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "hf", "native", "vllm")
SCOPES = ("engine", "sampling", "prompt")
SAME = object()  # an Option whose command-line default is its default


# -- checks: each returns the value to keep (normalized) or raises naming the option ------
def _integer(minimum: int | None) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        return int(value)

    return check


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return value


def _temperature(name: str, value: Any) -> float:
    if not math.isfinite(_number(name, value)) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def _top_p(name: str, value: Any) -> float:
    if not (0.0 < _number(name, value) <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        return value

    return check


def _stop_strings(name: str, value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else tuple(value or ())
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must hold non-empty strings, got {s!r}")
    return strings


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_size(value: int | str, *, name: str = "kv_cache_memory") -> int | None:
    """Bytes from an int or a string such as "2GiB" or "512 MB"; None for "auto"."""
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be a number of bytes, a size such as '2GiB', or 'auto'; got {value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", text)
        if match:
            number = float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
            if number >= 1:
                return int(number)
    raise ValueError(
        f"{name} must be a number of bytes, a size such as '2GiB', or 'auto'; got {value!r}"
    )


def _memory_size(name: str, value: Any) -> int | str:
    parse_memory_size(value, name=name)
    return value


def _path(name: str, value: Any) -> str:
    import os

    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"{name} must be a folder path, got {value!r}")
    return os.fspath(value)


def _keyword_items(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """A mapping of keyword arguments as sorted (name, value) pairs: hashable."""
    if value is None:
        return ()
    try:
        items = dict(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a mapping of keyword arguments, got {value!r}") from None
    for key in items:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{name} names must be keyword names, got {key!r}")
    try:
        hash(tuple(items.values()))
    except TypeError:
        raise TypeError(f"{name} values must be hashable, got {items!r}") from None
    return tuple(sorted(items.items()))


def _distinct_strings(noun: str) -> Callable[[str, Any], tuple[str, ...] | None]:
    """None, or a non-empty list of distinct non-empty strings (kept as a tuple)."""

    def check(name: str, value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise TypeError(f"{name} must be a list of {noun}s, got {value!r:.80}")
        items = tuple(value)
        if not items:
            raise ValueError(f"{name} must hold at least one {noun}, got an empty list")
        for item in items:
            if not isinstance(item, str) or not item:
                raise TypeError(f"{name} must hold {noun}s (non-empty strings), got {item!r}")
        repeated = sorted({item for item in items if items.count(item) > 1})
        if repeated:
            raise ValueError(f"{name} has duplicates: {repeated}")
        return items

    return check


def _regex(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    from llm_operator.constraints import check_regex

    check_regex(value)
    return value


def _json_schema(name: str, value: Any) -> str | None:
    """A dict or a JSON string, kept as JSON text (hashable; properties in the given order)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict or a JSON object string, got {value!r:.80}")
    text = json.dumps(value)  # the user's property order: the model fills them in it
    from llm_operator.constraints import check_json_schema

    check_json_schema(text)
    return text


# -- command-line parsing of values that are not plain ints, floats or strings ---------
def _split_commas(text: str) -> list[str]:
    """``a,b,c`` -> ["a", "b", "c"] (spaces around names dropped)."""
    return [part.strip() for part in text.split(",")]


def _read_json_file(path: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error}") from None


def _parse_keyword_item(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true, null), else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


@dataclass(frozen=True)
class Option:
    """One option. ``cli``: "value" (one typed value), "flag" (--x/--no-x), "append"
    (repeatable), "items" (repeatable KEY=VALUE into a mapping), or None (not on the CLI)."""

    name: str
    scope: str
    default: Any
    doc: str
    check: Callable[[str, Any], Any]
    annotation: str
    cli: str | None = "value"
    cli_type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    cli_default: Any = SAME  # where the command line wants another default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def validate(self, value: Any) -> Any:
        return self.check(self.name, value)


OPTIONS: tuple[Option, ...] = (
    # -- engine: one LLMOperator (EngineConfig) ------------------------------------------
    Option("backend", "engine", "auto",
           '"native" (our paged-KV engine; Llama, Qwen2/3, Mistral), "hf" (transformers), '
           '"vllm" (needs vllm), or "auto" (native where it runs, else hf)',
           _one_of(*BACKENDS), "str", choices=BACKENDS),
    Option("device", "engine", "auto", '"cpu", "cuda", "cuda:N" or "auto"', _text, "str"),
    Option("dtype", "engine", "auto", '"float32", "bfloat16", "float16" or "auto" '
           "(float32 on CPU, the model's on GPU)", _text, "str"),
    Option("kv_cache_memory", "engine", "auto",
           'bytes or a size such as "2GiB" the KV cache may hold; "auto": a quarter of RAM '
           "on CPU (at most 8 GiB), 80%% of free GPU memory",
           _memory_size, "int | str"),
    Option("max_batch_size", "engine", 256, "most rows decoding at once", _integer(1), "int"),
    Option("prefill_batch_tokens", "engine", 4096,
           "most tokens in one iteration (native: decodes included; hf: padded prefill tokens)",
           _integer(1), "int"),
    Option("kv_block_size", "engine", 16, "tokens per KV block of the native paged cache",
           _integer(1), "int"),
    Option("min_shared_tokens", "engine", 4, "shortest prefix worth sharing between rows",
           _integer(1), "int"),
    Option("share_prefixes", "engine", True, "share common prefixes (off: an ablation)",
           _boolean, "bool", cli="flag"),
    Option("decode_first", "engine", True,
           "run groups with the most decode work first (off: an ablation)",
           _boolean, "bool", cli="flag"),
    Option("token_batching", "engine", True,
           "native: requests join the running batch as KV blocks free (BATON); off, they "
           "run in waves of max_batch_size (an ablation)", _boolean, "bool", cli="flag"),
    Option("trust_remote_code", "engine", False, "allow code shipped with the model to run",
           _boolean, "bool", cli="flag"),
    Option("progress", "engine", False, "show a progress bar (rows, output tokens/s)",
           _boolean, "bool", cli="flag", cli_default=True),
    Option("cache_dir", "engine", None,
           "folder of converted models (default $LLM_OPERATOR_CACHE or ~/.cache/llm-operator)",
           _optional(_path), "str | None"),
    Option("vllm_options", "engine", (),
           "keyword arguments for vllm.LLM (backend vllm), over the backend's defaults",
           _keyword_items, "Mapping[str, Any]", cli="items", cli_type=_parse_keyword_item),
    # -- sampling: one row's SamplingParams -----------------------------------------------
    Option("max_tokens", "sampling", 64, "most tokens to generate", _integer(1), "int"),
    Option("temperature", "sampling", 0.0, "0 is greedy; otherwise logits are divided by it",
           _temperature, "float", cli_type=float),
    Option("top_p", "sampling", 1.0, "nucleus sampling mass in (0, 1]; 1 keeps every token",
           _top_p, "float", cli_type=float),
    Option("top_k", "sampling", 0, "keep the k most likely tokens; 0 keeps every token",
           _integer(0), "int"),
    Option("stop", "sampling", (), "strings that end generation (the text stops before them)",
           _stop_strings, "tuple[str, ...]", cli="append"),
    Option("seed", "sampling", None,
           "makes sampling reproducible per row, in any batch, partition or retry",
           _optional(_integer(None)), "int | None"),
    Option("ignore_eos", "sampling", False, "keep generating past the end-of-sequence token",
           _boolean, "bool", cli="flag"),
    Option("choices", "sampling", None,
           "the output is exactly one of these strings (a token trie; decided rows stop at once)",
           _distinct_strings("string"), "tuple[str, ...] | None", cli_type=_split_commas),
    Option("regex", "sampling", None, "the output matches this regular expression",
           _regex, "str | None"),
    Option("json_schema", "sampling", None,
           "the output is JSON valid under this schema (a dict or JSON text; CLI: a file)",
           _json_schema, "str | None", cli_type=_read_json_file),
    Option("logprobs", "sampling", False,
           "return the log-probability of the output under the unconstrained model (and, with "
           "choices, of every choice)", _boolean, "bool", cli="flag"),
    # -- prompt: how a column value becomes a prompt (integrations and CLI) ---------------
    Option("chat", "prompt", False, "send each prompt as a user chat message",
           _boolean, "bool", cli="flag"),
    Option("system", "prompt", None, "a system message before each prompt (implies chat)",
           _optional(_text), "str | None"),
    # -- prompts built from a table's columns (llm_operator.prompts.table) -----------------
    Option("template", "prompt", None,
           'build each prompt from the row\'s columns, e.g. "Title: {title}\\nGenres: {genres}'
           '\\nIs it a comedy?" (nulls render empty)', _optional(_text), "str | None"),
    Option("columns", "prompt", None,
           "build each prompt as the instruction, then one `name: value` line per column",
           _distinct_strings("column name"), "tuple[str, ...] | None", cli_type=_split_commas),
    Option("instruction", "prompt", None, "the text before the columns' lines (with columns)",
           _optional(_text), "str | None"),
    Option("reorder_fields", "prompt", False,
           "reorder the movable field lines (one field per line, in a run of such lines) to "
           "share the most prefix over the whole table, and co-locate rows by the prompt",
           _boolean, "bool", cli="flag"),
    Option("dedupe", "prompt", False,
           "compute identical prompts once over the whole table (co-locates rows by the "
           "prompt; identical prompts then get identical outputs, sampled or not)",
           _boolean, "bool", cli="flag"),
)  # fmt: skip

BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


def scope(name: str) -> tuple[Option, ...]:
    return tuple(option for option in OPTIONS if option.scope == name)


def defaults(scope_name: str) -> dict[str, Any]:
    return {option.name: option.default for option in scope(scope_name)}


def split(options: Mapping[str, Any], scopes: Iterable[str] = SCOPES) -> dict[str, dict]:
    """Keyword options by scope; TypeError naming any option not in ``scopes``."""
    scopes = tuple(scopes)
    unknown = sorted(n for n in options if n not in BY_NAME or BY_NAME[n].scope not in scopes)
    if unknown:
        known = ", ".join(o.name for o in OPTIONS if o.scope in scopes)
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}; known: {known}")
    by_scope: dict[str, dict] = {name: {} for name in scopes}
    for name, value in options.items():
        by_scope[BY_NAME[name].scope][name] = value
    return by_scope


def describe(scopes: Iterable[str] = SCOPES) -> str:
    """One line per option: name (default) and its doc, for docstrings."""
    return "\n".join(
        f"    {o.name} (default {o.default!r}): {o.doc.replace('%%', '%')}"
        for o in OPTIONS
        if o.scope in tuple(scopes)
    )


def options_dataclass(scope_name: str):
    """Class decorator: a frozen dataclass whose fields are the scope's options, checked
    (and normalized, e.g. ``stop`` to a tuple) on construction; the class keeps its own
    methods and gets the options' docs appended to its docstring."""

    def build(cls):
        cls.__annotations__ = {o.name: o.annotation for o in scope(scope_name)}
        for option in scope(scope_name):
            setattr(cls, option.name, option.default)

        def __post_init__(self) -> None:
            for option in scope(scope_name):
                object.__setattr__(self, option.name, option.validate(getattr(self, option.name)))
            extra = getattr(self, "_check", None)
            if extra is not None:
                extra()

        cls.__post_init__ = __post_init__
        cls.__doc__ = f"{cls.__doc__ or ''}\n\nOptions:\n{describe([scope_name])}\n"
        return dataclass(frozen=True)(cls)

    return build


def keyword_signature(function: Callable, scopes: Iterable[str]) -> Callable:
    """Give ``function(..., **options)`` a signature listing the scopes' options (help())."""
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    parameters += [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
        for o in OPTIONS
        if o.scope in tuple(scopes) and o.name not in signature.parameters
    ]
    function.__signature__ = signature.replace(parameters=parameters)
    return function


# -- the command line ---------------------------------------------------------------------
GROUP_TITLES = {
    "engine": "engine options",
    "sampling": "sampling options",
    "prompt": "prompt options",
}


def add_arguments(parser: argparse.ArgumentParser, scopes: Iterable[str] = SCOPES) -> None:
    """One argument group per scope, one flag per option. Options left out on the command
    line stay out of the namespace (argparse.SUPPRESS), so the table's defaults apply."""
    for scope_name in scopes:
        group = parser.add_argument_group(GROUP_TITLES[scope_name])
        for option in scope(scope_name):
            default = option.default if option.cli_default is SAME else (option.cli_default)
            help_text = f"{option.doc} (default: {_shown(default)})"
            common = {"dest": option.name, "default": argparse.SUPPRESS, "help": help_text}
            if option.cli == "flag":
                group.add_argument(option.flag, action=argparse.BooleanOptionalAction, **common)
            elif option.cli == "append":
                group.add_argument(option.flag, action="append", metavar="TEXT",
                                   **{**common, "help": help_text + "; repeatable"})  # fmt: skip
            elif option.cli == "items":
                flag = option.flag.removesuffix("s")  # --vllm-option KEY=VALUE
                group.add_argument(flag, action="append", type=option.cli_type,
                                   metavar="KEY=VALUE",
                                   **{**common, "help": help_text + "; repeatable"})  # fmt: skip
            elif option.cli == "value":
                kind = option.cli_type or {"int": int, "int | None": int}.get(
                    option.annotation, str
                )
                group.add_argument(option.flag, type=kind, choices=option.choices, **common)


def from_arguments(args: argparse.Namespace, scopes: Iterable[str] = SCOPES) -> dict[str, Any]:
    """The options given on the command line, plus each CLI-specific default."""
    chosen: dict[str, Any] = {}
    for option in OPTIONS:
        if option.scope not in tuple(scopes):
            continue
        if hasattr(args, option.name):
            value = getattr(args, option.name)
            chosen[option.name] = dict(value) if option.cli == "items" else value
        elif option.cli_default is not SAME:
            chosen[option.name] = option.cli_default
    return chosen


def _shown(value: Any) -> str:
    if value == ():
        return "none"
    return str(value).replace("%", "%%")


assert all(o.scope in SCOPES for o in OPTIONS), "every option has a known scope"
assert all(re.fullmatch(r"[a-z][a-z0-9_]*", o.name) for o in OPTIONS), "option names are keywords"
