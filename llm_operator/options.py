"""Every option of the library, as one table derived from the config classes' fields.

An option is declared once, as a field of one of three frozen dataclasses
(``llm_operator.option_fields``):

- ``engine``: ``EngineConfig`` (``llm_operator.config``), one ``LLMOperator``;
- ``sampling``: ``SamplingParams`` (``llm_operator.sampling``), one row's sampling;
- ``prompt``: ``PromptOptions`` (``llm_operator.prompts.options``), how a column value
  becomes a prompt (Spark, Dask and the CLI).

Derived from those fields here (``OPTIONS``, ``BY_NAME``):

- ``LLMOperator(model, **engine options)`` and its docstring;
- Spark and Dask ``llm_infer(..., model, **options)``: every engine, sampling and prompt
  option as a keyword (``keyword_signature``), unknown names refused (``split``);
- the CLI's option groups (``add_arguments`` / ``from_arguments``).

So a new option is one field, and no two entry points can disagree on a default.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from llm_operator.config import EngineConfig
from llm_operator.option_fields import (
    BACKENDS,
    SAME,
    Check,
    describe_line,
    option_spec,
    parse_memory_size,
    unknown_options_message,
)
from llm_operator.prompts.options import PromptOptions
from llm_operator.sampling import SamplingParams

__all__ = [
    "BACKENDS",
    "BY_NAME",
    "CLASSES",
    "OPTIONS",
    "SCOPES",
    "Option",
    "add_arguments",
    "defaults",
    "describe",
    "from_arguments",
    "keyword_signature",
    "parse_memory_size",
    "scope",
    "split",
]

# each scope's options are the fields of one class
CLASSES: dict[str, type] = {
    "engine": EngineConfig,
    "sampling": SamplingParams,
    "prompt": PromptOptions,
}
SCOPES = tuple(CLASSES)


@dataclass(frozen=True)
class Option:
    """One option: its field's name, scope, default and type, and its ``OptionSpec``."""

    name: str
    scope: str
    default: Any
    doc: str
    check: Check
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


OPTIONS: tuple[Option, ...] = tuple(
    Option(
        name=field.name,
        scope=scope_name,
        default=field.default,
        annotation=field.type if isinstance(field.type, str) else repr(field.type),
        **vars(spec),  # doc, check and the command line's spelling
    )
    for scope_name, cls in CLASSES.items()
    for field in fields(cls)
    if (spec := option_spec(field)) is not None
)
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
        known = [o.name for o in OPTIONS if o.scope in scopes]
        raise TypeError(unknown_options_message(unknown, known))
    by_scope: dict[str, dict] = {name: {} for name in scopes}
    for name, value in options.items():
        by_scope[BY_NAME[name].scope][name] = value
    return by_scope


def describe(scopes: Iterable[str] = SCOPES) -> str:
    """One line per option: name (default) and its doc, for docstrings."""
    return "\n".join(
        describe_line(o.name, o.default, o.doc) for o in OPTIONS if o.scope in tuple(scopes)
    )


def keyword_signature(function: Callable, scopes: Iterable[str]) -> Callable:
    """Give ``function(..., **options)`` a signature listing the scopes' options (help())."""
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    parameters += [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
        for o in OPTIONS
        if o.scope in tuple(scopes) and o.name not in signature.parameters
    ]
    function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return function


# -- the command line ---------------------------------------------------------------------
GROUP_TITLES = {name: f"{name} options" for name in SCOPES}


def add_arguments(parser: argparse.ArgumentParser, scopes: Iterable[str] = SCOPES) -> None:
    """One argument group per scope, one flag per option. Options left out on the command
    line stay out of the namespace (argparse.SUPPRESS), so the fields' defaults apply."""
    for scope_name in scopes:
        group = parser.add_argument_group(GROUP_TITLES[scope_name])
        for option in scope(scope_name):
            default = option.default if option.cli_default is SAME else option.cli_default
            help_text = f"{_escaped(option.doc)} (default: {_escaped(_shown(default))})"
            common: dict[str, Any] = {
                "dest": option.name,
                "default": argparse.SUPPRESS,
                "help": help_text,
            }
            if option.cli == "flag":
                group.add_argument(option.flag, action=argparse.BooleanOptionalAction, **common)
            elif option.cli in ("append", "items"):  # items: --vllm-option KEY=VALUE
                items = option.cli == "items"
                group.add_argument(option.flag.removesuffix("s") if items else option.flag,
                                   action="append", type=_parser_of(option),
                                   metavar="KEY=VALUE" if items else "TEXT",
                                   **{**common, "help": help_text + "; repeatable"})  # fmt: skip
            elif option.cli == "value":
                group.add_argument(
                    option.flag, type=_parser_of(option), choices=option.choices, **common
                )


def _parser_of(option: Option) -> Callable[[str], Any]:
    """How the command line reads one value of ``option``: its cli_type, else int for an
    int field, else the text itself."""
    if option.cli_type is not None:
        return option.cli_type
    return int if option.annotation in ("int", "int | None") else str


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
    return "none" if value == () else str(value)


def _escaped(help_text: str) -> str:
    return help_text.replace("%", "%%")  # argparse formats help with %


assert all(re.fullmatch(r"[a-z][a-z0-9_]*", o.name) for o in OPTIONS), "option names are keywords"
assert len(BY_NAME) == len(OPTIONS), "no option is declared in two scopes"
