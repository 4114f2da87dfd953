"""The extraction job: JSON-schema extraction over the bundled reviews, with jump-forward
off, on for lone tokens ("tokens") and on for the grammar's forced text ("text").

    python -m llm_operator_bench.suites.jump_forward --rows 48 --repeat 2

Each mode runs the same rows (greedy, native backend) after one warm-up run; for each it
prints seconds, the model's iterations, one-token decodes, tokens run in jump chunks,
output and forced tokens, valid rows, and how many rows' parsed JSON values (and token
ids) differ from the run with jump-forward off. The modes are switched through
``op.constraints().jump_forward`` (``llm_operator.engine.constraints``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

MODES = ("off", "tokens", "text")

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "product": {"type": "string", "pattern": "[A-Za-z' -]{1,32}"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "product", "rating"],
}
SYSTEM = "You extract fields from product reviews and answer with JSON only."


def extraction_prompts(rows: int) -> list[list[dict[str, str]]]:
    """Chat prompts for the first ``rows`` bundled reviews."""
    from llm_operator.cli.demo_data import load_rows

    reviews = load_rows("reviews")[:rows]
    return [
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": "Give the review's sentiment (positive, negative or mixed), the "
                "product it is about and its star rating from 1 to 5 as JSON with keys "
                f"sentiment, product, rating.\nReview: {review['text']}",
            },
        ]
        for review in reviews
    ]


def run_mode(op, prompts, params, mode: str) -> dict[str, Any]:
    op.constraints().jump_forward = mode
    started = time.perf_counter()
    results = op.generate(prompts, params)
    seconds = time.perf_counter() - started
    stats = op.last_stats
    profile = getattr(op.backend(), "last_profile", None)
    values = []
    for result in results:
        try:
            values.append(json.loads(result.text) if result.error is None else None)
        except json.JSONDecodeError:
            values.append(None)
    return {
        "mode": mode,
        "seconds": seconds,
        "generate_seconds": stats.generate_seconds,
        "iterations": getattr(profile, "iterations", None),
        "decode_tokens": getattr(profile, "decode_tokens", None),
        "jump_chunk_tokens": getattr(profile, "jump_chunk_tokens", None),
        "output_tokens": stats.output_tokens,
        "forced_tokens": stats.forced_tokens,
        "valid_rows": sum(v is not None for v in values),
        "token_ids": [list(r.token_ids) for r in results],
        "values": values,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", default="native")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)

    from llm_operator import LLMOperator, SamplingParams

    op = LLMOperator(args.model, backend=args.backend, progress=False)
    prompts = extraction_prompts(args.rows)
    params = SamplingParams(max_tokens=args.max_tokens, json_schema=SCHEMA)
    run_mode(op, prompts, params, "off")  # warm-up: compile the grammar, touch the pool
    records = []
    for repeat in range(args.repeat):
        runs = {mode: run_mode(op, prompts, params, mode) for mode in MODES}
        base = runs["off"]
        for mode, record in runs.items():
            record["repeat"] = repeat
            record["values_differ"] = sum(a != b for a, b in zip(record["values"], base["values"]))
            record["tokens_differ"] = sum(
                a != b for a, b in zip(record["token_ids"], base["token_ids"])
            )
            records.append(record)
            print(
                f"repeat {repeat} {mode:>6}: {record['seconds']:.2f} s, "
                f"{record['iterations']} iterations, {record['decode_tokens']} decodes, "
                f"{record['jump_chunk_tokens']} jump-chunk tokens, "
                f"{record['output_tokens']} output tokens, {record['forced_tokens']} forced, "
                f"{record['valid_rows']}/{len(prompts)} valid, values differ from off in "
                f"{record['values_differ']} rows, token ids in {record['tokens_differ']}",
                flush=True,
            )
    examples = [
        (base["values"][i], runs["text"]["values"][i])
        for i in range(len(prompts))
        if base["values"][i] != runs["text"]["values"][i]
    ]
    for off_value, text_value in examples[:5]:
        print(f"  off: {off_value}\n  text: {text_value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "schema": SCHEMA, "records": records}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
