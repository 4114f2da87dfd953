"""The docs' generated reference pages: every option and every environment variable.

``options_markdown()`` renders the option table (``llm_operator.options.OPTIONS``) and
``environment_markdown()`` the variables of ``llm_operator.environment``. The docs site's
build hook (``docs/hooks/reference.py``) puts them where a page says
``<!-- generated: options -->`` or ``<!-- generated: environment -->``, and fails the
build for an option without a doc or a variable the code reads that is not listed
(``undocumented_variables``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCOPE_TITLES = {
    "engine": "Engine options",
    "sampling": "Sampling options",
    "prompt": "Prompt options",
}
SCOPE_INTROS = {
    "engine": "How the model runs: `LLMOperator(model, **options)`, `EngineConfig`, and "
    "every keyword of Spark's and Dask's `llm_infer`.",
    "sampling": "How each row is generated: `SamplingParams(**options)`, and keywords of "
    "`llm_infer`.",
    "prompt": "How a column value becomes a prompt: keywords of `llm_infer` and of the CLI.",
}
READERS = {
    "library": "Read by the library",
    "bench": "Read by the benchmarks",
    "examples": "Read by the examples",
    "tests": "Read by the test suite",
}
SOURCE_FOLDERS = ("llm_operator", "integrations", "kernels", "llm_operator_bench")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shown(value: Any) -> str:
    if value is None:
        return "`None`"
    if value == ():
        return "none"
    return f"`{value!r}`"


def command_line(option: Any) -> str:
    """How the CLI spells ``option`` (``llm_operator.options.Option``)."""
    if option.cli is None:
        return "not on the command line"
    if option.cli == "flag":
        return f"`{option.flag}` / `--no-{option.flag[2:]}`"
    if option.cli == "append":
        return f"`{option.flag} TEXT` (repeatable)"
    if option.cli == "items":
        return f"`{option.flag.removesuffix('s')} KEY=VALUE` (repeatable)"
    if option.choices:
        return f"`{option.flag} {{{','.join(option.choices)}}}`"
    return f"`{option.flag} VALUE`"


def missing_docs() -> list[str]:
    """Options whose doc is empty (the site's build fails on any)."""
    from llm_operator.options import OPTIONS

    return [option.name for option in OPTIONS if not option.doc.strip()]


def options_markdown() -> str:
    """Every option, by scope: name, type, default, command-line spelling and doc."""
    from llm_operator.options import OPTIONS, SCOPES

    parts = []
    for scope_name in SCOPES:
        parts += [
            f"## {SCOPE_TITLES[scope_name]}",
            "",
            SCOPE_INTROS[scope_name],
            "",
            "| option | type | default | command line | what it does |",
            "|---|---|---|---|---|",
        ]
        for option in OPTIONS:
            if option.scope != scope_name:
                continue
            cli_default = ""
            if option.cli is not None and option.cli_default is not _same():
                cli_default = f" (command line: {_shown(option.cli_default)})"
            parts.append(
                f"| `{option.name}` | `{_cell(option.annotation)}` "
                f"| {_cell(_shown(option.default))}{_cell(cli_default)} "
                f"| {_cell(command_line(option))} | {_cell(option.doc)} |"
            )
        parts.append("")
    return "\n".join(parts)


def _same() -> Any:
    from llm_operator.option_fields import SAME

    return SAME


def environment_markdown() -> str:
    """Every environment variable, by who reads it."""
    from llm_operator.environment import VARIABLES

    parts = []
    for reader, title in READERS.items():
        rows = [variable for variable in VARIABLES if variable.read_by == reader]
        if not rows:
            continue
        parts += [f"## {title}", "", "| variable | default | what it does |", "|---|---|---|"]
        parts += [f"| `{v.name}` | {_cell(v.default)} | {_cell(v.doc)} |" for v in rows]
        parts.append("")
    return "\n".join(parts)


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments."""
    found = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _names_environ(node: ast.AST) -> bool:
    """Whether an expression is (or picks between) environment mappings."""
    return any(
        (isinstance(n, ast.Attribute) and n.attr == "environ")
        or (isinstance(n, ast.Name) and n.id == "environ")
        for n in ast.walk(node)
    )


def variables_read(path: Path, imported: dict[str, str] | None = None) -> set[str]:
    """Environment variables a Python file reads: ``os.environ[K]``, ``os.environ.get(K)``,
    ``.setdefault(K, ...)``, ``os.getenv(K)`` (or the same on a mapping named ``environ``),
    with ``K`` a literal or a module-level string constant (of this file, else of
    ``imported``: constants other modules define, by name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    constants = {**(imported or {}), **_constants(tree)}

    def key_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    found: set[str] = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _names_environ(node.value):
            key = key_of(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            if isinstance(function, ast.Attribute) and function.attr == "getenv":
                key = key_of(node.args[0])
            elif (
                isinstance(function, ast.Attribute)
                and function.attr in ("get", "setdefault", "pop")
                and _names_environ(function.value)
            ):
                key = key_of(node.args[0])
        if key is not None:
            found.add(key)
    return found


def source_files(root: Path, folders: Iterable[str] = SOURCE_FOLDERS) -> list[Path]:
    return sorted(path for folder in folders for path in (root / folder).rglob("*.py"))


def undocumented_variables(root: Path) -> dict[str, list[str]]:
    """Variables read under ``root``'s source folders that ``llm_operator.environment``
    does not list, each with the files that read it."""
    from llm_operator.environment import BY_NAME

    files = source_files(root)
    constants: dict[str, str] = {}
    for path in files:
        constants.update(_constants(ast.parse(path.read_text(encoding="utf-8"))))
    missing: dict[str, list[str]] = {}
    for path in files:
        for name in variables_read(path, constants):
            if name not in BY_NAME:
                missing.setdefault(name, []).append(str(path.relative_to(root)))
    return missing
