"""Prompts built from a table's columns, and which of their lines may move (the docs'
guide "Prompts from columns" has the user's view).

    TablePrompt.build(template="Title: {title}\\nGenres: {genres}\\nIs it a comedy?")
    TablePrompt.build(columns=["title", "genres"], instruction="Is it a comedy?")

A prompt is a list of lines, each literal text and ``{field}`` references. A run of
consecutive lines that each hold exactly one field is a *block*, whose lines
``reordered`` may permute, label and all; every other line stays. ``columns=`` renders as
the instruction, a blank line, then one block of ``name: value`` lines.

Values render as text (``render_arrow``; Spark and Dask render alike): strings as they
are, numbers and booleans by Arrow's cast ("3", "4.5", "true"), a null as ``NULL_TEXT``
after its label (``brand: ``), so every row has the same lines.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NULL_TEXT = ""
"""How a null field value renders: empty, after its label (``brand: ``)."""


@dataclass(frozen=True)
class Field:
    """A ``{name}`` reference to a column."""

    name: str


Piece = str | Field
Line = tuple[Piece, ...]


@dataclass(frozen=True)
class TablePrompt:
    """How a row becomes a prompt; frozen and hashable (options travel with it).

    lines: the prompt's lines (joined by "\\n"), each literal text and field references.
    blocks: runs of line indices whose lines hold one field each; a block's lines may be
        permuted (``reordered``), the rest is fixed.
    """

    lines: tuple[Line, ...]
    blocks: tuple[tuple[int, ...], ...]

    # -- building ------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        *,
        template: str | None = None,
        columns: Sequence[str] | None = None,
        instruction: str | None = None,
    ) -> TablePrompt:
        """From ``template`` or from ``columns`` (and an optional ``instruction``);
        ValueError/TypeError naming the parameter on anything else."""
        if template is not None and columns is not None:
            raise ValueError("give template or columns, not both")
        if template is not None:
            if instruction is not None:
                raise ValueError("instruction goes with columns; write it into the template")
            return cls.from_template(template)
        if columns is not None:
            return cls.from_columns(columns, instruction)
        if instruction is not None:
            raise ValueError("instruction needs columns: the fields rendered after it")
        raise ValueError("give template or columns")

    @classmethod
    def from_template(cls, template: str) -> TablePrompt:
        if not isinstance(template, str):
            raise TypeError(f"template must be a string, got {type(template).__name__}")
        lines = tuple(_parse_line(line) for line in template.split("\n"))
        if not any(isinstance(p, Field) for line in lines for p in line):
            raise ValueError(
                f"template names no column: write fields as {{column}}, got {template!r:.80}"
            )
        return cls(lines, _blocks(lines))

    @classmethod
    def from_columns(cls, columns: Sequence[str], instruction: str | None = None) -> TablePrompt:
        from llm_operator.options import BY_NAME

        columns = BY_NAME["columns"].validate(columns)
        if columns is None:
            raise ValueError("columns must name at least one column, got None")
        if instruction is not None and not isinstance(instruction, str):
            raise TypeError(f"instruction must be a string, got {type(instruction).__name__}")
        head: tuple[Line, ...] = ()
        if instruction:
            head = (*((line,) for line in instruction.split("\n")), ())  # then a blank line
        body = tuple((f"{name}: ", Field(name)) for name in columns)
        start = len(head)
        return cls((*head, *body), (tuple(range(start, start + len(body))),))

    # -- what it holds -------------------------------------------------------------
    @property
    def fields(self) -> tuple[str, ...]:
        """The columns it reads, each once, in rendered order."""
        names = (p.name for line in self.lines for p in line if isinstance(p, Field))
        return tuple(dict.fromkeys(names))

    @property
    def movable(self) -> tuple[str, ...]:
        """The fields that reordering may move (those of blocks of two or more lines)."""
        return tuple(self._line_field(i) for block in self.blocks for i in block)

    def _line_field(self, index: int) -> str:
        (field,) = (p for p in self.lines[index] if isinstance(p, Field))
        return field.name

    def pieces(self) -> list[Piece]:
        """Literal text and fields in rendered order, adjacent literals merged (what a
        vectorized concat needs)."""
        out: list[Piece] = []
        for index, line in enumerate(self.lines):
            for piece in ("\n",) * (index > 0) + line:
                if isinstance(piece, str) and out and isinstance(out[-1], str):
                    out[-1] += piece
                elif piece != "":
                    out.append(piece)
        return out

    def text(self) -> str:
        """The prompt as a template (fields as ``{name}``), for reports."""
        return self.render({name: "{" + name + "}" for name in self.fields})

    # -- rendering -----------------------------------------------------------------
    def render(self, values: Mapping[str, str | None]) -> str:
        """One prompt from a row's values, already text (None renders as ``NULL_TEXT``)."""
        texts = {name: NULL_TEXT if values[name] is None else values[name] for name in self.fields}
        return "".join(p if isinstance(p, str) else texts[p.name] for p in self.pieces())

    # -- reordering ----------------------------------------------------------------
    def reordered(self, order: Sequence[str]) -> TablePrompt:
        """The same prompt with each block's lines sorted by their field's position in
        ``order`` (fields it leaves out keep their relative place after those it names)."""
        rank = {name: i for i, name in enumerate(order)}
        lines = list(self.lines)
        for block in self.blocks:
            ranked = sorted(block, key=lambda i: (rank.get(self._line_field(i), len(rank)), i))
            for target, source in zip(block, ranked):
                lines[target] = self.lines[source]
        return TablePrompt(tuple(lines), self.blocks)


def _parse_line(line: str) -> Line:
    pieces: list[Piece] = []
    try:
        parsed = list(string.Formatter().parse(line))
    except ValueError as error:  # a lone "{" or "}"
        raise ValueError(
            f"template line {line!r:.80} does not parse ({error}); write a literal brace as {{{{ or }}}}"
        ) from None
    for literal, name, spec, conversion in parsed:
        if literal:
            pieces.append(literal)
        if name is None:
            continue
        if name == "" or not name.isidentifier():
            raise ValueError(
                f"template fields must be column names such as {{review}}, got {{{name}}}; "
                "write a literal brace as {{ or }}"
            )
        if spec or conversion:
            raise ValueError(
                f"template field {{{name}}} takes no format or conversion: values render as text"
            )
        pieces.append(Field(name))
    return tuple(pieces)


def _blocks(lines: Sequence[Line]) -> tuple[tuple[int, ...], ...]:
    """Runs of two or more consecutive lines holding exactly one field each (and not
    the same field twice in a run)."""
    blocks: list[tuple[int, ...]] = []
    run: dict[str, int] = {}  # the run's fields -> their line indices
    for index, line in enumerate([*lines, ()]):  # a last empty line closes the last run
        fields = [p.name for p in line if isinstance(p, Field)]
        if len(fields) != 1 or fields[0] in run:  # a repeated field starts a new run
            if len(run) >= 2:
                blocks.append(tuple(run.values()))
            run = {}
        if len(fields) == 1:
            run[fields[0]] = index
    return tuple(blocks)


def check_columns(prompt: TablePrompt, available: Sequence[str], what: str = "the frame") -> None:
    """ValueError naming the fields ``available`` lacks (before any model loads)."""
    missing = [name for name in prompt.fields if name not in available]
    if missing:
        raise ValueError(
            f"the prompt names column(s) {missing} that {what} lacks; columns: "
            f"{', '.join(map(str, available))}"
        )


TABLE_PROMPT_OPTIONS = ("template", "columns", "instruction")
"""The options that describe a TablePrompt (``table_options``)."""


def table_options(options: dict[str, Any]) -> TablePrompt | None:
    """Pop ``template``, ``columns`` and ``instruction`` from ``options``: the TablePrompt
    they describe, or None when none is given. With ``reorder_fields`` true in
    ``options``, ValueError unless the prompt has lines that may move."""
    given = {name: options.pop(name, None) for name in TABLE_PROMPT_OPTIONS}
    prompt = None
    if any(value is not None for value in given.values()):
        prompt = TablePrompt.build(**given)
    if options.get("reorder_fields"):
        if prompt is None:
            raise ValueError("reorder_fields needs a template or columns: the fields to reorder")
        if not prompt.movable:
            raise ValueError(
                "reorder_fields: the template has no movable lines; put each field to reorder "
                f"on its own line, in a run of such lines (template: {prompt.text()!r:.120})"
            )
    return prompt


# -- rendering Arrow columns (the CLI and Dask) ---------------------------------------
# the Arrow types whose values render as text (pyarrow.types.is_<name>), also dictionary-encoded
_TEXT_TYPES = ("string", "large_string", "string_view", "integer", "floating", "decimal")
_TEXT_TYPES += ("boolean", "date", "time", "timestamp", "null")


def field_texts(table: Any, prompt: TablePrompt) -> dict[str, Any]:
    """Each field of a pyarrow Table as rendered text, nulls as ``NULL_TEXT`` (ValueError
    naming missing columns, TypeError naming ones that do not render)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    check_columns(prompt, table.column_names, "the table")
    texts = {}
    for name in prompt.fields:
        column = table.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
        # a check this pyarrow lacks (is_string_view before 16) matches nothing
        if not any(getattr(pa.types, f"is_{t}", lambda _: False)(kind) for t in _TEXT_TYPES):
            raise TypeError(
                f"column {name!r} holds {column.type} values, which do not render as prompt "
                "text; cast it to a string first or leave it out"
            )
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        texts[name] = pc.fill_null(pc.cast(column, pa.string()), NULL_TEXT)
    return texts


def render_arrow(table: Any, prompt: TablePrompt) -> list[str]:
    """One prompt per row of a pyarrow Table (TypeError/ValueError naming a bad column)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    texts = field_texts(table, prompt)
    rows = table.num_rows
    parts = [
        pa.array([piece] * rows, pa.string()) if isinstance(piece, str) else texts[piece.name]
        for piece in prompt.pieces()
    ]
    if len(parts) == 1:
        return parts[0].to_pylist()
    return pc.binary_join_element_wise(*parts, "").to_pylist()


def pandas_table(frame: Any, prompt: TablePrompt) -> Any:
    """The prompt's fields of a pandas DataFrame as a pyarrow Table (TypeError naming a
    column whose values do not convert, e.g. lists or mixed types in an object column)."""
    import pyarrow as pa

    check_columns(prompt, list(frame.columns), "the frame")
    arrays = {}
    for name in prompt.fields:
        try:
            arrays[name] = pa.array(frame[name], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
            raise TypeError(
                f"column {name!r} holds values that do not render as prompt text ({error}); "
                "cast it to a string first or leave it out"
            ) from None
    return pa.table(arrays)


def render_pandas(frame: Any, prompt: TablePrompt) -> list[str]:
    """One prompt per row of a pandas DataFrame, rendered as ``render_arrow`` does."""
    return render_arrow(pandas_table(frame, prompt), prompt)
