"""What a Spark or Dask job's options are: validated once on the driver (``make_options``),
carried to every partition in one small hashable ``InferOptions``, and read per row
(constraints from a column, typed values). No torch, no engine here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from llm_operator import options as option_table
from llm_operator.config import EngineConfig
from llm_operator.integrations.json_values import ValueType, value_type
from llm_operator.prompts.encode import as_chat
from llm_operator.prompts.options import PromptOptions
from llm_operator.prompts.table import TablePrompt, table_options
from llm_operator.sampling import SamplingParams

# (name, Python type) of each result field, in output order; every field is there for
# every row (logprob: None unless logprobs=True; choice_logprobs: None unless choices and
# logprobs), so the output's type does not depend on the options. With json_schema, a
# VALUE_FIELD follows, typed from the schema (json_values.py).
RESULT_FIELDS: tuple[tuple[str, type], ...] = (
    ("text", str),
    ("finish_reason", str),
    ("prompt_tokens", int),
    ("completion_tokens", int),
    ("error", str),
    ("logprob", float),
    ("choice_logprobs", dict),  # choice -> log-probability (float or None)
)
VALUE_FIELD = "value"
# (name, Python type) of each field of an embedding result, in output order (llm_embed)
EMBED_FIELDS: tuple[tuple[str, type], ...] = (
    ("embedding", list),  # None where the row could not run
    ("prompt_tokens", int),
    ("error", str),
)


@dataclass(frozen=True)
class InferOptions:
    """Everything a partition needs to run; hashable, small, cheap to pickle."""

    model: str
    engine: EngineConfig
    sampling: SamplingParams
    chat: bool | str = "auto"
    system: str | None = None
    table: TablePrompt | None = None  # template= or columns= (and instruction=)
    reorder_fields: bool = False
    dedupe: bool = False
    co_locate: bool = True  # the frame's rows meet by prompt prefix before the job
    # ("choices" | "regex" | "json_schema", column name): each row's constraint comes from
    # that column (choices_col= ...); the values travel with the rows, not in the options
    constraint_col: tuple[str, str] | None = None

    def engine_key(self, device: str | None = None) -> tuple:
        return engine_key(self.model, self.engine, device)

    def prompts(self, values: Sequence[Any], chat_template: bool) -> list[Any]:
        """Column values to prompts (``chat``/``system``: each string as a user message;
        ``chat="auto"``: when the model has a chat template, ``chat_template``)."""
        return as_chat(values, chat=self.chat, system=self.system, chat_template=chat_template)


@dataclass(frozen=True)
class EmbedOptions:
    """What an embedding job's partitions need (``llm_embed``): the model, its engine and
    the pooling; hashable, small, cheap to pickle. The worker's engine is the one
    ``llm_infer`` would use with the same model and engine options."""

    model: str
    engine: EngineConfig
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    co_locate: bool = True  # the frame's rows meet by prompt prefix before the job

    def engine_key(self, device: str | None = None) -> tuple:
        return engine_key(self.model, self.engine, device)


def engine_key(model: str, engine: EngineConfig, device: str | None = None) -> tuple:
    """Which worker engine runs a job: the model, its engine options (not the statistics
    log) and the device."""
    return (model, replace(engine, stats_log=None), device)


def check_server(options: InferOptions) -> None:
    """With ``backend="openai"``: reach the model server from the driver, before any job,
    so an unreachable server, a refused key or a model it does not serve fails here
    (``engine.openai.client.Endpoint.probe``) rather than in every task."""
    engine = options.engine
    if engine.backend != "openai":
        return
    from llm_operator.engine.openai.client import endpoint_for

    endpoint = endpoint_for(engine, timeout=min(engine.request_timeout, 30.0), max_retries=0)
    try:
        endpoint.probe(engine.server_model)
    finally:
        endpoint.close()


def make_options(
    *,
    model: Any,
    engine_options: Mapping[str, Any] | None = None,
    choices_col: str | None = None,
    regex_col: str | None = None,
    json_schema_col: str | None = None,
    **options: Any,
) -> InferOptions:
    """Validated options (on the driver, before any model loads).

    options: any engine, sampling or prompt option of ``llm_operator.options``.
    engine_options: engine options as one mapping (the older spelling; merged).
    choices_col, regex_col, json_schema_col: a column holding each row's constraint
        (``row_sampling``); at most one of them and of ``choices``, ``regex`` and
        ``json_schema`` (ValueError).
    """
    _check_model(model)
    options = _with_engine_options(engine_options, options)
    scoped = option_table.split(options)
    prompt = PromptOptions(**scoped["prompt"])
    table = table_options({field.name: getattr(prompt, field.name) for field in fields(prompt)})
    sampling = SamplingParams(**scoped["sampling"])
    given_cols = {"choices": choices_col, "regex": regex_col, "json_schema": json_schema_col}
    checked = InferOptions(
        model=os.fspath(model),
        engine=EngineConfig(**scoped["engine"]),
        sampling=sampling,
        chat=True if prompt.system is not None else prompt.chat,
        system=prompt.system,
        table=table,
        reorder_fields=prompt.reorder_fields,
        dedupe=prompt.dedupe,
        co_locate=prompt.co_locate,
        constraint_col=constraint_column(sampling, given_cols),
    )
    # A Hub id ("org/name", not a path here) must be in the Hub cache or on the Hub before
    # any job starts; aliases and paths are checked where the model loads (no torch here)
    from llm_operator.models.registry import check_model_available

    check_model_available(model, checked.engine.revision)
    return checked


def make_embed_options(
    *,
    model: Any,
    pooling: str = "last",
    normalize: bool = True,
    dimensions: int | None = None,
    co_locate: bool = True,
    engine_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> EmbedOptions:
    """Validated embedding options (on the driver, before any model loads): the pooling
    options (``llm_operator.embedding.check_embedding_options``) and the engine options of
    ``llm_operator.options`` (TypeError naming any other option)."""
    from llm_operator.embedding import check_embedding_options

    _check_model(model)
    options = _with_engine_options(engine_options, options)
    scoped = option_table.split(options, ["engine"])
    pooling, normalize, dimensions = check_embedding_options(pooling, normalize, dimensions)
    if not isinstance(co_locate, bool):
        raise TypeError(f"co_locate must be True or False, got {co_locate!r}")
    checked = EmbedOptions(
        model=os.fspath(model),
        engine=EngineConfig(**scoped["engine"]),
        pooling=pooling,
        normalize=normalize,
        dimensions=dimensions,
        co_locate=co_locate,
    )
    from llm_operator.models.registry import check_model_available

    check_model_available(model, checked.engine.revision)
    if dimensions is not None:
        width = model_width(checked)
        if width is not None and dimensions > width:
            raise ValueError(f"dimensions={dimensions} is more than the model's {width} values")
    return checked


def model_width(options: EmbedOptions) -> int | None:
    """The model's hidden size where its ``config.json`` is at hand without loading
    anything (a model directory, or a Hub id in the local Hub cache); else None."""
    path = Path(options.model).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if config is None and "/" in options.model and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(
                options.model, "config.json", revision=options.engine.revision
            )
        except (ImportError, ValueError):
            found = None
        config = Path(found) if isinstance(found, str) else None
    if config is None or not config.is_file():
        return None
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = values.get("text_config") or {}
    size = text.get("hidden_size") if isinstance(text, dict) else None
    size = size if size is not None else values.get("hidden_size")
    return size if isinstance(size, int) and size > 0 else None


def embedding_width(options: EmbedOptions) -> int | None:
    """The length of every vector, where known before the job: ``dimensions``, else the
    model's hidden size (``model_width``)."""
    return options.dimensions if options.dimensions is not None else model_width(options)


def _check_model(model: Any) -> None:
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise TypeError(f"model must be an alias or a path, got {model!r}")


def _with_engine_options(
    engine_options: Mapping[str, Any] | None, options: dict[str, Any]
) -> dict[str, Any]:
    """``options`` with ``engine_options`` (engine options as one mapping) merged in."""
    if not engine_options:
        return options
    if not isinstance(engine_options, Mapping):
        raise TypeError(f"engine_options must be a mapping, got {engine_options!r}")
    try:
        option_table.split(engine_options, ["engine"])
    except TypeError as error:
        raise ValueError(f"engine_options: {error}") from None
    both = sorted(set(engine_options) & set(options))
    if both:
        raise ValueError(f"{both} given both as keywords and in engine_options; give one")
    return {**engine_options, **options}


def constraint_column(
    sampling: SamplingParams, columns: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(constraint, column) of the one ``{constraint}_col`` given (``columns``: constraint
    -> column name or None), or None. TypeError for a column that is not a name; ValueError
    for two constraints at once, per call or per row."""
    given = [(kind, column) for kind, column in columns.items() if column is not None]
    for kind, column in given:
        if not isinstance(column, str) or not column:
            raise TypeError(f"{kind}_col must be a column name (a string), got {column!r}")
    named = [f"{kind}_col" for kind, _ in given]
    if sampling.constraint is not None:
        named.insert(0, sampling.constraint[0])
    if len(named) > 1:
        raise ValueError(
            "give at most one of choices, regex, json_schema, choices_col, regex_col and "
            f"json_schema_col; got {' and '.join(named)}"
        )
    return given[0] if given else None


def row_sampling(options: InferOptions, values: Sequence[Any]) -> list[SamplingParams | str]:
    """Each row's SamplingParams: the call's, with the row's constraint from
    ``options.constraint_col`` (a missing value: the call's as they are). A value that is
    no valid constraint gives that row a message naming the column and the problem instead.
    Rows with equal values share one SamplingParams (checked once).

    choices: a list, tuple or array of distinct strings, or text: a JSON list
    (``["yes", "no"]``) or comma-separated labels (``yes,no``); regex: a string;
    json_schema: JSON text or a dict."""
    assert options.constraint_col is not None, "no constraint column in these options"
    kind, column = options.constraint_col
    base = options.sampling
    made: dict[Any, SamplingParams | str] = {}
    rows: list[SamplingParams | str] = []
    for value in values:
        if is_missing(value):
            rows.append(base)
            continue
        try:
            given = _constraint_value(kind, value)
            key = given if kind != "json_schema" or isinstance(given, str) else json.dumps(given)
            hash(key)
        except (TypeError, ValueError) as error:
            rows.append(f"{kind}_col {column!r}: {error}")
            continue
        if key not in made:
            try:
                made[key] = replace(base, **{kind: given})
            except (TypeError, ValueError) as error:  # SamplingParams' own checks
                made[key] = f"{kind}_col {column!r}: {error}"
        rows.append(made[key])
    return rows


def _constraint_value(kind: str, value: Any) -> Any:
    """One cell of a constraint column as the SamplingParams field takes it."""
    if kind == "choices":
        if isinstance(value, str):
            return parse_choices_text(value)
        if isinstance(value, Mapping) or not hasattr(value, "__iter__"):
            raise TypeError(f"choices must be a list of strings, got {value!r:.80}")
        return tuple(value)
    if kind == "regex":
        if not isinstance(value, str):
            raise TypeError(f"regex must be a string, got {value!r:.80}")
        return value
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8")
    if not isinstance(value, (str, Mapping)):
        raise TypeError(f"json_schema must be JSON text or a dict, got {value!r:.80}")
    return value


def parse_choices_text(text: str) -> tuple[str, ...]:
    """Labels written in one text cell: a JSON list (``["yes", "no"]``), else
    comma-separated labels (``yes, no``; spaces around each dropped)."""
    if text.lstrip().startswith("["):
        try:
            labels = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"choices text starting with '[' is not a JSON list: {error}"
            ) from None
        if not isinstance(labels, list):
            raise ValueError(f"choices text is not a JSON list: {text!r:.80}")
        return tuple(labels)
    return tuple(part.strip() for part in text.split(","))


def check_prompt_source(col: Any, options: InferOptions) -> None:
    """Exactly one prompt source: a prompt column ``col``, or ``template``/``columns``."""
    if options.table is None and col is None:
        raise ValueError("give col (the prompt column) or template= or columns=")
    if options.table is not None and col is not None:
        raise ValueError("give col or a template/columns, not both")


def typed_value(json_schema: Any, value: Any, *, untyped: bool = False) -> ValueType | None:
    """The type of the rows' parsed JSON (on the driver): None without a ``json_schema``
    or with ``value=False``; ValueError naming a schema part that has no single type,
    unless ``untyped`` (json_values.value_type). ``json_schema``: as the user gave it
    (make_options checks it first), so fields keep the user's property order."""
    if not isinstance(value, bool):
        raise TypeError(f"value must be a bool, got {value!r}")
    if not value or json_schema is None:
        return None
    return value_type(json_schema, untyped=untyped)


def is_missing(value: Any) -> bool:
    """None, NaN and pandas' NA are missing prompts."""
    if value is None:
        return True
    if isinstance(value, float) and value != value:
        return True
    return type(value).__name__ in ("NAType", "NaTType")
