"""The benchmark's human-readable outputs: a Markdown table and a PNG chart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_operator_bench.core.rate import RATE_DTYPES, describe_rate

DECODE_TABLE_WORKLOADS = ("long-answers",)


def _number(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _figure(value: float | None) -> str:
    """Three significant digits below 100, whole numbers with separators above."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def machine_header(machine: dict[str, Any], title: str | None = None) -> list[str]:
    """The report's opening lines: the machine and its measured matmul rate."""
    rates = machine.get("matmul_rate")
    lines = [f"# {title}", ""] if title else []
    where = machine.get("gpu") or machine.get("cpu") or "unknown machine"
    lines.append(
        f"Machine: {where}, {machine.get('cpu_count')} CPUs, torch {machine.get('torch')} "
        f"({machine.get('torch_threads')} threads)."
    )
    if rates:
        measured = {key: rates[key] for key in RATE_DTYPES if key in rates}
        lines.append(
            f"Matmul rate (torch linear on the model's qkv, o_proj, gate_up and down shapes, "
            f"M={rates['tokens']} tokens, {rates['threads']} threads, {rates['device']}, "
            f"median): {describe_rate(measured)}. `GFLOP` is each run's work (prefill tokens "
            "x per-token FLOP + output tokens x (per-token + output-head FLOP)), `% rate` its "
            "GFLOP/s over the rate of the system's dtype."
        )
    else:
        lines.append("Matmul rate: not measured (no Llama-family model shape).")
    return [*lines, ""]


def decode_table(records: Sequence[dict], workload: str) -> list[str]:
    """The "decode ms per iteration vs batch size" table of the systems that profiled it."""
    profiled = [
        r
        for r in records
        if r["workload"] == workload and r["status"] == "ok" and r.get("decode_profile")
    ]
    if not profiled:
        return []
    medians = {
        r["system"]: {b["rows"]: b for b in r["decode_profile"]["by_batch"]} for r in profiled
    }
    batches = sorted({rows for by in medians.values() for rows in by})
    lines = [
        f"Decode ms per iteration vs batch size ({workload}; median over decode-only "
        "iterations, their count in brackets):",
        "",
        "| batch | " + " | ".join(medians) + " |",
        "|---:|" + "---:|" * len(medians),
    ]
    for rows in batches:
        cells = [
            f"{by[rows]['median_ms']:.1f} ({by[rows]['iterations']})" if rows in by else "-"
            for by in medians.values()
        ]
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def labels_table(records: Sequence[dict], workload: str) -> list[str]:
    """The label figures of a workload with labels (``bench.core.records``): rows/s, outputs
    that name a label, agreement with the gold labels and between systems."""
    labelled = [
        r
        for r in records
        if r["workload"] == workload and r["status"] == "ok" and "gold_agreement" in r
    ]
    if not labelled:
        return []
    systems = [r["system"] for r in labelled]
    lines = [
        f"Labels ({workload}): each output read as one of its row's labels; gold is the label "
        "its input was written for; `same label as X`: rows where both systems read as the "
        "same label.",
        "",
        "| system | rows/s | names a label | agrees with gold | "
        + " | ".join(f"same label as {s}" for s in systems)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(systems),
    ]
    for r in labelled:
        same = r.get("same_label_as", {})
        cells = ["-" if s == r["system"] else _percent(same.get(s)) for s in systems]
        lines.append(
            f"| {r['system']} | {_number(r['rows_per_second'], 2)} "
            f"| {_percent(r['names_label'])} | {_percent(r['gold_agreement'])} | "
            + " | ".join(cells)
            + " |"
        )
    return [*lines, ""]


def markdown_table(
    records: Sequence[dict],
    workloads: Sequence[dict],
    *,
    machine: dict[str, Any] | None = None,
    title: str | None = None,
) -> str:
    """One table per workload: a row per system with every metric and the two ratios,
    under ``machine_header`` when ``machine`` is given; for the decode-heavy workloads
    (DECODE_TABLE_WORKLOADS) a ``decode_table`` follows, for workloads with labels a
    ``labels_table``."""
    lines: list[str] = machine_header(machine, title) if machine is not None else []
    for workload in workloads:
        s = workload["summary"]
        lines += [
            f"### {workload['name']}",
            "",
            f"{workload['description'].rstrip('.')}. {s['rows']} rows, {s['prompt_tokens']:,} prompt tokens "
            f"(minimum prefill {s['min_prefill_tokens']:,}), {s['max_tokens_total']:,} max "
            f"output tokens."
            + (
                f" Free generation stops at {' or '.join(map(repr, s['stop']))}."
                if s.get("stop")
                else ""
            ),
            "",
            "| system | gen s | load s | out tok/s | rows/s | prefill tokens | vs min "
            "| GFLOP | GFLOP/s | % rate | peak MiB | same as hf-static | x hf-static | x vllm |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in records:
            if r["workload"] != workload["name"]:
                continue
            if r["status"] != "ok":
                reason = (r["error"] or "").splitlines()[0][:100]
                lines.append(f"| {r['system']} | {r['status']}: {reason} " + "|" * 13 + " ")
                continue
            agreement = r.get("agreement_with_hf_static")
            peak = r.get("peak_device_bytes") or r.get("peak_rss_bytes")
            lines.append(
                f"| {r['system']} | {r['seconds']:.3g} | {_number(r.get('load_seconds'))} "
                f"| {_number(r['output_tokens_per_second'])} | {_number(r['rows_per_second'], 2)} "
                f"| {r['prefill_tokens_computed']:,} | {r['prefill_vs_min']:.2f}x "
                f"| {_figure(r.get('work_gflop'))} | {_figure(r.get('gflop_per_second'))} "
                f"| {_percent(r.get('rate_fraction'))} | {_mib(peak)} "
                f"| {'-' if agreement is None else f'{agreement:.0%}'} "
                f"| {_number(r.get('speedup_vs_hf_static'), 2, 'x')} "
                f"| {_number(r.get('speedup_vs_vllm'), 2, 'x')} |"
            )
        lines.append("")
        if workload["name"] in DECODE_TABLE_WORKLOADS:
            lines += decode_table(records, workload["name"])
        lines += labels_table(records, workload["name"])
    return "\n".join(lines)


def write_chart(records: Sequence[dict], workloads: Sequence[dict], path: Path, title: str) -> bool:
    """Two panels (generation seconds; prefill tokens over the minimum), grouped by workload.
    Returns False when matplotlib is missing (``pip install 'llm-operator[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = list(dict.fromkeys(r["system"] for r in records if r["status"] == "ok"))
    names = [w["name"] for w in workloads]
    if not systems:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(names) * 2), 5))
    width = 0.8 / len(systems)
    panels = (
        ("seconds", "generation seconds (log; lower is better)", True),
        ("prefill_vs_min", "prefill tokens computed / minimum", False),
    )
    for axis, (key, label, log) in zip(axes, panels):
        for index, system in enumerate(systems):
            values = []
            for name in names:
                record = next(
                    (
                        r
                        for r in records
                        if r["system"] == system and r["workload"] == name and r["status"] == "ok"
                    ),
                    None,
                )
                values.append(record[key] if record else 0.0)
            positions = [i + (index - (len(systems) - 1) / 2) * width for i in range(len(names))]
            axis.bar(positions, values, width, label=system)
        axis.set_xticks(range(len(names)), names)
        axis.set_ylabel(label)
        if log:
            axis.set_yscale("log")
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
