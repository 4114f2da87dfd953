"""The ``llm-operator`` command: run | plan | bench | demo."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the model over a table and write the outputs")
    _add_prompt_source(run)
    run.add_argument(
        "--output", type=Path, required=True, help="output file (.parquet, .csv or .jsonl)"
    )
    run.add_argument("--output-col", default="out", help="name of the output column (default: out)")
    run.add_argument(
        "--engine",
        default="local",
        choices=["local", "spark", "dask"],
        help="run in this process, on Spark (local mode, or --master) or on Dask (--scheduler)",
    )
    run.add_argument("--partitions", type=int, default=2, help="partitions for spark and dask")
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
    constraint_cols.add_argument(
        "--choices-col",
        metavar="NAME",
        help="a column holding each row's labels: a list (Parquet, JSONL), or text: a JSON "
        'list (["yes","no"]) or comma-separated (yes,no); an empty or null cell leaves the '
        "row unconstrained; a bad value is that row's error",
    )
    constraint_cols.add_argument(
        "--regex-col", metavar="NAME", help="a column holding each row's regular expression"
    )
    constraint_cols.add_argument(
        "--json-schema-col",
        metavar="NAME",
        help="a column holding each row's JSON schema (JSON text, or an object in JSONL)",
    )
    add_model_option(run)
    option_table.add_arguments(run)

    plan_help = (
        "print the prefix-sharing report without loading the model (--estimate loads it to "
        "predict the run's time)"
    )
    plan = commands.add_parser("plan", help=plan_help, description=plan_help)
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
        type=_executors_option,
        metavar="N",
        help="with --estimate: machines like this one the job is split over (the time of "
        "the slowest, and the machine-hours of all) (default: 1)",
    )
    cost.add_argument(
        "--sample-rows",
        type=_sample_rows_option,
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
    _add_demo_command(commands)
    return parser


def _add_demo_command(commands) -> None:
    demo = commands.add_parser("demo", help="classify the bundled reviews and tickets with SmolLM2")
    add_model_option(demo)
    demo.add_argument("--limit", type=int, help="only the first N rows")
    demo.add_argument("--output", type=Path, default=Path("demo-results/demo.jsonl"))
    demo.add_argument(
        "--compare-static", action="store_true", help="also run plain HF generate on fixed batches"
    )
    demo.add_argument(
        "--engine",
        default="spark",
        choices=["local", "spark", "dask"],
        help="where the job runs (default: Spark in local mode)",
    )
    demo.add_argument("--partitions", type=int, default=2, help="partitions for spark and dask")
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


def _add_installed_commands(commands) -> None:
    """The commands of the entry points of group COMMAND_GROUP, each name once; one that
    fails to load is left out with a warning. Every copy of a distribution's metadata is
    read: ``entry_points()`` keeps only the first one on sys.path, which from a source
    checkout can be a stale ``*.egg-info`` there rather than the installed one."""
    seen = set()
    points = (
        point
        for distribution in importlib.metadata.distributions()
        for point in distribution.entry_points.select(group=COMMAND_GROUP)
    )
    for point in points:
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


def _executors_option(text: str) -> int:
    """--executors: an int >= 1 (argparse names the option when this fails)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _sample_rows_option(text: str) -> int | str:
    """--sample-rows: "auto" or an int >= 0."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'expected "auto" or an integer >= 0, got {text!r}'
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f'expected "auto" or an integer >= 0, got {value}')
    return value


TABLE_OPTIONS = ("template", "columns", "instruction", "reorder_fields", "dedupe")
"""Prompt options the CLI applies itself, to the whole table, before any engine runs."""


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
    from llm_operator.cli.tables import (
        first_bytes_not_utf8,
        not_utf8_message,
        prompts_from_table,
        read_table,
    )
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
    if given is not None and args.encoding is None:  # a template needs text: say which byte
        found = first_bytes_not_utf8(table, given.fields)
        if found is not None:
            raise ValueError(not_utf8_message(args.input, found))
    rest = {k: v for k, v in options.items() if k not in TABLE_OPTIONS}
    if given is None:
        prompts = prompts_from_table(table, prompt_col=args.prompt_col)
        return Loaded(table, prompts, None, rest, None, dedupe)
    fields = None
    if options.get("reorder_fields", False):
        fields = plan_fields(given, ArrowStatistics(table, given))
    prompts = render_arrow(table, given if fields is None else fields.chosen)
    return Loaded(table, prompts, fields, rest, given, dedupe)


def command_run(args) -> int:
    from llm_operator.cli.engines import generate
    from llm_operator.cli.tables import add_result_columns, table_format, write_table

    table_format(args.output)  # fail on a bad output name before any work
    if args.scheduler is not None and args.engine != "dask":
        raise ValueError(f"--scheduler is for --engine dask (got --engine {args.engine})")
    if args.master is not None and args.engine != "spark":
        raise ValueError(f"--master is for --engine spark (got --engine {args.engine})")
    if args.engine != "local":  # one line per partition, from the workers
        logging.getLogger("llm_operator.integrations").setLevel(logging.INFO)
    table, prompts, fields, options, _, deduplicate = _load_prompts(args)
    if fields is not None:
        print(fields.report())
    constraints = _constraint_values(args, table, options)
    if constraints is not None:
        options = {**options, **constraints[0]}
        constraints = constraints[1]
    positions = None
    if deduplicate:
        prompts, positions, constraints = _dedupe_rows(prompts, constraints)
        print(f"dedupe: {len(positions)} rows, {len(prompts)} distinct prompts to compute")
    co_location = None
    if args.checkpoint is not None:
        results, seconds, stats = _run_checkpointed(args, prompts, options, constraints)
    else:
        results, seconds, stats, co_location = generate(
            prompts,
            engine=args.engine,
            model=args.model,
            constraints=constraints,
            **_engine_arguments(args),
            **options,
        )
        stats = _computed(stats)
    if positions is not None:
        results = [results[i] for i in positions]
    with_scores = bool(options.get("logprobs"))
    with_choices = options.get("choices") is not None or options.get("choices_col") is not None
    table = add_result_columns(
        table,
        results,
        args.output_col,
        logprobs=with_scores,
        choice_logprobs=with_scores and with_choices,
    )
    write_table(table, args.output)
    line = summary(results, seconds, args.engine, stats)
    if co_location is not None:
        line += f"; {co_location}"
    print(f"{line}; wrote {args.output}")
    return 0


def _constraint_values(args, table, options: dict) -> tuple[dict, list] | None:
    """With --choices-col, --regex-col or --json-schema-col: ({option: column}, each row's
    cell as the engines take it); None without. ValueError for two at once, with
    --choices/--regex/--json-schema, or a column the table lacks. An empty CSV cell is
    null (CSV has no other null)."""
    from llm_operator.cli.engines import CONSTRAINT_OPTIONS, constraint_cells
    from llm_operator.cli.tables import table_format

    given = {name: getattr(args, name) for name in CONSTRAINT_OPTIONS}
    given = {name: column for name, column in given.items() if column is not None}
    if not given:
        return None
    flags = [f"--{name.replace('_', '-')}" for name in ("choices", "regex", "json_schema")]
    named = [flag for flag in flags if options.get(flag[2:].replace("-", "_")) is not None]
    named += [f"--{name.replace('_', '-')}" for name in given]
    if len(named) > 1:
        raise ValueError(
            f"give at most one per-row or per-call constraint; got {' and '.join(named)}"
        )
    ((option, column),) = given.items()
    if column not in table.column_names:
        raise ValueError(
            f"--{option.replace('_', '-')} {column!r} is not a column of the input; "
            f"columns: {', '.join(table.column_names)}"
        )
    values = table.column(column).to_pylist()
    if table_format(args.input) == "csv":
        values = [None if isinstance(v, str) and not v.strip() else v for v in values]
    return {option: column}, constraint_cells(option.removesuffix("_col"), values)


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


def summary(results: list, seconds: float, engine: str, computed: Computed | None) -> str:
    """The run's summary line: rows, error rows, constrained rows cut by max_tokens, prompt
    tokens of every row (duplicates included), prefill computed and the saving against
    those, output tokens, rows/s. On Spark and Dask the prefill is in the workers' lines."""
    errors = sum(r.is_error for r in results)
    invalid = sum(r.is_invalid for r in results)
    counts = f"{errors} errors"
    if invalid:  # constrained rows cut by max_tokens: text kept, out_error says why
        counts += f", {invalid} constrained outputs cut before they were valid: raise --max-tokens"
    prompt_tokens = sum(r.prompt_tokens for r in results if not r.is_error)
    output_tokens = sum(r.completion_tokens for r in results)
    line = f"{len(results)} rows ({counts}) on {engine} in {seconds:.1f} s, "
    line += f"{len(results) / seconds if seconds > 0 else 0.0:.2f} rows/s; "
    line += f"{prompt_tokens:,} prompt tokens"
    if computed is None:
        line += " (prefill computed: each partition's line above)"
    else:
        saving = 1 - computed.prefill_tokens / prompt_tokens if prompt_tokens else 0.0
        line += f", {computed.prefill_tokens:,} prefilled (saving {saving:.1%})"
    line += f", {output_tokens:,} output tokens"
    if computed is not None and computed.generate_seconds > 0:
        line += f" ({computed.output_tokens / computed.generate_seconds:.1f}/s)"
    if computed is not None and computed.server[0]:
        sent, cached, generated = computed.server
        line += (
            f"; model server: {sent:,} prompt tokens, {cached:,} from its prefix cache "
            f"({cached / sent:.1%}), {generated:,} generated"
        )
    if computed is not None and computed.engine_paths:
        line += f"; engine: {computed.engine_paths}"
    return line


def _computed(stats) -> Computed | None:
    if stats is None:
        return None
    server = (
        stats.server_prompt_tokens,
        stats.server_cached_tokens,
        stats.server_completion_tokens,
    )
    return Computed(
        stats.prefill_tokens_computed,
        stats.output_tokens,
        stats.generate_seconds,
        server,
        stats.engine_paths,
    )


def _engine_arguments(args) -> dict[str, Any]:
    """Where the spark or dask engine runs: partitions, a Dask scheduler, a Spark master."""
    arguments: dict[str, Any] = {"partitions": args.partitions}
    if args.scheduler is not None:
        arguments["scheduler"] = args.scheduler
    if args.master is not None:
        arguments["master"] = args.master
    return arguments


def _run_checkpointed(args, prompts: list, options: dict, constraints: list | None = None):
    """``generate`` chunk by chunk, each finished chunk saved in the checkpoint folder;
    chunks already there are not run again."""
    from llm_operator.cli.checkpoint import Checkpoint, fingerprint
    from llm_operator.cli.engines import generate

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
        results, _, stats, _ = generate(
            prompts[start:end],
            engine=args.engine,
            model=args.model,
            constraints=None if constraints is None else constraints[start:end],
            **_engine_arguments(args),
            **options,
        )
        checkpoint.save(start, end, results, _computed(stats))
    computed = checkpoint.computed()  # every chunk's, those of an earlier run included
    if computed is not None:
        computed = Computed(*computed)
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

    if not args.estimate:
        named = [
            flag
            for flag, value in (
                ("--executors", args.executors),
                ("--sample-rows", args.sample_rows),
                ("--recalibrate", args.recalibrate or None),
            )
            if value is not None
        ]
        if named:
            raise ValueError(f"{' and '.join(named)}: only with --estimate")
    table, prompts, fields, options, given, deduplicate = _load_prompts(args)
    chosen = option_table.split(options)
    op = LLMOperator(args.model, **chosen["engine"])
    sampling = SamplingParams(**chosen["sampling"])

    wrap = PromptOptions(**chosen["prompt"])  # the defaults of what was not given

    def model_prompts(rows: list) -> list:
        return as_chat(rows, chat=wrap.chat, system=wrap.system, chat_template=op.has_chat_template)

    def plan_of(rows: list):
        if deduplicate:
            rows = dedupe(rows)[0]
        return op.plan(model_prompts(rows), sampling)

    def cost():
        """The estimate of what `run` runs: the rows as rendered (the chosen order with
        --reorder-fields), deduplicated with --dedupe."""
        rows = dedupe(prompts)[0] if deduplicate else prompts
        return _estimate(op, model_prompts(rows), sampling, args)

    example = _example_prompt(op, model_prompts(prompts))
    if not args.json and example is not None:
        row, text = example
        print(f"the prompt of row {row} as the model sees it:\n{text}\n")
    if given is None or not given.movable:  # one order only
        plan = plan_of(prompts)
        if args.json:
            report = plan.stats.as_dict()
            report["example_prompt"] = None if example is None else example[1]
            if args.estimate:
                report["cost"] = cost().as_dict()
            print(json.dumps(report, indent=2))
        else:
            print(plan.report())
            if args.estimate:
                print(f"\n{cost().report()}")
        return 0
    if fields is None:  # the statistics of both orders, even when the run keeps the given one
        fields = plan_fields(given, ArrowStatistics(table, given))
        rendered_with = given
    else:
        rendered_with = fields.chosen
    plans = {
        name: plan_of(prompts if order == rendered_with else render_arrow(table, order))
        for name, order in (("given", fields.given), ("chosen", fields.chosen))
    }
    if args.json:
        report = {
            "rows": fields.rows,
            "distinct_prompts": fields.distinct_prompts,
            "dedupe": deduplicate,
            **{
                name: {"fields": list(getattr(fields, f"{name}_fields")), **plan.stats.as_dict()}
                for name, plan in plans.items()
            },
            "estimate": fields.as_dict(),  # the field orders' statistics
        }
        if args.estimate:
            report["cost"] = cost().as_dict()
        print(json.dumps(report, indent=2))
        return 0
    print(fields.report())
    for name, plan in plans.items():
        print(f"\n{name} order: {', '.join(getattr(fields, f'{name}_fields'))}")
        print(plan.report())
    given, best = (plans[name].stats.prefill_tokens for name in ("given", "chosen"))
    if given:
        print(f"\nprefill tokens, chosen / given order: {best:,} / {given:,} = {best / given:.2f}")
    if args.estimate:
        print(f"\n{cost().report()}")
    return 0


def _estimate(op, prompts: list, sampling, args):
    """``llm_operator.estimate.estimate`` with the --estimate options; its progress lines
    (calibrating) go to stdout, or to stderr with --json (stdout then holds JSON only)."""
    from llm_operator.estimate.estimate import estimate

    stream = sys.stderr if args.json else sys.stdout

    def log(line: str) -> None:
        print(line, file=stream, flush=True)

    return estimate(
        op,
        prompts,
        sampling,
        sample_rows="auto" if args.sample_rows is None else args.sample_rows,
        executors=1 if args.executors is None else args.executors,
        recalibrate=args.recalibrate,
        log=log,
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

    return run_demo(
        model=args.model,
        limit=args.limit,
        output=args.output,
        compare_static=args.compare_static,
        engine=args.engine,
        partitions=args.partitions,
        compare_engines=args.compare_engines,
        compare_free=args.compare_free,
        options=option_table.from_arguments(args, ["engine"]),
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    handlers = {"run": command_run, "plan": command_plan, "demo": command_demo}
    handler = getattr(args, "command_handler", None) or handlers[args.command]
    started = time.perf_counter()
    try:
        return handler(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"llm-operator {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger(__name__).debug(
            "%s took %.1f s", args.command, time.perf_counter() - started
        )


if __name__ == "__main__":
    sys.exit(main())
