"""The ``llm-operator`` command: run | plan | bench | demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias, Hugging Face model directory or .gguf file"
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow code shipped with the model to run"
    )


def _add_prompt_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="a Parquet, CSV or JSONL file")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt-col", help="the column holding the prompts")
    source.add_argument(
        "--template", help='a prompt template over the columns, e.g. "Review: {text}\\nLabel:"'
    )
    parser.add_argument(
        "--chat", action="store_true", help="send each prompt as a user chat message"
    )
    parser.add_argument("--system", help="a system message (implies --chat)")
    parser.add_argument("--limit", type=int, help="only the first N rows")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--seed", type=int)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", choices=["auto", "hf", "native", "vllm"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="auto", help='bytes or a size such as "2GiB"')
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the model over a table and write the outputs")
    _add_prompt_options(run)
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
    _add_model_options(run)
    _add_sampling_options(run)
    _add_engine_options(run)

    plan = commands.add_parser(
        "plan", help="print the prefix-sharing report without loading the model"
    )
    _add_prompt_options(plan)
    _add_model_options(plan)
    plan.add_argument("--max-tokens", type=int, default=64)
    plan.add_argument("--json", action="store_true", help="print the statistics as JSON")

    bench = commands.add_parser(
        "bench",
        help="measure every system side by side (or, with 'planner', the planner alone)",
        description="Run the benchmark workloads through every system in one run and write "
        "<out>/<name>.json, .md and .png. 'bench planner' times the prefix planner alone.",
    )
    bench.add_argument(
        "target",
        nargs="?",
        default="systems",
        choices=["systems", "planner"],
        help="systems (default) or planner",
    )
    bench.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias, Hugging Face model directory or .gguf file"
    )
    bench.add_argument(
        "--quick", action="store_true", help="small workloads (about 2 minutes on 2 CPU cores)"
    )
    bench.add_argument(
        "--size",
        choices=["tiny", "quick", "default"],
        help="workload sizes (default: default, or quick with --quick; tiny fits a 256-token model)",
    )
    bench.add_argument("--systems", help="comma-separated systems, or 'all' (the default)")
    bench.add_argument("--workloads", help="comma-separated workloads, or 'all' (the default)")
    bench.add_argument("--repeat", type=int, default=1, help="runs per system; medians reported")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    bench.add_argument("--name", help="file name of the results (default: bench-<size>)")
    bench.add_argument("--static-batch-size", type=int, default=16, help="rows per hf-static batch")
    bench.add_argument(
        "--kv-cache-gib", type=float, default=4.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)"
    )
    bench.add_argument(
        "--vllm-block-size",
        type=int,
        help="vLLM's KV block size (default: vLLM's own, 128 tokens on CPU; a multiple of 32)",
    )
    bench.add_argument(
        "--vllm-eager",
        action="store_true",
        help="start vLLM without torch.compile (seconds instead of a minute; --quick sets it)",
    )
    bench.add_argument("--vllm-python", help="python of a venv with vllm (default: .venv-vllm)")
    bench.add_argument("--timeout", type=float, help="seconds allowed per system")
    bench.add_argument(
        "--prompts", default="10000,100000,1000000", help="planner: batch sizes, comma-separated"
    )
    bench.add_argument("--prompt-tokens", type=int, default=500, help="planner: tokens per prompt")

    demo = commands.add_parser("demo", help="classify the bundled reviews and tickets with SmolLM2")
    _add_model_options(demo)
    demo.add_argument("--limit", type=int, help="only the first N rows")
    demo.add_argument("--output", type=Path, default=Path("demo-results/demo.jsonl"))
    demo.add_argument("--max-batch-size", type=int, default=64)
    demo.add_argument(
        "--compare-static", action="store_true", help="also run plain HF generate on fixed batches"
    )
    demo.add_argument("--no-progress", action="store_true")
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
    return parser


def _load_prompts(args) -> tuple[object, list]:
    from llm_operator.tables import prompts_from_table, read_table

    table = read_table(args.input)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        table = table.slice(0, args.limit)
    prompts = prompts_from_table(table, prompt_col=args.prompt_col, template=args.template)
    if args.chat or args.system:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [
            None if p is None else [*system, {"role": "user", "content": p}] for p in prompts
        ]
    return table, prompts


def command_run(args) -> int:
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.tables import add_result_columns, table_format, write_table

    table_format(args.output)  # fail on a bad output name before any work
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    table, prompts = _load_prompts(args)
    engine_options = {
        "device": args.device,
        "dtype": args.dtype,
        "max_batch_size": args.max_batch_size,
        "kv_cache_memory": args.kv_cache_memory,
        "trust_remote_code": args.trust_remote_code,
    }
    if args.engine != "local":
        from llm_operator.integrations.engines import generate

        options = {
            k: getattr(sampling, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")
        }
        results, seconds = generate(
            prompts,
            engine=args.engine,
            model=args.model,
            sampling={**options, "stop": list(sampling.stop)},
            engine_options=engine_options,
            partitions=args.partitions,
        )
        write_table(add_result_columns(table, results, args.output_col), args.output)
        errors = sum(r.finish_reason == "error" for r in results)
        print(
            f"{len(results)} rows ({errors} errors) on {args.engine} in {seconds:.1f} s: "
            f"{len(results) / seconds:.2f} rows/s; wrote {args.output}"
        )
        return 0
    op = LLMOperator(
        args.model, backend=args.backend, progress=not args.no_progress, **engine_options
    )
    results = op.generate(prompts, sampling)
    write_table(add_result_columns(table, results, args.output_col), args.output)
    stats = op.last_stats
    print(
        f"{stats.rows} rows ({stats.error_rows} errors) in {stats.seconds:.1f} s: "
        f"{stats.rows_per_second:.2f} rows/s, {stats.output_tokens_per_second:.1f} output tokens/s, "
        f"saving ratio {stats.saving_ratio:.1%}; wrote {args.output}"
    )
    return 0


def command_plan(args) -> int:
    from llm_operator import LLMOperator, SamplingParams

    _, prompts = _load_prompts(args)
    op = LLMOperator(args.model, trust_remote_code=args.trust_remote_code)
    plan = op.plan(prompts, SamplingParams(max_tokens=args.max_tokens))
    print(json.dumps(plan.stats.as_dict(), indent=2) if args.json else plan.report())
    return 0


def command_bench(args) -> int:
    if args.target == "planner":
        from llm_operator.bench.planner_scale import run_planner_suite

        sizes = [int(text) for text in args.prompts.split(",") if text.strip()]
        run_planner_suite(sizes, args.prompt_tokens, seed=args.seed, out=args.out / "planner.json")
        return 0
    from llm_operator.bench.suite import run_benchmark

    report = run_benchmark(
        model=args.model,
        systems=args.systems,
        workloads=args.workloads,
        size=args.size or ("quick" if args.quick else "default"),
        repeat=args.repeat,
        seed=args.seed,
        out_dir=args.out,
        name=args.name,
        static_batch_size=args.static_batch_size,
        kv_cache_gib=args.kv_cache_gib,
        vllm_block_size=args.vllm_block_size,
        vllm_eager=args.vllm_eager or args.quick,
        vllm_python=args.vllm_python,
        timeout=args.timeout,
    )
    from llm_operator.bench.report import markdown_table

    print(markdown_table(report["results"], [{**w, "summary": w} for w in report["workloads"]]))
    failed = [r for r in report["results"] if r["status"] == "failed"]
    return 1 if failed else 0


def command_demo(args) -> int:
    from llm_operator.demo import run_demo

    return run_demo(
        model=args.model,
        limit=args.limit,
        output=args.output,
        max_batch_size=args.max_batch_size,
        compare_static=args.compare_static,
        progress=not args.no_progress,
        engine=args.engine,
        partitions=args.partitions,
        compare_engines=args.compare_engines,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    handlers = {
        "run": command_run,
        "plan": command_plan,
        "bench": command_bench,
        "demo": command_demo,
    }
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
