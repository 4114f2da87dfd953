"""mkdocs hook: the generated reference pages, and a failed build where they would lie.

A page that says ``<!-- generated: options -->`` gets the option table and one that says
``<!-- generated: environment -->`` the environment variables (``llm_operator.reference``).
The build stops when an option has no doc or the code reads a variable the reference
does not list.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
MARKERS = {
    "<!-- generated: options -->": "options_markdown",
    "<!-- generated: environment -->": "environment_markdown",
}


def on_pre_build(config, **kwargs) -> None:
    from llm_operator import reference

    missing = reference.missing_docs()
    if missing:
        raise PluginError(f"options without a doc: {', '.join(missing)}")
    undocumented = reference.undocumented_variables(ROOT)
    if undocumented:
        listed = "; ".join(f"{name} ({', '.join(files)})" for name, files in undocumented.items())
        raise PluginError(
            f"environment variables read but not in llm_operator/environment.py: {listed}"
        )


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    from llm_operator import reference

    for marker, function in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, getattr(reference, function)())
    return markdown
