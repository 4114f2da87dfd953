"""What ``llm-operator bench`` knows: its workloads and systems, one entry each, for
``llm-operator bench --help``. Imports neither torch nor the benchmark runner."""

from __future__ import annotations

import textwrap

from llm_operator_bench.core.systems import BASELINE, SYSTEMS
from llm_operator_bench.core.workloads import WORKLOAD_NAMES, WORKLOAD_SUMMARIES


def catalog_text(width: int = 100) -> str:
    """The workloads and the systems, each name with its description (wrapped at ``width``)."""
    workloads = [(name, WORKLOAD_SUMMARIES.get(name, "")) for name in WORKLOAD_NAMES]
    systems = [(name, spec.description) for name, spec in SYSTEMS.items()]
    need_vllm = [s.name for s in SYSTEMS.values() if s.kind == "vllm" or s.python == "vllm"]
    note = (
        f"{', '.join(need_vllm)} run with the python of a venv that has vLLM (--vllm-python, "
        "default .venv-vllm); without one they are not measured."
    )
    return "\n".join(
        [
            "workloads (--workloads: comma-separated names, or 'all'; default: all but classify):",
            *_entries(workloads, width),
            "",
            f"systems (--systems: comma-separated names, or 'all', the default; "
            f"baseline {BASELINE}):",
            *_entries(systems, width),
            "",
            textwrap.fill(note, width=width, break_on_hyphens=False, break_long_words=False),
        ]
    )


def _entries(items: list[tuple[str, str]], width: int) -> list[str]:
    column = max(len(name) for name, _ in items) + 4
    lines = []
    for name, description in items:
        head = f"  {name}".ljust(column)
        if not description:
            lines.append(head.rstrip())
            continue
        lines.append(
            textwrap.fill(
                description,
                width=max(width, column + 20),
                initial_indent=head,
                subsequent_indent=" " * column,
                break_on_hyphens=False,
            )
        )
    return lines
