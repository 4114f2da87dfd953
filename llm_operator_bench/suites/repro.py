"""Reproducible columns: does a row get the same greedy tokens whatever batch,
partition or process it runs in?

    llm-operator bench repro [--rows 200] [--systems native,hf] [--dtypes float32,bfloat16]
                             [--single-rows 40] [--out DIR --name NAME]

Two jobs of ``--rows`` rows on the model (default SmolLM2-135M-Instruct):
    movielens    MovieLens ratings (``fields.movielens_table``) through a template, each
                 answered with one of four choices (constrained, greedy);
    etl-fewshot  the benchmark's few-shot extraction workload, 32 tokens a row.

Each (system, dtype, mode) runs the job in a worker process as one call (the reference),
then the same rows
    in 4 partitions    rows spread over 4 calls by a hash of their index, so each call's
                       batches and shared prefixes differ from the whole job's;
    one at a time      ``--single-rows`` rows, spread over the job, each in its own call;
    dedupe             each distinct prompt once (as ``dedupe=True`` runs them);
    second process     the whole job again in a new worker process (what a Spark retry or a
                       resumed checkpoint does: a new process computes the rows again).
and counts the rows whose tokens equal the reference's. Modes: the native backend with
``deterministic`` off and on; the hf backend has one mode (not batch-invariant).
"""

from __future__ import annotations

import json
import multiprocessing
import time
import zlib
from pathlib import Path
from typing import Any

CASES = ("4 partitions", "one at a time", "dedupe", "second process")
JOBS = ("movielens", "etl-fewshot")
MOVIELENS_CHOICES = ("children", "teenagers", "adults", "everyone")
MOVIELENS_TEMPLATE = (
    "Title: {title}\nGenres: {genres}\nrating: {rating}\n"
    "Who would enjoy this movie most: children, teenagers, adults or everyone?"
)


def make_job(name: str, tokenizer: Any, rows: int) -> tuple[list, list]:
    """(prompts, SamplingParams per row) of job ``name`` with ``rows`` rows."""
    from llm_operator import SamplingParams

    if name == "movielens":
        from llm_operator_bench.suites.fields import movielens_table

        frame, _ = movielens_table(rows=rows)
        prompts = [
            [{"role": "user", "content": MOVIELENS_TEMPLATE.format(**record)}]
            for record in frame.to_dict("records")
        ]
        params = SamplingParams(max_tokens=8, temperature=0.0, choices=MOVIELENS_CHOICES)
        return prompts, [params] * len(prompts)
    if name == "etl-fewshot":
        from llm_operator_bench.core.workloads import make_workload

        groups = 4
        workload = make_workload(
            name, tokenizer, groups=groups, rows_per_group=-(-rows // groups),
            max_tokens=(32, 32),
        )  # fmt: skip
        prompts = list(workload.prompts)[:rows]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        return prompts, [params] * len(prompts)
    raise ValueError(f"unknown job {name!r}; choose from {', '.join(JOBS)}")


def _answers(results) -> list:
    return [None if r.error else list(r.token_ids) for r in results]


def _partition(row: int) -> int:
    return zlib.crc32(f"row {row}".encode()) % 4


def _worker(task: dict[str, Any], queue) -> None:
    """One (system, dtype, mode, job) in this process: the reference, then ``cases``."""
    try:
        from llm_operator import LLMOperator
        from llm_operator.models import load_tokenizer, resolve_model

        started = time.perf_counter()
        options = {"backend": task["backend"], "dtype": task["dtype"]}
        if task["backend"] == "native":
            options["deterministic"] = task["deterministic"]
        op = LLMOperator(task["model"], **options)
        tokenizer = load_tokenizer(resolve_model(task["model"]).path)
        prompts, params = make_job(task["job"], tokenizer, task["rows"])
        out: dict[str, Any] = {"reference": _answers(op.generate(prompts, params))}
        rows = range(len(prompts))
        if "4 partitions" in task["cases"]:
            answers: list = [None] * len(prompts)
            for part in range(4):
                chosen = [r for r in rows if _partition(r) == part]
                got = _answers(
                    op.generate([prompts[r] for r in chosen], [params[r] for r in chosen])
                )
                for r, answer in zip(chosen, got):
                    answers[r] = answer
            out["4 partitions"] = answers
        if "one at a time" in task["cases"]:
            step = max(1, len(prompts) // task["single_rows"])
            answers = [None] * len(prompts)
            for r in list(rows)[::step][: task["single_rows"]]:
                answers[r] = _answers(op.generate([prompts[r]], [params[r]]))[0]
            out["one at a time"] = answers
        if "dedupe" in task["cases"]:
            keys = [json.dumps(p, sort_keys=True) for p in prompts]
            first = {key: r for r, key in reversed(list(enumerate(keys)))}
            distinct = sorted(first.values())
            got = _answers(
                op.generate([prompts[r] for r in distinct], [params[r] for r in distinct])
            )
            by_key = {keys[r]: answer for r, answer in zip(distinct, got)}
            out["dedupe"] = [by_key[key] for key in keys]
            out["distinct"] = len(distinct)
        out["seconds"] = time.perf_counter() - started
        queue.put(out)
    except BaseException as error:  # noqa: BLE001 (reported to the parent)
        queue.put({"error": f"{type(error).__name__}: {error}"})


def _in_process(task: dict[str, Any]) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(task, queue))
    process.start()
    result = queue.get()
    process.join()
    if "error" in result:
        raise RuntimeError(f"{task['backend']} {task['dtype']} {task['job']}: {result['error']}")
    return result


def _same(reference: list, other: list) -> tuple[int, int]:
    pairs = [(a, b) for a, b in zip(reference, other) if b is not None and a is not None]
    return sum(a == b for a, b in pairs), len(pairs)


def run_repro(
    *,
    model: str,
    systems: list[str],
    dtypes: list[str],
    jobs: list[str],
    rows: int,
    single_rows: int,
    out: Path,
    name: str,
) -> dict[str, Any]:
    modes = {"native": (False, True), "hf": (False,)}
    unknown = [s for s in systems if s not in modes]
    if unknown:
        raise ValueError(f"repro systems are native and hf, got {unknown}")
    records = []
    for job in jobs:
        for backend in systems:
            for dtype in dtypes:
                for deterministic in modes[backend]:
                    task = dict(
                        model=model, backend=backend, dtype=dtype, deterministic=deterministic,
                        job=job, rows=rows, single_rows=single_rows, cases=CASES[:3],
                    )  # fmt: skip
                    first = _in_process(task)
                    second = _in_process({**task, "cases": ()})
                    record = dict(
                        job=job, backend=backend, dtype=dtype, deterministic=deterministic,
                        seconds=round(first["seconds"], 1),
                        errors=sum(a is None for a in first["reference"]),
                    )  # fmt: skip
                    for case in CASES[:3]:
                        record[case] = _same(first["reference"], first[case])
                    record["second process"] = _same(first["reference"], second["reference"])
                    records.append(record)
                    print(_line(record), flush=True)
    report = {"model": model, "rows": rows, "single_rows": single_rows, "records": records}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report))
    return report


def _line(record: dict[str, Any]) -> str:
    mode = "deterministic" if record["deterministic"] else "not deterministic"
    cells = "  ".join(f"{case}: {record[case][0]}/{record[case][1]}" for case in CASES)
    return f"{record['job']:12} {record['backend']:6} {record['dtype']:8} {mode:17} {cells}"


def markdown(report: dict[str, Any]) -> str:
    """The identical/total table of a report."""
    lines = [
        f"Rows with the same greedy tokens as the whole job in one call ({report['rows']} rows; "
        f"one at a time: {report['single_rows']} of them).",
        "",
        "| job | backend | dtype | mode | " + " | ".join(CASES) + " |",
        "|---|---|---|---|" + "---:|" * len(CASES),
    ]
    for r in report["records"]:
        mode = "deterministic" if r["deterministic"] else "not deterministic"
        cells = " | ".join(f"{r[c][0]}/{r[c][1]}" for c in CASES)
        lines.append(f"| {r['job']} | {r['backend']} | {r['dtype']} | {mode} | {cells} |")
    return "\n".join(lines) + "\n"
