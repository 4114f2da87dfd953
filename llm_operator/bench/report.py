"""The benchmark's human-readable outputs: a Markdown table and a PNG chart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _number(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def markdown_table(records: Sequence[dict], workloads: Sequence[dict]) -> str:
    """One table per workload: a row per system with every metric and the two ratios."""
    lines: list[str] = []
    for workload in workloads:
        s = workload["summary"]
        lines += [
            f"### {workload['name']}",
            "",
            f"{workload['description'].rstrip('.')}. {s['rows']} rows, {s['prompt_tokens']:,} prompt tokens "
            f"(minimum prefill {s['min_prefill_tokens']:,}), {s['max_tokens_total']:,} max "
            f"output tokens.",
            "",
            "| system | gen s | load s | out tok/s | rows/s | prefill tokens | vs min "
            "| peak MiB | same as hf-static | x hf-static | x vllm |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in records:
            if r["workload"] != workload["name"]:
                continue
            if r["status"] != "ok":
                reason = (r["error"] or "").splitlines()[0][:100]
                lines.append(f"| {r['system']} | {r['status']}: {reason} |||||||||| ")
                continue
            agreement = r.get("agreement_with_hf_static")
            peak = r.get("peak_device_bytes") or r.get("peak_rss_bytes")
            lines.append(
                f"| {r['system']} | {r['seconds']:.3g} | {_number(r.get('load_seconds'))} "
                f"| {_number(r['output_tokens_per_second'])} | {_number(r['rows_per_second'], 2)} "
                f"| {r['prefill_tokens_computed']:,} | {r['prefill_vs_min']:.2f}x | {_mib(peak)} "
                f"| {'-' if agreement is None else f'{agreement:.0%}'} "
                f"| {_number(r.get('speedup_vs_hf_static'), 2, 'x')} "
                f"| {_number(r.get('speedup_vs_vllm'), 2, 'x')} |"
            )
        lines.append("")
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
