"""The ``llm-operator`` command: run | embed | plan | bench | demo."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from llm_operator import options as option_table
from llm_operator.cli import engines  # engines.generate is looked up per call (tests patch it)

DEFAULT_MODEL = "smollm2-135m-instruct"
COMMAND_GROUP = "llm_operator.commands"
"""The entry-point group of extra commands: each names a function ``add(commands)`` that adds
its parsers to the subparsers ``commands``, each with ``set_defaults(command_handler=f)``,
``f(args) -> exit status`` (the benchmarks, installed beside, add ``bench``)."""


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="alias, Hugging Face model directory, .gguf file or Hub id (org/name)",
    )


def _add_prompt_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="a Parquet, CSV or JSONL file")
    parser.add_argument(
        "--prompt-col",
        help="the column holding the prompts (or build them with --template or --columns)",
    )
    parser.add_argument("--limit", type=int, help="only the first N rows")
    parser.add_argument(
        "--encoding",
        help="the text encoding of a CSV or JSONL input (default utf-8; e.g. latin-1, cp1252)",
    )


def _add_engine_options(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    parser.add_argument("--engine", default=default, choices=engines.ENGINES, help=help)
    parser.add_argument("--partitions", type=int, default=2, help="partitions for spark and dask")


def _count_type(minimum: int, auto: bool = False):
    """An argparse type: an int >= ``minimum`` (or "auto" when ``auto``); argparse names the
    option when it fails."""
    expected = ('"auto" or ' if auto else "") + f"an integer >= {minimum}"

    def parse(text: str) -> int | str:
        if auto and text.strip().lower() == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the model over a table and write the outputs")
    run.set_defaults(command_handler=command_run)
    _add_prompt_source(run)
    run.add_argument(
        "--output", type=Path, required=True, help="output file (.parquet, .csv or .jsonl)"
    )
    run.add_argument("--output-col", default="out", help="name of the output column (default: out)")
    _add_engine_options(
        run,
        "local",
        "run in this process, on Spark (local mode, or --master) or on Dask (--scheduler)",
    )
    run.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="with --engine dask: the Dask scheduler to run on (tcp://host:8786); default: "
        "DASK_SCHEDULER_ADDRESS when set, else threads in this process",
    )
    run.add_argument(
        "--master",
        metavar="URL",
        help="with --engine spark: where Spark runs: a master URL (local[4], "
        "local-cluster[2,1,1024], spark://host:7077, yarn) or sc://host:port for Spark "
        "Connect; default: local[PARTITIONS] (or the session already running in this process)",
    )
    run.add_argument(
        "--checkpoint",
        type=Path,
        help="a folder where finished rows are written as they complete; the same command "
        "run again after a crash finishes only what is missing",
    )
    run.add_argument(
        "--checkpoint-rows",
        type=int,
        default=1000,
        help="rows per checkpointed chunk (default: 1000)",
    )
    constraint_cols = run.add_argument_group(
        "per-row constraints (one job over several tasks; at most one, and not with "
        "--choices, --regex or --json-schema)"
    )
    for flag, text in (
        (
            "--choices-col",
            "a column holding each row's labels: a list (Parquet, JSONL), or text: a JSON "
            'list (["yes","no"]) or comma-separated (yes,no); an empty or null cell leaves the '
            "row unconstrained; a bad value is that row's error",
        ),
        ("--regex-col", "a column holding each row's regular expression"),
        (
            "--json-schema-col",
            "a column holding each row's JSON schema (JSON text, or an object in JSONL)",
        ),
    ):
        constraint_cols.add_argument(flag, metavar="NAME", help=text)
    add_model_option(run)
    option_table.add_arguments(run)

    _add_embed_command(commands)

    plan_help = (
        "print the prefix-sharing report without loading the model (--estimate loads it to "
        "predict the run's time)"
    )
    plan = commands.add_parser("plan", help=plan_help, description=plan_help)
    plan.set_defaults(command_handler=command_plan)
    _add_prompt_source(plan)
    add_model_option(plan)
    plan.add_argument("--json", action="store_true", help="print the statistics as JSON")
    cost = plan.add_argument_group(
        "cost estimate (what `run` with these options would take, on this machine)"
    )
    cost.add_argument(
        "--estimate",
        action="store_true",
        help="also predict the run's time: loads the model, calibrates this machine once "
        "(cached per model, backend, dtype and device), generates a few sample rows for the "
        'output lengths and replays the plan\'s schedule; with --json, under "cost"',
    )
    cost.add_argument(
        "--executors",
        type=_count_type(1),
        metavar="N",
        help="with --estimate: machines like this one the job is split over (the time of "
        "the slowest, and the machine-hours of all) (default: 1)",
    )
    cost.add_argument(
        "--sample-rows",
        type=_count_type(0, auto=True),
        metavar="N|auto",
        help="with --estimate: rows generated to learn the output lengths; auto: 4, one "
        "per prefix group in turn, then more while they cost under 5%% of the job (at most "
        "2%% of the rows or 64), none when lengths barely move the time; 0: none (every "
        "row then counts its --max-tokens, an upper bound) (default: auto)",
    )
    cost.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --estimate: measure this machine again instead of using the cached calibration",
    )
    option_table.add_arguments(plan)

    _add_installed_commands(commands)  # bench, from the benchmarks when installed

    demo = commands.add_parser("demo", help="classify the bundled reviews and tickets with SmolLM2")
    demo.set_defaults(command_handler=command_demo)
    add_model_option(demo)
    demo.add_argument("--limit", type=int, help="only the first N rows")
    demo.add_argument("--output", type=Path, default=Path("demo-results/demo.jsonl"))
    demo.add_argument(
        "--compare-static", action="store_true", help="also run plain HF generate on fixed batches"
    )
    _add_engine_options(demo, "spark", "where the job runs (default: Spark in local mode)")
    demo.add_argument(
        "--compare-engines",
        action="store_true",
        help="also run the rows through local, spark and dask side by side",
    )
    demo.add_argument(
        "--compare-free",
        action="store_true",
        help="also generate freely (no choices, up to a newline) and compare the labels",
    )
    option_table.add_arguments(demo, ["engine"])
    return parser


def _add_embed_command(commands) -> None:
    text = "embed a text column: one vector per row, written beside the input columns"
    embed = commands.add_parser("embed", help=text, description=text)
    embed.set_defaults(command_handler=command_embed)
    embed.add_argument("--input", type=Path, required=True, help="a Parquet, CSV or JSONL file")
    embed.add_argument(
        "--output",
        type=Path,
        required=True,
        help="output file (.parquet: a fixed_size_list<float> column; .jsonl: a list per row)",
    )
    embed.add_argument("--column", required=True, help="the text column to embed")
    embed.add_argument(
        "--output-col",
        default="embedding",
        help="name of the vector column; {name}_prompt_tokens and {name}_error go beside it "
        "(default: embedding)",
    )
    embed.add_argument("--limit", type=int, help="only the first N rows")
    embed.add_argument(
        "--encoding",
        help="the text encoding of a CSV or JSONL input (default utf-8; e.g. latin-1, cp1252)",
    )
    embed.add_argument(
        "--pooling",
        default="last",
        choices=("last", "mean", "cls"),
        help="last: the last token's hidden state (decoder embedders); mean: the mean over "
        "the tokens; cls: the first token's (BERT-style encoders) (default: last)",
    )
    embed.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="keep the vectors' lengths (default: unit length)",
    )
    embed.add_argument(
        "--dimensions",
        type=_count_type(1),
        metavar="N",
        help="keep the first N values of each vector (Matryoshka), before normalizing",
    )
    embed.add_argument(
        "--co-locate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --engine spark or dask: move rows that share a prefix into one "
        "partition first (default: on)",
    )
    _add_engine_options(
        embed, "local", "run in this process, on Spark (local mode, or --master) or on Dask"
    )
    embed.add_argument(
        "--scheduler", metavar="ADDRESS", help="with --engine dask: the Dask scheduler to run on"
    )
    embed.add_argument(
        "--master", metavar="URL", help="with --engine spark: where Spark runs (as for run)"
    )
    add_model_option(embed)
    option_table.add_arguments(embed, ["engine"])


def _add_installed_commands(commands) -> None:
    """The commands of the entry points of group COMMAND_GROUP, each name once; one that
    fails to load is left out with a warning. Every copy of a distribution's metadata is
    read: ``entry_points()`` keeps only the first one on sys.path, which from a source
    checkout can be a stale ``*.egg-info`` there rather than the installed one."""
    seen = set()
    for distribution in importlib.metadata.distributions():
        for point in distribution.entry_points.select(group=COMMAND_GROUP):
            if point.name in seen:
                continue
            seen.add(point.name)
            try:
                add = point.load()
            except (ImportError, AttributeError) as error:
                logging.getLogger(__name__).warning(
                    "command %r (%s) not loaded: %s", point.name, point.value, error
                )
                continue
            add(commands)


TABLE_OPTIONS = ("template", "columns", "instruction", "reorder_fields", "dedupe")
"""Prompt options the CLI applies itself, to the whole table, before any engine runs."""
GENERATE_ARGS = ("engine", "model", "partitions", "scheduler", "master")
"""The arguments of ``engines.generate`` that ``run`` takes from its command line."""


class Loaded(NamedTuple):
    table: Any  # the input pyarrow Table
    prompts: list  # one per row: rendered (in the chosen order with --reorder-fields)
    fields: Any  # the FieldPlan with --reorder-fields, else None
    options: dict  # the engine, sampling and chat options left for the engines
    given: Any  # the TablePrompt of --template/--columns as given, else None
    dedupe: bool  # --dedupe: the CLI computes identical prompts once


def _load_prompts(args) -> Loaded:
    """The table and one prompt per row (``--prompt-col``, or rendered from
    ``--template``/``--columns``); table options are checked before the table is read."""
    from llm_operator.cli.tables import check_utf8, prompts_from_table, read_table
    from llm_operator.prompts.field_order import ArrowStatistics, plan_fields
    from llm_operator.prompts.table import render_arrow, table_options

    options = option_table.from_arguments(args)
    for name in TABLE_OPTIONS:
        if name in options:
            options[name] = option_table.BY_NAME[name].validate(options[name])
    given = table_options(dict(options))  # also refuses --reorder-fields with nothing to move
    if given is not None and args.prompt_col is not None:
        flag = "--template" if options.get("template") is not None else "--columns"
        raise ValueError(
            f"give --prompt-col or {flag}, not both: --prompt-col takes each row's prompt from "
            f"one column, {flag} builds it from the row's columns"
        )
    if given is None and args.prompt_col is None:
        raise ValueError("give --prompt-col, or build prompts with --template or --columns")
    dedupe = options.get("dedupe", False)
    table = read_table(args.input, args.encoding)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        table = table.slice(0, args.limit)
    rest = {k: v for k, v in options.items() if k not in TABLE_OPTIONS}
    if given is None:
        prompts = prompts_from_table(table, prompt_col=args.prompt_col)
        return Loaded(table, prompts, None, rest, None, dedupe)
    if args.encoding is None:  # a template needs text: say which byte is not
        check_utf8(table, given.fields, args.input)
    fields = None
    if options.get("reorder_fields", False):
        fields = plan_fields(given, ArrowStatistics(table, given))
    prompts = render_arrow(table, given if fields is None else fields.chosen)
    return Loaded(table, prompts, fields, rest, given, dedupe)


def command_run(args) -> int:
    from llm_operator.cli.tables import add_result_columns, table_format, write_table

    table_format(args.output)  # fail on a bad output name before any work
    for flag, engine in (("scheduler", "dask"), ("master", "spark")):
        if getattr(args, flag) is not None and args.engine != engine:
            raise ValueError(f"--{flag} is for --engine {engine} (got --engine {args.engine})")
    if args.engine != "local":  # one line per partition, from the workers
        logging.getLogger("llm_operator.integrations").setLevel(logging.INFO)
    table, prompts, fields, options, _, deduplicate = _load_prompts(args)
    if fields is not None:
        print(fields.report())
    options, constraints = _constraint_values(args, table, options)
    positions = None
    if deduplicate:
        prompts, positions, constraints = _dedupe_rows(prompts, constraints)
        print(f"dedupe: {len(positions)} rows, {len(prompts)} distinct prompts to compute")
    co_location = None
    if args.checkpoint is not None:
        results, seconds, computed = _run_checkpointed(args, prompts, options, constraints)
    else:
        results, seconds, stats, co_location = _generate(args, prompts, options, constraints)
        computed = _computed(stats)
    if positions is not None:
        results = [results[i] for i in positions]
    scores = bool(options.get("logprobs"))
    choices = options.get("choices") is not None or options.get("choices_col") is not None
    table = add_result_columns(
        table, results, args.output_col, logprobs=scores, choice_logprobs=scores and choices
    )
    write_table(table, args.output)
    line = summary(results, seconds, args.engine, computed)
    if co_location is not None:
        line += f"; {co_location}"
    print(f"{line}; wrote {args.output}")
    return 0


def command_embed(args) -> int:
    """One vector per row of --column, written beside the input columns."""
    import pyarrow as pa

    from llm_operator.cli.tables import (
        add_embedding_columns,
        prompts_from_table,
        read_table,
        table_format,
        write_table,
    )

    if table_format(args.output) == "csv":
        raise ValueError(f"{str(args.output)!r}: CSV cannot hold vectors; write .parquet or .jsonl")
    for flag, engine in (("scheduler", "dask"), ("master", "spark")):
        if getattr(args, flag) is not None and args.engine != engine:
            raise ValueError(f"--{flag} is for --engine {engine} (got --engine {args.engine})")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    options = {
        "pooling": args.pooling,
        "normalize": args.normalize,
        "dimensions": args.dimensions,
        "co_locate": args.co_locate,
        **option_table.from_arguments(args, ["engine"]),
    }
    from llm_operator.integrations.infer_options import make_embed_options

    make_embed_options(model=args.model, **options)  # every option checked before the table
    if args.engine != "local":  # one line per partition, from the workers
        logging.getLogger("llm_operator.integrations").setLevel(logging.INFO)
    table = read_table(args.input, args.encoding)
    if args.limit is not None:
        table = table.slice(0, args.limit)
    if args.column not in table.column_names:
        raise ValueError(
            f"--column {args.column!r} is not a column of the input; "
            f"columns: {', '.join(table.column_names)}"
        )
    kind = table.schema.field(args.column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):  # fmt: skip
        raise ValueError(f"--column {args.column!r} holds {kind} values, not text")
    prompts = prompts_from_table(table, prompt_col=args.column)  # text that is not UTF-8: bytes
    where = {name: getattr(args, name) for name in GENERATE_ARGS}
    results, seconds, stats, co_location = engines.embed(prompts, **where, **options)
    table = add_embedding_columns(table, results, args.output_col)
    write_table(table, args.output)
    line = embed_summary(results, seconds, args.engine, stats)
    if co_location is not None:
        line += f"; {co_location}"
    print(f"{line}; wrote {args.output}")
    return 0


def embed_summary(results: list, seconds: float, engine: str, stats) -> str:
    """The embed run's summary line: rows, error rows, the vectors' length, prompt tokens
    and (on the local engine) the prefill computed and the saving, rows/s."""
    widths = {len(r.embedding) for r in results if r.embedding is not None}
    shape = f"{widths.pop()}-dimensional vectors" if len(widths) == 1 else "no vectors"
    prompt_tokens = sum(r.prompt_tokens for r in results if not r.is_error)
    line = (
        f"{len(results)} rows ({sum(r.is_error for r in results)} errors, {shape}) on {engine} "
        f"in {seconds:.1f} s, {len(results) / seconds if seconds > 0 else 0.0:.2f} rows/s; "
        f"{prompt_tokens:,} prompt tokens"
    )
    if stats is None:
        return f"{line} (prefill computed: each partition's line above)"
    saving = 1 - stats.prefill_tokens_computed / prompt_tokens if prompt_tokens else 0.0
    line += f", {stats.prefill_tokens_computed:,} prefilled (saving {saving:.1%})"
    if stats.engine_paths:
        line += f"; engine: {stats.engine_paths}"
    return line


def _generate(args, prompts: list, options: dict, constraints: list | None):
    """``engines.generate`` on the command's model and engine (``GENERATE_ARGS``)."""
    where = {name: getattr(args, name) for name in GENERATE_ARGS}
    return engines.generate(prompts, constraints=constraints, **where, **options)


def _constraint_values(args, table, options: dict) -> tuple[dict, list | None]:
    """(``options`` with --choices-col, --regex-col or --json-schema-col as {option: column},
    each row's cell as the engines take it), or (``options``, None) without them. ValueError
    for two at once, with --choices/--regex/--json-schema, or a column the table lacks. An
    empty CSV cell is null (CSV has no other null)."""
    from llm_operator.cli.tables import table_format

    given = {name: getattr(args, name) for name in engines.CONSTRAINT_OPTIONS}
    given = {name: column for name, column in given.items() if column is not None}
    if not given:
        return options, None
    named = [name for name in ("choices", "regex", "json_schema") if options.get(name) is not None]
    named = [f"--{name.replace('_', '-')}" for name in [*named, *given]]
    if len(named) > 1:
        raise ValueError(
            f"give at most one per-row or per-call constraint; got {' and '.join(named)}"
        )
    ((option, column),) = given.items()
    if column not in table.column_names:
        raise ValueError(
            f"{named[0]} {column!r} is not a column of the input; "
            f"columns: {', '.join(table.column_names)}"
        )
    values = table.column(column).to_pylist()
    if table_format(args.input) == "csv":
        values = [None if isinstance(v, str) and not v.strip() else v for v in values]
    cells = engines.constraint_cells(option.removesuffix("_col"), values)
    return {**options, option: column}, cells


def _dedupe_rows(prompts: list, constraints: list | None) -> tuple[list, list, list | None]:
    """(each distinct prompt, or (prompt, constraint), once; each row's index into them;
    their constraints)."""
    from llm_operator.prompts.dedupe import dedupe, distinct_with

    distinct, positions = dedupe(prompts)
    if constraints is None:
        return distinct, positions, None
    keys = [json.dumps(cell, default=repr) for cell in constraints]
    firsts, rows = distinct_with(positions, keys)
    return [prompts[i] for i in firsts], rows, [constraints[i] for i in firsts]


class Computed(NamedTuple):
    """What the engine computed (known on the local engine, summed over checkpoint chunks)."""

    prefill_tokens: int
    output_tokens: int
    generate_seconds: float
    server: tuple[int, int, int] = (0, 0, 0)  # a model server's prompt, cached, output tokens
    engine_paths: str = ""  # how the engine ran its steps (native: EnginePaths.describe)


def _computed(stats) -> Computed | None:
    """The operator's RunStats as Computed (None on spark and dask)."""
    if stats is None:
        return None
    server = stats.server_prompt_tokens, stats.server_cached_tokens, stats.server_completion_tokens
    computed = (stats.prefill_tokens_computed, stats.output_tokens, stats.generate_seconds)
    return Computed(*computed, server, stats.engine_paths)


def summary(results: list, seconds: float, engine: str, computed: Computed | None) -> str:
    """The run's summary line: rows, error rows, constrained rows cut by max_tokens, prompt
    tokens of every row (duplicates included), prefill computed and the saving against
    those, output tokens, rows/s. On Spark and Dask the prefill is in the workers' lines."""
    counts = f"{sum(r.is_error for r in results)} errors"
    invalid = sum(r.is_invalid for r in results)
    if invalid:  # constrained rows cut by max_tokens: text kept, out_error says why
        counts += f", {invalid} constrained outputs cut before they were valid: raise --max-tokens"
    prompt_tokens = sum(r.prompt_tokens for r in results if not r.is_error)
    outputs = f", {sum(r.completion_tokens for r in results):,} output tokens"
    line = (
        f"{len(results)} rows ({counts}) on {engine} in {seconds:.1f} s, "
        f"{len(results) / seconds if seconds > 0 else 0.0:.2f} rows/s; "
        f"{prompt_tokens:,} prompt tokens"
    )
    if computed is None:
        return f"{line} (prefill computed: each partition's line above){outputs}"
    saving = 1 - computed.prefill_tokens / prompt_tokens if prompt_tokens else 0.0
    line += f", {computed.prefill_tokens:,} prefilled (saving {saving:.1%}){outputs}"
    if computed.generate_seconds > 0:
        line += f" ({computed.output_tokens / computed.generate_seconds:.1f}/s)"
    sent, cached, generated = computed.server
    if sent:
        line += (
            f"; model server: {sent:,} prompt tokens, {cached:,} from its prefix cache "
            f"({cached / sent:.1%}), {generated:,} generated"
        )
    if computed.engine_paths:
        line += f"; engine: {computed.engine_paths}"
    return line


def _run_checkpointed(args, prompts: list, options: dict, constraints: list | None = None):
    """``generate`` chunk by chunk, each finished chunk saved in the checkpoint folder;
    chunks already there are not run again."""
    from llm_operator.cli.checkpoint import Checkpoint, fingerprint

    started = time.perf_counter()
    rows = prompts if constraints is None else list(zip(prompts, constraints))
    checkpoint = Checkpoint(
        args.checkpoint,
        job=fingerprint(args.model, options, rows),
        rows=len(prompts),
        chunk_rows=args.checkpoint_rows,
    )
    missing = checkpoint.missing()
    done = len(checkpoint.chunks()) - len(missing)
    if done:
        print(f"checkpoint: {done} of {len(checkpoint.chunks())} chunks done already")
    for start, end in missing:
        chunk = None if constraints is None else constraints[start:end]
        results, _, stats, _ = _generate(args, prompts[start:end], options, chunk)
        checkpoint.save(start, end, results, _computed(stats))
    computed = checkpoint.computed()  # every chunk's, those of an earlier run included
    computed = None if computed is None else Computed(*computed)
    return checkpoint.results(), time.perf_counter() - started, computed


def command_plan(args) -> int:
    """The prefix-sharing plan from the tokenizer alone. With --template or --columns,
    the plans of the given field order and of the order --reorder-fields chooses. With
    --estimate, also the predicted time of the prompts `run` would run (this loads the
    model)."""
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.prompts.dedupe import dedupe
    from llm_operator.prompts.encode import as_chat
    from llm_operator.prompts.field_order import ArrowStatistics, plan_fields
    from llm_operator.prompts.options import PromptOptions
    from llm_operator.prompts.table import render_arrow

    named = {"--executors": args.executors, "--sample-rows": args.sample_rows}
    named = [flag for flag, value in named.items() if value is not None]
    named += ["--recalibrate"] if args.recalibrate else []
    if named and not args.estimate:
        raise ValueError(f"{' and '.join(named)}: only with --estimate")
    table, prompts, fields, options, given, deduplicate = _load_prompts(args)
    chosen = option_table.split(options)
    op = LLMOperator(args.model, **chosen["engine"])
    sampling = SamplingParams(**chosen["sampling"])
    wrap = PromptOptions(**chosen["prompt"])  # the defaults of what was not given

    def model_prompts(rows: list, deduplicated: bool = deduplicate) -> list:
        """The rows as the model gets them; with --dedupe, each distinct one once."""
        rows = dedupe(rows)[0] if deduplicated else rows
        return as_chat(rows, chat=wrap.chat, system=wrap.system, chat_template=op.has_chat_template)

    example = _example_prompt(op, model_prompts(prompts, deduplicated=False))
    if not args.json and example is not None:
        print(f"the prompt of row {example[0]} as the model sees it:\n{example[1]}\n")
    if given is None or not given.movable:  # one order only
        plan = op.plan(model_prompts(prompts), sampling)
        report = plan.stats.as_dict()
        report["example_prompt"] = None if example is None else example[1]
        text = [plan.report()]
    else:
        rendered_with = given if fields is None else fields.chosen
        if fields is None:  # the statistics of both orders, even when the run keeps the given
            fields = plan_fields(given, ArrowStatistics(table, given))
        plans = {
            name: op.plan(
                model_prompts(prompts if order == rendered_with else render_arrow(table, order)),
                sampling,
            )
            for name, order in (("given", fields.given), ("chosen", fields.chosen))
        }
        orders = {name: list(getattr(fields, f"{name}_fields")) for name in plans}
        report = {
            "rows": fields.rows,
            "distinct_prompts": fields.distinct_prompts,
            "dedupe": deduplicate,
            **{
                name: {"fields": orders[name], **plan.stats.as_dict()}
                for name, plan in plans.items()
            },
            "estimate": fields.as_dict(),  # the field orders' statistics
        }
        text = [fields.report()]
        text += [
            f"\n{name} order: {', '.join(orders[name])}\n{plan.report()}"
            for name, plan in plans.items()
        ]
        before, after = (plans[name].stats.prefill_tokens for name in ("given", "chosen"))
        if before:
            ratio = f"{after:,} / {before:,} = {after / before:.2f}"
            text.append(f"\nprefill tokens, chosen / given order: {ratio}")
    if not args.json:
        print("\n".join(text))
    if args.estimate:  # what `run` runs: the rows as rendered, deduplicated with --dedupe
        cost = _estimate(op, model_prompts(prompts), sampling, args)
        report["cost"] = cost.as_dict()
        if not args.json:
            print(f"\n{cost.report()}")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _estimate(op, prompts: list, sampling, args):
    """``llm_operator.estimate.estimate`` with the --estimate options; its progress lines
    (calibrating) go to stdout, or to stderr with --json (stdout then holds JSON only)."""
    from llm_operator.estimate.estimate import estimate

    stream = sys.stderr if args.json else sys.stdout
    return estimate(
        op,
        prompts,
        sampling,
        sample_rows="auto" if args.sample_rows is None else args.sample_rows,
        executors=args.executors or 1,
        recalibrate=args.recalibrate,
        log=lambda line: print(line, file=stream, flush=True),
    )


def _example_prompt(op, prompts: list) -> tuple[int, str] | None:
    """(row, text) of the first row that runs, exactly as the model gets it: its token
    ids decoded (chat template, special tokens and all)."""
    for row, prompt in enumerate(prompts[:100]):
        ids = op.tokenize([prompt])[0]
        if ids is not None:
            return row, op.tokenizer.decode(ids)
    return None


def command_demo(args) -> int:
    from llm_operator.cli.demo import run_demo

    return run_demo(args, option_table.from_arguments(args, ["engine"]))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        return args.command_handler(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"llm-operator {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger(__name__).debug(
            "%s took %.1f s", args.command, time.perf_counter() - started
        )


if __name__ == "__main__":
    sys.exit(main())
