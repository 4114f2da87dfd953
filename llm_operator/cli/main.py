"""The ``llm-operator`` command: run | plan | bench | demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from llm_operator import options as option_table

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias, Hugging Face model directory or .gguf file"
    )


def _add_prompt_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="a Parquet, CSV or JSONL file")
    parser.add_argument(
        "--prompt-col",
        help="the column holding the prompts (or build them with --template or --columns)",
    )
    parser.add_argument("--limit", type=int, help="only the first N rows")


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
        help="run in this process, on Spark (local mode) or on Dask",
    )
    run.add_argument("--partitions", type=int, default=2, help="partitions for spark and dask")
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
    _add_model_option(run)
    option_table.add_arguments(run)

    plan = commands.add_parser(
        "plan", help="print the prefix-sharing report without loading the model"
    )
    _add_prompt_source(plan)
    _add_model_option(plan)
    plan.add_argument("--json", action="store_true", help="print the statistics as JSON")
    option_table.add_arguments(plan)

    from llm_operator_bench.cli import add_commands

    add_commands(commands, _add_model_option)
    return parser


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
    from llm_operator.cli.tables import prompts_from_table, read_table
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
    table = read_table(args.input)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        table = table.slice(0, args.limit)
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
    from llm_operator.prompts.dedupe import dedupe

    table_format(args.output)  # fail on a bad output name before any work
    table, prompts, fields, options, _, deduplicate = _load_prompts(args)
    if fields is not None:
        print(fields.report())
    positions = None
    if deduplicate:
        prompts, positions = dedupe(prompts)
        print(f"dedupe: {len(positions)} rows, {len(prompts)} distinct prompts to compute")
    if args.checkpoint is not None:
        results, seconds, stats = _run_checkpointed(args, prompts, options)
    else:
        results, seconds, stats = generate(
            prompts, engine=args.engine, model=args.model, partitions=args.partitions, **options
        )
    if positions is not None:
        results = [results[i] for i in positions]
    with_scores = bool(options.get("logprobs"))
    table = add_result_columns(
        table,
        results,
        args.output_col,
        logprobs=with_scores,
        choice_logprobs=with_scores and options.get("choices") is not None,
    )
    write_table(table, args.output)
    errors = sum(r.is_error for r in results)
    invalid = sum(r.is_invalid for r in results)
    counts = f"{errors} errors"
    if invalid:  # constrained rows cut by max_tokens: text kept, out_error says why
        counts += f", {invalid} constrained outputs cut before they were valid: raise --max-tokens"
    line = f"{len(results)} rows ({counts}) on {args.engine} in {seconds:.1f} s: "
    line += f"{len(results) / seconds:.2f} rows/s"
    if stats is not None:
        line += (
            f", {stats.output_tokens_per_second:.1f} output tokens/s, "
            f"saving ratio {stats.saving_ratio:.1%}"
        )
    print(f"{line}; wrote {args.output}")
    return 0


def _run_checkpointed(args, prompts: list, options: dict):
    """``generate`` chunk by chunk, each finished chunk saved in the checkpoint folder;
    chunks already there are not run again."""
    from llm_operator.cli.checkpoint import Checkpoint, fingerprint
    from llm_operator.cli.engines import generate

    started = time.perf_counter()
    checkpoint = Checkpoint(
        args.checkpoint,
        job=fingerprint(args.model, options, prompts),
        rows=len(prompts),
        chunk_rows=args.checkpoint_rows,
    )
    missing = checkpoint.missing()
    done = len(checkpoint.chunks()) - len(missing)
    if done:
        print(f"checkpoint: {done} of {len(checkpoint.chunks())} chunks done already")
    for start, end in missing:
        results, _, _ = generate(
            prompts[start:end],
            engine=args.engine,
            model=args.model,
            partitions=args.partitions,
            **options,
        )
        checkpoint.save(start, end, results)
    return checkpoint.results(), time.perf_counter() - started, None


def command_plan(args) -> int:
    """The prefix-sharing plan from the tokenizer alone. With --template or --columns,
    the plans of the given field order and of the order --reorder-fields chooses."""
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.prompts.dedupe import dedupe
    from llm_operator.prompts.encode import as_chat
    from llm_operator.prompts.field_order import ArrowStatistics, plan_fields
    from llm_operator.prompts.table import render_arrow

    table, prompts, fields, options, given, deduplicate = _load_prompts(args)
    chosen = option_table.split(options)
    op = LLMOperator(args.model, **chosen["engine"])
    sampling = SamplingParams(**chosen["sampling"])

    def plan_of(rows: list):
        if deduplicate:
            rows = dedupe(rows)[0]
        return op.plan(as_chat(rows, **chosen["prompt"]), sampling)

    if given is None or not given.movable:  # one order only
        plan = plan_of(prompts)
        print(json.dumps(plan.stats.as_dict(), indent=2) if args.json else plan.report())
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
            "estimate": fields.as_dict(),
        }
        print(json.dumps(report, indent=2))
        return 0
    print(fields.report())
    for name, plan in plans.items():
        print(f"\n{name} order: {', '.join(getattr(fields, f'{name}_fields'))}")
        print(plan.report())
    given, best = (plans[name].stats.prefill_tokens for name in ("given", "chosen"))
    if given:
        print(f"\nprefill tokens, chosen / given order: {best:,} / {given:,} = {best / given:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from llm_operator_bench.cli import COMMANDS

    handlers = {"run": command_run, "plan": command_plan, **COMMANDS}
    started = time.perf_counter()
    try:
        return handlers[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"llm-operator {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger(__name__).debug(
            "%s took %.1f s", args.command, time.perf_counter() - started
        )


if __name__ == "__main__":
    sys.exit(main())
