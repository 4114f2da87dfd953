"""Reading and writing Parquet, CSV and JSONL tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
FORMATS.update(dict.fromkeys((".jsonl", ".json", ".ndjson"), "jsonl"))


def table_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r}: use one of {', '.join(sorted(FORMATS))}"
        )
    return fmt


def read_table(path: str | Path, encoding: str | None = None) -> pa.Table:
    """The table in ``path``. ``encoding``: the text encoding of a CSV or JSONL file
    (default UTF-8; ``latin-1``, ``cp1252``, ...); Parquet text is always UTF-8."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    fmt = table_format(path)
    if encoding is not None:
        import codecs

        if fmt == "parquet":
            raise ValueError("--encoding is for CSV and JSONL files; Parquet text is UTF-8")
        try:
            encoding = codecs.lookup(encoding).name
        except LookupError:
            raise ValueError(
                f"unknown encoding {encoding!r} (try utf-8, latin-1, cp1252, utf-16)"
            ) from None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if fmt == "csv":
        import pyarrow.csv as pacsv

        return pacsv.read_csv(path, read_options=pacsv.ReadOptions(encoding=encoding or "utf8"))
    import pyarrow.json as pajson

    if encoding is None or encoding == "utf-8":
        return pajson.read_json(path)
    import io

    try:  # pyarrow reads UTF-8 JSON only: transcode
        text = path.read_bytes().decode(encoding)
    except UnicodeDecodeError as error:
        raise ValueError(f"{str(path)!r} is not {encoding} text: {error}") from None
    return pajson.read_json(io.BytesIO(text.encode("utf-8")))


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def check_utf8(table: pa.Table, columns: Sequence[str], path: Path) -> None:
    """ValueError naming the column, row, byte offset and byte of the first value of
    ``columns`` that is not UTF-8 text (a CSV column pyarrow read as binary)."""
    for name in columns:
        if name not in table.column_names or not _is_binary(table.schema.field(name).type):
            continue
        for row, value in enumerate(table.column(name).to_pylist()):
            try:
                if value is not None:
                    value.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{str(path)!r} is not UTF-8: column {name!r}, row {row}, holds byte "
                    f"0x{value[error.start]:02X} at byte {error.start} of its value; give the "
                    "file's encoding with --encoding (for example --encoding latin-1 or "
                    "--encoding cp1252)"
                ) from None


def write_table(table: pa.Table, path: str | Path) -> None:
    path = Path(path)
    fmt = table_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in table.to_pylist():
                f.write(_json_line(row))


def prompts_from_table(table: pa.Table, *, prompt_col: str) -> list:
    """One prompt per row: the column's values (non-strings become error rows in generate).
    Prompts built from several columns: ``llm_operator.prompts.table``."""
    columns = table.column_names
    if prompt_col not in columns:
        raise ValueError(
            f"prompt column {prompt_col!r} is not in the table; columns: {', '.join(columns)}"
        )
    kind = table.schema.field(prompt_col).type
    text = (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_null(kind)
        or _is_binary(kind)  # text that is not UTF-8: each row's error names it
    )
    chat = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(
        kind.value_type
    )  # JSONL chat messages: [{"role": ..., "content": ...}]
    if not (text or chat):
        raise ValueError(
            f"prompt column {prompt_col!r} holds {kind} values, not text or chat messages: "
            f"build prompts from it with --template '... {{{prompt_col}}} ...' or --columns "
            f"{prompt_col}"
        )
    values = table.column(prompt_col).to_pylist()
    if _is_binary(kind):
        # one value that is not UTF-8 makes the whole CSV column binary: the rest is text
        values = [_text_or_bytes(v) if isinstance(v, bytes) else v for v in values]
    return values


def _text_or_bytes(value: bytes) -> str | bytes:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value  # the row's error says where (prompts.encode)


def add_result_columns(
    table: pa.Table,
    results: Sequence,
    output: str,
    *,
    logprobs: bool = False,
    choice_logprobs: bool = False,
) -> pa.Table:
    """Append ``{output}``, ``{output}_finish_reason``, ``_prompt_tokens``, ``_completion_tokens``,
    ``_error``; with ``logprobs``, ``_logprob`` (double); with ``choice_logprobs``,
    ``_choice_logprobs`` (JSON text: {"choice": log-probability, ...}; null where none)."""
    columns = {
        output: pa.array([r.text for r in results], pa.string()),
        f"{output}_finish_reason": pa.array([r.finish_reason for r in results], pa.string()),
        f"{output}_prompt_tokens": pa.array([r.prompt_tokens for r in results], pa.int32()),
        f"{output}_completion_tokens": pa.array([r.completion_tokens for r in results], pa.int32()),
        f"{output}_error": pa.array([r.error for r in results], pa.string()),
    }
    if logprobs:
        columns[f"{output}_logprob"] = pa.array([r.logprob for r in results], pa.float64())
    if choice_logprobs:
        texts = [
            None if r.choice_logprobs is None else json.dumps(r.choice_logprobs, ensure_ascii=False)
            for r in results
        ]
        columns[f"{output}_choice_logprobs"] = pa.array(texts, pa.string())
    for name, column in columns.items():
        if name in table.column_names:
            raise ValueError(
                f"output column {name!r} already exists in the table; choose another --output-col"
            )
        table = table.append_column(name, column)
    return table


def add_embedding_columns(table: pa.Table, results: Sequence, output: str) -> pa.Table:
    """Append ``{output}`` (the vectors: ``fixed_size_list<float>[d]`` when every vector has
    ``d`` values, else ``list<float>``; null on error rows), ``{output}_prompt_tokens``
    (int32) and ``{output}_error``."""
    widths = {len(r.embedding) for r in results if r.embedding is not None}
    vector = pa.list_(pa.float32(), widths.pop()) if len(widths) == 1 else pa.list_(pa.float32())
    columns = {
        output: pa.array([r.embedding for r in results], vector),
        f"{output}_prompt_tokens": pa.array([r.prompt_tokens for r in results], pa.int32()),
        f"{output}_error": pa.array([r.error for r in results], pa.string()),
    }
    for name, column in columns.items():
        if name in table.column_names:
            raise ValueError(
                f"output column {name!r} already exists in the table; choose another --output-col"
            )
        table = table.append_column(name, column)
    return table


# characters str.splitlines() and some JSON Lines readers take for line breaks
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _json_line(row: dict) -> str:
    """One JSON Lines record: UTF-8 text, but the unicode line separators escaped, so that
    any line reader sees one record per line."""
    text = json.dumps(row, ensure_ascii=False, default=str)
    for char, escaped in _LINE_BREAKS.items():
        text = text.replace(char, escaped)
    return text + "\n"
