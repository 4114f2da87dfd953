"""One record per (system, workload): every metric, computed the same way for all systems
from what they returned (``bench.core.worker`` / ``bench.baselines.vllm_runner`` RESULTs).

On a workload with labels (classify), each row's output is read as a label the way the
demo reads it (``demo_data.parse_label``: the first of the row's labels its text names,
the text cut at the workload's first stop string), whether the system was constrained
or not: ``names_label`` is the fraction of rows whose output names one of their labels,
``gold_agreement`` the fraction that names the label the input was written for, and
``same_label_as`` maps each other system on the workload to the fraction of rows where
both read as the same label (None counts as a label: two outputs naming none agree).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from llm_operator_bench.core.flops import ModelShape, attention_keys, work_flop
from llm_operator_bench.core.rate import rate_for
from llm_operator_bench.core.systems import BASELINE, VLLM_REFERENCE, SystemSpec, runs_on


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _normalize(ids: Sequence[int], eos_ids: set[int]) -> list[int]:
    """Generated ids without trailing EOS (systems differ in whether they keep it)."""
    ids = list(ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def work_figures(
    shape: ModelShape | None,
    rates: dict[str, Any] | None,
    workload: dict,
    generated: Sequence[Sequence[int]],
    *,
    prefill_tokens: int,
    seconds: float,
    dtype: str | None,
) -> dict[str, Any]:
    """``work_gflop`` (``flops.work_flop`` with keys estimated from this workload's prompt
    lengths and this system's output lengths), ``gflop_per_second`` and ``rate_fraction``
    (that over the machine's measured matmul rate for ``dtype``); None where unknown."""
    if shape is None:
        return {"work_gflop": None, "gflop_per_second": None, "rate_fraction": None}
    outputs = [len(ids) for ids in generated]
    prefill_keys, output_keys = attention_keys([len(ids) for ids in workload["token_ids"]], outputs)
    gflop = (
        work_flop(
            shape,
            prefill_tokens=prefill_tokens,
            output_tokens=sum(outputs),
            prefill_keys=prefill_keys,
            output_keys=output_keys,
        )
        / 1e9
    )
    per_second = gflop / seconds if seconds else None
    rate = rate_for(rates, dtype)
    return {
        "work_gflop": gflop,
        "gflop_per_second": per_second,
        "rate_fraction": per_second / rate if per_second is not None and rate else None,
    }


def output_labels(
    workload: dict, generated: Sequence[Sequence[int]], decode: Callable[[list[int]], str]
) -> list[str | None]:
    """Each row's output read as one of its labels (None: it names none); module doc."""
    from llm_operator.cli.demo_data import parse_label

    labels = []
    for ids, choices in zip(generated, workload["choices"]):
        text = decode(list(ids))
        for stop in workload.get("stop") or ():
            text = text.split(stop, 1)[0]
        labels.append(parse_label(text, choices))
    return labels


def label_figures(labels: Sequence[str | None], gold: Sequence[str]) -> dict[str, float]:
    """``names_label`` and ``gold_agreement`` of one system's labels (module doc)."""
    rows = max(len(labels), 1)
    return {
        "names_label": sum(label is not None for label in labels) / rows,
        "gold_agreement": sum(label == g for label, g in zip(labels, gold)) / rows,
    }


def build_records(
    specs: list[SystemSpec],
    raw: dict[str, dict],
    workloads: list[dict],
    eos_ids: set[int],
    *,
    shape: ModelShape | None = None,
    rates: dict[str, Any] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[dict]:
    """One record per (system, workload) the system runs (``systems.runs_on``) with every
    metric, ratios filled in last.

    ``shape`` and ``rates`` (``rate.measure_matmul_rate``) add the work figures
    (``work_figures``); without them those fields are None. ``decode`` (token ids to
    text) adds the label figures on workloads with labels (module doc).
    """
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    labels: dict[tuple[str, str], list[str | None]] = {}
    records = []
    for spec in specs:
        result = raw.get(spec.name, {"error": "not run"})
        runs = {run["workload"]: run for run in result.get("runs", [])}
        for w in workloads:
            if not runs_on(spec, w):
                continue
            summary = w["summary"]
            record: dict[str, Any] = {
                "system": spec.name,
                "workload": w["name"],
                "description": spec.description,
                "status": "ok",
                "error": None,
                "rows": summary["rows"],
                "prompt_tokens": summary["prompt_tokens"],
                "min_prefill_tokens": summary["min_prefill_tokens"],
            }
            run = runs.get(w["name"])
            if "skipped" in result:
                record.update(status="skipped", error=result["skipped"])
                records.append(record)
                continue
            if "error" in result or run is None:
                record.update(status="failed", error=result.get("error", "no result"))
                records.append(record)
                continue
            # With ignore_eos every token counts, EOS included; otherwise trailing EOS goes.
            ends = set() if w.get("ignore_eos") else eos_ids
            generated = [_normalize(ids, ends) for ids in run["token_ids"]]
            outputs[(spec.name, w["name"])] = generated
            seconds = statistics.median(run["seconds"])
            output_tokens = sum(len(ids) for ids in generated)
            record.update(
                load_seconds=result.get("load_seconds"),
                seconds=seconds,
                seconds_all=run["seconds"],
                output_tokens=output_tokens,
                output_tokens_per_second=output_tokens / seconds if seconds else None,
                rows_per_second=summary["rows"] / seconds if seconds else None,
                prefill_tokens_computed=run["prefill_tokens_computed"],
                prefill_vs_min=run["prefill_tokens_computed"] / summary["min_prefill_tokens"],
                peak_rss_bytes=run.get("peak_rss_bytes"),
                peak_device_bytes=run.get("peak_device_bytes"),
                weight_bytes=run.get("weight_bytes"),
                device=result.get("device"),
                dtype=result.get("dtype"),
                torch_threads=result.get("torch_threads"),
                **work_figures(
                    shape,
                    rates,
                    w,
                    generated,
                    prefill_tokens=run["prefill_tokens_computed"],
                    seconds=seconds,
                    dtype=result.get("dtype"),
                ),
            )
            if run.get("decode_profile") is not None:
                record["decode_profile"] = run["decode_profile"]
            if run.get("engine_paths"):
                record["engine_paths"] = run["engine_paths"]
            if decode is not None and w.get("gold") is not None:
                labels[(spec.name, w["name"])] = output_labels(w, generated, decode)
                record.update(label_figures(labels[(spec.name, w["name"])], w["gold"]))
            records.append(record)
    for record in records:
        if record["status"] != "ok":
            continue
        mine = outputs[(record["system"], record["workload"])]
        # against every system on this workload (itself included): the rows with the same
        # output, and the tokens before each row's first difference over the other's tokens
        others = {
            system: theirs
            for (system, workload), theirs in outputs.items()
            if workload == record["workload"]
        }
        record["same_output_as"] = {
            system: sum(a == b for a, b in zip(mine, theirs)) / len(mine)
            for system, theirs in others.items()
        }
        record["agreement_with_hf_static"] = record["same_output_as"].get(BASELINE)
        record["tokens_agreeing_with"] = {
            system: sum(_common_prefix(a, b) for a, b in zip(mine, theirs))
            / max(1, sum(len(b) for b in theirs))
            for system, theirs in others.items()
        }
        for key, reference in (("vs_hf_static", BASELINE), ("vs_vllm", VLLM_REFERENCE)):
            other = next(
                (
                    r
                    for r in records
                    if r["system"] == reference
                    and r["workload"] == record["workload"]
                    and r["status"] == "ok"
                ),
                None,
            )
            record[f"speedup_{key}"] = other["seconds"] / record["seconds"] if other else None
        mine_labels = labels.get((record["system"], record["workload"]))
        if mine_labels is not None:
            record["same_label_as"] = {
                system: sum(a == b for a, b in zip(mine_labels, theirs)) / len(mine_labels)
                for (system, workload), theirs in labels.items()
                if workload == record["workload"] and system != record["system"]
            }
    return records
