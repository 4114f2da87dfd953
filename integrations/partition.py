"""What the Spark and Dask operators share: options, one engine per worker, running a
partition, and the co-location scheme (partition by a shared-prefix key).

Co-location: lexicographic order is the depth-first order of the prefix tree, but a
plain range partitioning on the prompt cuts a group of rows sharing a prefix wherever a
range boundary falls. Instead, a sample of the prompts is sorted and cut where it
branches: runs of sampled prompts that share at least ``min_prefix_chars`` characters
are the groups, each named by its shared prefix. Every row goes to the partition of the
longest group prefix it starts with (a row of no sampled group goes by a hash of its
first ``min_prefix_chars`` characters), and groups are packed into partitions largest
first, so each group stays whole while partition sizes stay balanced.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from llm_operator import options as option_table
from llm_operator.config import EngineConfig
from llm_operator.integrations.json_values import ValueType, parse_value, value_type
from llm_operator.prompts.dedupe import dedupe, distinct_with
from llm_operator.prompts.encode import as_chat
from llm_operator.prompts.options import PromptOptions
from llm_operator.prompts.table import TablePrompt, table_options
from llm_operator.results import GenerationResult
from llm_operator.sampling import SamplingParams

logger = logging.getLogger("llm_operator.integrations")

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
    # ("choices" | "regex" | "json_schema", column name): each row's constraint comes from
    # that column (choices_col= ...); the values travel with the rows, not in the options
    constraint_col: tuple[str, str] | None = None

    def engine_key(self, device: str | None = None) -> tuple:
        return (self.model, replace(self.engine, stats_log=None), device)

    def prompts(self, values: Sequence[Any], chat_template: bool) -> list[Any]:
        """Column values to prompts (``chat``/``system``: each string as a user message;
        ``chat="auto"``: when the model has a chat template, ``chat_template``)."""
        return as_chat(values, chat=self.chat, system=self.system, chat_template=chat_template)


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
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise TypeError(f"model must be an alias or a path, got {model!r}")
    if engine_options:
        if not isinstance(engine_options, Mapping):
            raise TypeError(f"engine_options must be a mapping, got {engine_options!r}")
        try:
            option_table.split(engine_options, ["engine"])
        except TypeError as error:
            raise ValueError(f"engine_options: {error}") from None
        both = sorted(set(engine_options) & set(options))
        if both:
            raise ValueError(f"{both} given both as keywords and in engine_options; give one")
        options = {**engine_options, **options}
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
        constraint_col=constraint_column(sampling, given_cols),
    )
    # A Hub id ("org/name", not a path here) must be in the Hub cache or on the Hub before
    # any job starts; aliases and paths are checked where the model loads (no torch here)
    from llm_operator.models.registry import check_model_available

    check_model_available(model, checked.engine.revision)
    return checked


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
        if _is_missing(value):
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


# -- one engine per worker process ----------------------------------------------------
_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()
_constructions: dict[tuple, int] = {}  # engine key -> operators built for it in this process


def get_operator(options: InferOptions, device: str | None = None):
    """The worker's LLMOperator for these options, built on first use and then reused.

    One per options and device: asked for another device (a reused worker given another
    GPU), the process first releases its engine for the same options on the old device,
    unless that one is running a partition in another thread. ``device`` may carry a
    share of its GPU (``integrations.devices.Device``): the engine's ``gpu_share`` unless
    the options set one."""
    key = options.engine_key(device)
    with _engines_lock:
        operator = _engines.get(key)
        if operator is None:
            from llm_operator import LLMOperator

            _release_other_devices(key)
            engine = {f.name: getattr(options.engine, f.name) for f in fields(options.engine)}
            if device is not None:
                engine["device"] = str(device)
                share = getattr(device, "gpu_share", None)
                if share is not None and engine.get("gpu_share") is None:
                    engine["gpu_share"] = share
            operator = LLMOperator(options.model, **engine)
            _engines[key] = operator
            _constructions[key] = _constructions.get(key, 0) + 1
        return operator


def _release_other_devices(key: tuple) -> None:
    """Drop this process's engines for the same model and options on other devices (not
    one running a partition now), close their backends and free the CUDA cache. Called
    with ``_engines_lock`` held."""
    stale = [other for other in _engines if other[:-1] == key[:-1] and other[-1] != key[-1]]
    released = False
    for other in stale:
        lock = _partition_locks.get(id(_engines[other]))
        if lock is not None and lock.locked():
            continue  # busy in another thread (in-process workers on several GPUs): keep it
        operator = _engines.pop(other)
        _partition_locks.pop(id(operator), None)
        close = getattr(getattr(operator, "_backend", None), "close", None)
        if callable(close):
            close()  # vLLM: shuts its engine down
        logger.info("released the engine on %s for the one on %s", other[-1], key[-1])
        del operator
        released = True
    if released:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_constructions(key: tuple | None = None) -> int:
    """How many operators this process has built, in all or for one `engine_key` (tests, logs)."""
    if key is None:
        return sum(_constructions.values())
    return _constructions.get(key, 0)


# -- running one partition --------------------------------------------------------
def partition_prompts(
    values: Sequence[Any],
    options: InferOptions,
    chat_template: bool,
    constraints: Sequence[Any] | None = None,
) -> tuple[list[Any], SamplingParams | list[SamplingParams], list[int] | None, dict[int, str]]:
    """A partition's column values as ``generate`` takes them: (prompts, sampling, each
    row's index into the prompts with ``dedupe`` (else None), {prompt index: message} of
    the rows whose constraint value is no valid constraint: they run as missing prompts
    and get that message).

    constraints: with ``options.constraint_col``, each row's value of that column
    (``row_sampling``)."""
    values = [None if _is_missing(v) else v for v in values]
    sampling: list[SamplingParams | str] | None = None
    if options.constraint_col is not None:
        if constraints is None or len(constraints) != len(values):
            raise ValueError(
                f"{options.constraint_col[0]}_col: give one constraint value per row "
                f"({len(values)} rows, {None if constraints is None else len(constraints)} values)"
            )
        sampling = row_sampling(options, list(constraints))
    distinct, positions = values, None
    if options.dedupe:
        distinct, positions = dedupe(values)
        if sampling is not None:  # a distinct row is a distinct (prompt, constraint)
            # rows of equal constraint values share one SamplingParams (row_sampling)
            firsts, positions = distinct_with(positions, [id(s) for s in sampling])
            distinct, sampling = [values[i] for i in firsts], [sampling[i] for i in firsts]
    prompts = options.prompts(distinct, chat_template)
    if sampling is None:
        return prompts, options.sampling, positions, {}
    bad = {i: given for i, given in enumerate(sampling) if isinstance(given, str)}
    for i in bad:
        prompts[i] = None
    rows = [options.sampling if isinstance(s, str) else s for s in sampling]
    return prompts, rows, positions, bad


def run_partition(
    values: Sequence[Any],
    options: InferOptions,
    *,
    device: str | None = None,
    label: str = "partition",
    constraints: Sequence[Any] | None = None,
):
    """Generate for one partition's prompts (one plan over all of them); results in order.

    constraints: with ``options.constraint_col``, each row's value of that column
    (``row_sampling``); a row whose value is no valid constraint is an error row."""
    started = time.perf_counter()
    if not len(values):
        return []
    operator = get_operator(options, device)
    lock = _partition_lock(operator)
    with lock:  # one generate at a time per engine (threaded workers share it)
        prompts, sampling, positions, bad = partition_prompts(
            values, options, operator.has_chat_template, constraints
        )
        results = list(operator.generate(prompts, sampling))
        for i, message in bad.items():  # a bad constraint ran as a missing prompt
            results[i] = GenerationResult.failed(message)
        stats = operator.last_stats
    if positions is not None:
        results = [results[i] for i in positions]
    if stats.engine_paths and id(operator) not in _described:  # once per engine
        _described.add(id(operator))
        logger.info("this worker's engine: %s", stats.engine_paths)
    if options.engine.stats_log:
        seconds = time.perf_counter() - started
        _log_stats(options.engine.stats_log, label, len(values), len(prompts), stats, seconds)
    logger.info(
        "%s: %d rows%s (%d errors%s), %d prompt tokens, %d prefilled, %d output tokens, "
        "%.2f s, saving ratio %.1f%%",
        label,
        len(values),
        f", {len(prompts)} distinct prompts" if positions is not None else "",
        stats.error_rows,
        f", {stats.invalid_rows} constrained outputs cut by max_tokens before they were valid"
        if stats.invalid_rows
        else "",
        stats.prompt_tokens,
        stats.prefill_tokens_computed,
        stats.output_tokens,
        time.perf_counter() - started,
        100 * stats.saving_ratio,
    )
    if stats.server_prompt_tokens:
        logger.info(
            "%s: model server: %d prompt tokens, %d from its prefix cache, %d generated",
            label,
            stats.server_prompt_tokens,
            stats.server_cached_tokens,
            stats.server_completion_tokens,
        )
    return results


def show_worker_logs() -> None:
    """On a worker process (a Spark executor's Python worker, a Dask worker): send the
    per-partition INFO lines to its stderr (the executor or worker log), unless the
    process's logging sends them somewhere already; a level set on the logger is kept
    (other handlers, such as Dask's forwarding to the client, then see the lines too)."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    streams = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    if streams or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s")
    )
    logger.addHandler(handler)


def _log_stats(path: str, label: str, rows: int, distinct: int, stats: Any, seconds: float):
    """One JSON line of a partition's statistics appended to ``path`` (``stats_log``)."""
    line = json.dumps(
        {
            "label": label,
            "rows": rows,
            "distinct_prompts": distinct,
            "prompt_tokens": stats.prompt_tokens,
            "prefill_tokens": stats.prefill_tokens_computed,
            "output_tokens": stats.output_tokens,
            "error_rows": stats.error_rows,
            "invalid_rows": stats.invalid_rows,
            "server_prompt_tokens": stats.server_prompt_tokens,
            "server_cached_tokens": stats.server_cached_tokens,
            "server_completion_tokens": stats.server_completion_tokens,
            "seconds": round(seconds, 3),
            "pid": os.getpid(),
        }
    )
    with open(path, "a", encoding="utf-8") as f:  # one short write per line: appends whole
        f.write(line + "\n")


_partition_locks: dict[int, threading.Lock] = {}
_described: set[int] = set()  # engines whose paths a worker's log has shown


def _partition_lock(operator) -> threading.Lock:
    with _engines_lock:
        return _partition_locks.setdefault(id(operator), threading.Lock())


def _is_missing(value: Any) -> bool:
    """None, NaN and pandas' NA are missing prompts."""
    if value is None:
        return True
    if isinstance(value, float) and value != value:
        return True
    return type(value).__name__ in ("NAType", "NaTType")


def result_records(
    results, value_type: ValueType | None = None, parsed: Sequence[bool] | None = None
) -> list[dict[str, Any]]:
    """One dict per result: the RESULT_FIELDS, and with ``value_type`` the row's JSON
    text parsed as that type under VALUE_FIELD (None where it does not parse or fit; then
    ``error`` says why, unless the engine's own message is there already). ``parsed``: per
    row, whether its text is JSON to parse (json_schema_col: the rows given a schema)."""
    records = [{name: getattr(r, name) for name, _ in RESULT_FIELDS} for r in results]
    if value_type is not None:
        for row, record in enumerate(records):
            record[VALUE_FIELD] = None
            if parsed is not None and not parsed[row]:
                continue
            if record["finish_reason"] == "error" or record["error"] is not None:
                continue  # no text, or the engine said why it is not valid
            record[VALUE_FIELD], why = parse_value(record["text"], value_type)
            if why is not None:
                record["error"] = why
    return records


# -- co-location ------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixPartitioner:
    """Maps a prompt to a partition so that rows sharing a sampled group prefix meet.

    routes: prefix -> the partitions its rows may go to. A prompt follows the longest
    prefix it starts with: a group prefix names one partition; the prefix of a group
    too big for one partition names the partitions its pieces went to, and a row is
    spread over them by a hash of its next ``min_prefix_chars`` characters. A prompt of
    no known prefix goes by a hash of its first ``min_prefix_chars`` characters. Either
    way, rows that share that much more than a known prefix meet.
    """

    routes: Mapping[str, tuple[int, ...]]
    num_partitions: int
    min_prefix_chars: int

    def __post_init__(self) -> None:
        lengths = sorted({len(p) for p in self.routes}, reverse=True)
        object.__setattr__(self, "_lengths", tuple(lengths))

    def __call__(self, prompt: Any) -> int:
        if not isinstance(prompt, str):
            return 0
        for length in self._lengths:
            if len(prompt) < length:
                continue
            partitions = self.routes.get(prompt[:length])
            if partitions is not None:
                if len(partitions) == 1:
                    return partitions[0]
                head = prompt[: length + self.min_prefix_chars]
                return partitions[_hash(head) % len(partitions)]
        return _hash(prompt[: self.min_prefix_chars]) % self.num_partitions


def build_partitioner(
    sample: Sequence[Any], num_partitions: int, *, min_prefix_chars: int = 32
) -> PrefixPartitioner:
    """Group a sample of prompts by shared prefix and pack the groups into partitions.

    The sorted sample is one segment. A segment holding more than its share of the
    sample (len(sample) / num_partitions), or whose rows share fewer than
    ``min_prefix_chars`` characters, is cut at its shallowest branch points (the
    adjacent pairs with the shortest common prefix: cutting there loses the least
    sharing) until every piece fits and shares enough. A piece of two or more sampled rows sharing at
    least ``min_prefix_chars`` characters is a group; groups are packed largest first into
    the least loaded partition. When whole groups cannot be packed evenly (3 groups of 40
    rows on 2 partitions give 80 and 40), the pieces are halved (the share halves) until
    no partition gets more than ``BALANCE`` times the mean, keeping the most even packing
    found: a split group computes its prefix once per partition it lands in, far less
    than a partition left waiting.
    """
    if (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or num_partitions < 1
    ):
        raise ValueError(f"num_partitions must be an int >= 1, got {num_partitions!r}")
    ordered = sorted(s for s in sample if isinstance(s, str))
    share = max(1, len(ordered) // num_partitions)
    # whole groups first; smaller pieces only while packing leaves a partition skewed
    best, loads = _pack(ordered, num_partitions, share, min_prefix_chars)
    busiest, limit = max(loads), BALANCE * len(ordered) / num_partitions
    while busiest > limit and share > 1:
        share //= 2
        candidate, loads = _pack(ordered, num_partitions, share, min_prefix_chars)
        if max(loads) < busiest:  # ties keep the bigger pieces
            best, busiest = candidate, max(loads)
    return best


BALANCE = 1.25
"""co_locate splits groups into smaller pieces while its busiest partition would hold more
than this times the mean (each split costs the group's prefix once more per partition)."""


def _pack(
    ordered: list[str], num_partitions: int, share: int, min_prefix_chars: int
) -> tuple[PrefixPartitioner, list[int]]:
    """build_partitioner with pieces of at most ``share`` sampled rows: the partitioner
    and the sampled rows each partition gets (rows of no group are not counted)."""
    # common[i]: common prefix length of ordered[i] and ordered[i + 1]
    common = [_common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:])]
    groups: list[tuple[str, int]] = []  # (shared prefix, sampled rows)
    # split segments: (shared prefix, index range into `groups` of the pieces under it)
    split: list[tuple[str, int]] = []
    pending: list[tuple[int, int, int]] = [(0, len(ordered), -1)] if ordered else []
    parents_of: list[int] = []  # per group: index into `split` of its nearest split parent
    split_parents: list[int] = []
    while pending:
        begin, end, parent = pending.pop()
        inner = common[begin : end - 1]
        shared = min(inner) if inner else len(ordered[begin])
        if inner and (end - begin > share or shared < min_prefix_chars):
            own = parent
            if shared >= min_prefix_chars:
                split.append((ordered[begin][:shared], len(groups)))
                split_parents.append(parent)
                own = len(split) - 1
            cuts = [begin + i + 1 for i, c in enumerate(inner) if c == shared]
            bounds = [begin, *cuts, end]
            pending.extend((b, e, own) for b, e in zip(bounds, bounds[1:]))
        elif end - begin >= 2 and shared >= min_prefix_chars:
            groups.append((ordered[begin][:shared], end - begin))
            parents_of.append(parent)
    loads = [0] * num_partitions
    routes: dict[str, tuple[int, ...]] = {}
    spread: list[set[int]] = [set() for _ in split]
    for index in sorted(range(len(groups)), key=lambda g: (-groups[g][1], groups[g][0])):
        prefix, count = groups[index]
        if prefix not in routes:
            target = min(range(num_partitions), key=lambda p: (loads[p], p))
            loads[target] += count
            routes[prefix] = (target,)
        parent = parents_of[index]
        while parent >= 0:  # every split ancestor may route its unsampled rows here too
            spread[parent].update(routes[prefix])
            parent = split_parents[parent]
    for (prefix, _), partitions in zip(split, spread):
        if partitions and prefix not in routes:
            routes[prefix] = tuple(sorted(partitions))
    partitioner = PrefixPartitioner(routes, num_partitions, min_prefix_chars)
    counts = [0] * num_partitions
    for prompt in ordered:  # where the sample goes, ungrouped rows included
        counts[partitioner(prompt)] += 1
    return partitioner, counts


def _hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
