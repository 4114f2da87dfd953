"""Dask quickstart: classify the bundled demo rows with one LLM call on a Dask frame.

    python examples/dask_quickstart.py --limit 40 --partitions 2 --output /tmp/labels.parquet
    python examples/dask_quickstart.py --cluster     # on a distributed.LocalCluster

The job:

1. ``co_locate(ddf, "prompt")`` puts rows that share a prompt prefix (here: a task's
   system prompt, instructions and few-shot examples) into the same partition, sorted,
   so each partition's batch shares as much as possible;
2. ``llm_infer(ddf, "prompt", output="out", model=...)`` adds the columns ``out``,
   ``out_finish_reason``, ``out_prompt_tokens``, ``out_completion_tokens``,
   ``out_error``, ``out_logprob`` and ``out_choice_logprobs``: one partition is one batch planned as a whole (shared prefixes
   prefilled once, decode-first order);
3. ``compute()``: by default on the synchronous scheduler (one partition after another,
   each using every core through torch), or ``--scheduler threads``; ``--cluster`` runs
   it on an in-process ``distributed.LocalCluster`` instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 6
STOP = ["\n"]
SHOW_ROWS = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias, HF model directory or .gguf file"
    )
    parser.add_argument("--limit", type=int, default=40, help="demo rows to classify")
    parser.add_argument("--partitions", type=int, default=2, help="Dask partitions (batches)")
    parser.add_argument("--output", default=None, help="write the results here as Parquet")
    parser.add_argument(
        "--scheduler",
        choices=("synchronous", "threads"),
        default="synchronous",
        help="local Dask scheduler (ignored with --cluster)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run on an in-process distributed.LocalCluster (no dashboard)",
    )
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    return args


def demo_frame(limit: int, partitions: int) -> dd.DataFrame:
    """The first ``limit`` bundled demo rows (id, task, plain-text prompt) as a Dask frame."""
    import dask.dataframe as dd
    import pandas as pd

    from llm_operator.cli.demo_data import build_demo_rows

    rows = build_demo_rows(limit=limit)
    frame = pd.DataFrame(
        {
            "id": [row["id"] for row in rows],
            "task": [row["task"] for row in rows],
            "prompt": [row["prompt"] for row in rows],
        }
    )
    return dd.from_pandas(frame, npartitions=partitions)


def label_frame(ddf: dd.DataFrame, *, model: str, partitions: int) -> dd.DataFrame:
    """``ddf`` co-located by prompt prefix, with the model's answer and finish reason (lazy)."""
    from llm_operator.integrations.dask import co_locate, llm_infer

    ddf = co_locate(ddf, "prompt", npartitions=partitions)
    ddf = llm_infer(ddf, "prompt", output="out", model=model, max_tokens=MAX_TOKENS, stop=STOP)
    return ddf[["id", "task", "out", "out_finish_reason"]]


def compute(ddf: dd.DataFrame, *, scheduler: str, cluster: bool) -> pd.DataFrame:
    """Run the graph on a local scheduler, or on an in-process LocalCluster."""
    if not cluster:
        return ddf.compute(scheduler=scheduler)
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as local_cluster,
        Client(local_cluster) as client,
    ):
        return client.compute(ddf).result()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the quickstart; returns the process exit code."""
    args = parse_args(argv)
    ddf = demo_frame(args.limit, args.partitions)
    lazy = label_frame(ddf, model=args.model, partitions=args.partitions)
    began = time.perf_counter()
    result = compute(lazy, scheduler=args.scheduler, cluster=args.cluster)
    seconds = time.perf_counter() - began
    where = "a LocalCluster" if args.cluster else f"the {args.scheduler} scheduler"
    for row in result.sort_values("id").head(SHOW_ROWS).itertuples(index=False):
        print(f"{row.id:>6} {row.task:<18} {row.out_finish_reason!s:<7} {row.out!r}")
    print(
        f"{len(result)} rows in {seconds:.1f} s: {len(result) / seconds:.2f} rows/s "
        f"({args.partitions} partitions on {where}, model load included)"
    )
    if args.output:
        result.to_parquet(args.output, index=False)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
