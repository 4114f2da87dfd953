"""Prompt options: how a column value becomes a prompt, and how a frame's rows meet (Spark,
Dask and the CLI).

Frozen and validated on construction, like ``EngineConfig`` and ``SamplingParams``; each
field is one option of the ``prompt`` scope of ``llm_operator.options``. Imports nothing
heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_operator.option_fields import (
    boolean,
    chat_mode,
    check_fields,
    cli_text,
    distinct_strings,
    documented,
    option,
    optional,
    split_commas,
    text,
)


@documented
@dataclass(frozen=True)
class PromptOptions:
    """How each row's value (or columns) becomes a prompt."""

    chat: bool | str = option(
        "auto",
        doc="send each prompt as a user chat message, through the model's chat template; "
        '"auto": when the model has a chat template (instruct models), else as raw text',
        check=chat_mode,
        cli="flag",
    )
    system: str | None = option(
        None,
        doc="a system message before each prompt (implies chat)",
        check=optional(text),
        cli_type=cli_text,
    )
    # -- prompts built from a table's columns (llm_operator.prompts.table) -------------
    template: str | None = option(
        None,
        doc="build each prompt from the row's columns, e.g. \"Title: {title}\\nGenres: {genres}"
        '\\nIs it a comedy?" (nulls render empty; the CLI decodes \\n and \\t)',
        check=optional(text),
        cli_type=cli_text,
    )
    columns: tuple[str, ...] | None = option(
        None,
        doc="build each prompt as the instruction, then one `name: value` line per column",
        check=distinct_strings("column name"),
        cli_type=split_commas,
    )
    instruction: str | None = option(
        None,
        doc="the text before the columns' lines (with columns)",
        check=optional(text),
        cli_type=cli_text,
    )
    reorder_fields: bool = option(
        False,
        doc="reorder the movable field lines (one field per line, in a run of such lines) to "
        "share the most prefix over the whole table, and co-locate rows by the prompt",
        check=boolean,
        cli="flag",
    )
    co_locate: bool = option(
        True,
        doc="move rows that share a prompt prefix into one partition before a Spark or Dask "
        "job (llm_infer_df, Dask llm_infer, LLMTransformer, the CLI's spark and dask "
        "engines), unless a sample shows it cannot help (logged); False keeps the "
        "frame's partitions",
        check=boolean,
        cli="flag",
    )
    dedupe: bool = option(
        False,
        doc="compute identical prompts once over the whole table (co-locates rows by the "
        "prompt; identical prompts then get identical outputs, sampled or not)",
        check=boolean,
        cli="flag",
    )

    def __post_init__(self) -> None:
        check_fields(self)
