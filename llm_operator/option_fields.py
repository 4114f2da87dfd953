"""How an option is declared: a dataclass field that carries its doc, check and CLI spelling.

``EngineConfig`` (``config.py``), ``SamplingParams`` (``sampling.py``) and ``PromptOptions``
(``prompts/options.py``) are plain frozen dataclasses; each option is one field of theirs,
written in the class body with its type and default and made by ``option``, which keeps the
option's metadata (``OptionSpec``) in the field's ``metadata``. ``check_fields`` (their
``__post_init__``) checks and normalizes every field. ``llm_operator.options`` derives the
option table from these fields: the CLI, the Spark/Dask keyword signatures and the docs.

This module imports nothing of the library at import time (no torch, no import cycle).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

BACKENDS = ("auto", "hf", "native", "vllm", "openai")
SAME: Any = object()  # an option whose command-line default is its default
METADATA_KEY = "option"

T = TypeVar("T")
Check = Callable[[str, Any], Any]


@dataclass(frozen=True)
class OptionSpec:
    """What a field needs to be an option (kept in ``field.metadata["option"]``).

    doc: one line for help texts and docstrings. check: ``check(name, value)`` returns the
    value to keep (normalized) or raises naming the option. cli: "value" (one typed value),
    "flag" (--x/--no-x), "append" (repeatable), "items" (repeatable KEY=VALUE into a
    mapping), or None (not on the command line); cli_type parses a "value" (default: int
    for an int field, else str); choices: the values the command line accepts (those of a
    ``one_of`` check); cli_default: a default the command line uses instead of the field's."""

    doc: str
    check: Check
    cli: str | None = "value"
    cli_type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    cli_default: Any = SAME


def option(
    default: T,
    *,
    doc: str,
    check: Check,
    cli: str | None = "value",
    cli_type: Callable[[str], Any] | None = None,
    cli_default: Any = SAME,
    repr: bool = True,  # noqa: A002 - dataclasses.field's name
) -> T:
    """A dataclass field for one option: ``name: type = option(default, doc=..., check=...)``.

    Typed as its default (a field of that default, for type checkers and editors)."""
    spec = OptionSpec(doc, check, cli, cli_type, getattr(check, "choices", None), cli_default)
    field: Any = dataclasses.field(default=default, repr=repr, metadata={METADATA_KEY: spec})
    return field


def option_spec(field: dataclasses.Field) -> OptionSpec | None:
    """The option metadata of a dataclass field (None: the field is not an option)."""
    return field.metadata.get(METADATA_KEY)


@functools.cache
def _checks(cls: type) -> tuple[tuple[str, Check], ...]:
    """(name, check) of the class's options, in field order."""
    return tuple(
        (field.name, spec.check)
        for field in dataclasses.fields(cls)
        if (spec := option_spec(field)) is not None
    )


def check_fields(instance: Any) -> None:
    """Check every option field of a frozen dataclass instance, keeping the normalized
    values (e.g. ``stop`` as a tuple); in field order, so the first bad one is named."""
    for name, check in _checks(type(instance)):
        object.__setattr__(instance, name, check(name, getattr(instance, name)))


def describe_line(name: str, default: Any, doc: str) -> str:
    """One option's line in a docstring."""
    return f"    {name} (default {default!r}): {doc}"


def documented(cls: type[T]) -> type[T]:
    """Class decorator (above ``@dataclass``): append the options' docs to the docstring,
    and make an unknown keyword's TypeError name the closest options."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    known = frozenset(names)  # checked on every construction (one per row's params)
    lines = [
        describe_line(field.name, field.default, spec.doc)
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
        if (spec := option_spec(field)) is not None
    ]
    cls.__doc__ = f"{cls.__doc__ or ''}\n\nOptions:\n" + "\n".join(lines) + "\n"
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise TypeError(f"{cls.__name__}: {unknown_options_message(unknown, names)}")
        generated(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def unknown_options_message(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unknown option 'max_token' (did you mean 'max_tokens'?); known: ...``."""
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        parts.append(f"{name!r}{hint}")
    noun = "option" if len(parts) == 1 else "options"
    return f"unknown {noun} {', '.join(parts)}; known: {', '.join(known)}"


# -- checks: each returns the value to keep (normalized) or raises naming the option ------
def integer(minimum: int | None) -> Check:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        return int(value)

    return check


def optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return value


def non_negative(name: str, value: Any) -> float:
    """A finite number >= 0 (temperature)."""
    if not math.isfinite(number(name, value)) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def positive_number(name: str, value: Any) -> float:
    """A finite number > 0 (a timeout in seconds)."""
    if not math.isfinite(number(name, value)) or value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def probability_mass(name: str, value: Any) -> float:
    """A number in (0, 1] (top_p)."""
    if not (0.0 < number(name, value) <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def chat_mode(name: str, value: Any) -> bool | str:
    """True, False or "auto" (the chat option)."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f'{name} must be True, False or "auto", got {value!r}')


def text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def one_of(*choices: str) -> Check:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        return value

    check.choices = choices  # type: ignore[attr-defined]  # the command line's (``option``)
    return check


def stop_strings(name: str, value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else tuple(value or ())
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must hold non-empty strings, got {s!r}")
    return strings


_SIZE_UNITS = {"": 1, "b": 1} | {  # kb = 10**3, kib = 2**10, ... tib = 2**40
    prefix + unit: base**power
    for power, prefix in enumerate("kmgt", start=1)
    for unit, base in (("b", 10**3), ("ib", 2**10))
}


def parse_memory_size(value: int | str, *, name: str = "kv_cache_memory") -> int | None:
    """Bytes from an int or a string such as "2GiB" or "512 MB"; None for "auto"."""
    message = f"{name} must be a number of bytes, a size such as '2GiB', or 'auto'; got {value!r}"
    if isinstance(value, bool):
        raise TypeError(message)
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        size = value.strip().lower()
        if size == "auto":
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", size)
        if match:
            count = float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
            if count >= 1:
                return int(count)
    raise ValueError(message)


def memory_size(name: str, value: Any) -> int | str:
    parse_memory_size(value, name=name)
    return value


def folder_path(name: str, value: Any) -> str:
    import os

    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"{name} must be a folder path, got {value!r}")
    return os.fspath(value)


def keyword_items(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
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


def distinct_strings(noun: str) -> Check:
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


def regex_pattern(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    from llm_operator.engine.constraints import check_regex

    check_regex(value)
    return value


def json_schema_text(name: str, value: Any) -> str | None:
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
    schema = json.dumps(value)  # the user's property order: the model fills them in it
    from llm_operator.engine.constraints import check_json_schema

    check_json_schema(schema)
    return schema


# -- command-line parsing of values that are not plain ints, floats or strings ---------
def split_commas(value: str) -> list[str]:
    """``a,b,c`` -> ["a", "b", "c"] (spaces around names dropped)."""
    return [part.strip() for part in value.split(",")]


def json_text_or_file(path: str) -> str:
    """The command line's JSON value: inline JSON (text starting with ``{``), else a file."""
    from pathlib import Path

    if path.lstrip().startswith("{"):
        return path
    try:
        return Path(path).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"{path!r} is neither inline JSON (starting with '{{') nor a readable file: "
            f"{error.strerror or error}"
        ) from None


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def cli_text(text: str) -> str:
    r"""Command-line text with ``\n``, ``\t``, ``\r`` and ``\\`` decoded, as a shell
    passes them literally (``--template "Title: {title}\nIs it a comedy?"``); any other
    backslash stays as typed (regexes keep theirs: ``--regex`` is not decoded)."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def parse_keyword_item(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true, null), else text."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
