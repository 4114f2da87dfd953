"""The bundled demo job: product reviews and support tickets to classify.

The data lives in ``examples/data`` of the source checkout, beside the
``llm_operator`` package (``reviews.jsonl``, ``tickets.jsonl`` and ``tasks.json``),
or in any directory passed as ``data_dir``.

Each task in ``tasks.json`` has a system prompt, instructions, few-shot examples
and a per-row template such as ``"Review: {text}\\nSentiment:"``. The template's
last line is the answer cue; it must hold no placeholders. A few-shot example's
``input`` is written in the shape of the rendered template without that last
line, and the example is shown as ``input + "\\n" + cue + " " + label``.

Every row's prompt, as plain text (system, ``task.user_prefix``, then
``task.render(row)``) or as chat messages (the system message and the few-shot
turns, then the row), starts with a part byte-identical across the rows of its
task, so the prompts of one task share their token prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import zip_longest
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_DATA_DIR",
    "DemoTask",
    "build_demo_rows",
    "gold_label",
    "load_rows",
    "load_tasks",
    "parse_label",
]

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "examples" / "data"
"""Where the demo data lives in a source checkout."""

TASKS_FILE = "tasks.json"
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


@dataclass(frozen=True)
class DemoTask:
    """One classification task over the rows of one source file."""

    name: str
    source: str
    labels: tuple[str, ...]
    system: str
    instructions: str
    examples: tuple[tuple[str, str], ...]
    template: str

    @property
    def answer_cue(self) -> str:
        """The template's last line (e.g. ``"Sentiment:"``), after which the label goes."""
        return self.template.rsplit("\n", 1)[-1]

    @property
    def user_prefix(self) -> str:
        """The part of the user message shared by every row: instructions and examples."""
        shots = "\n\n".join(
            f"{example}\n{self.answer_cue} {label}" for example, label in self.examples
        )
        return f"{self.instructions}\n\nExamples:\n\n{shots}\n\n"

    @property
    def prompt_prefix(self) -> str:
        """The part of the plain-text prompt shared by every row (system + user prefix)."""
        return f"{self.system}\n\n{self.user_prefix}"

    def render(self, row: Mapping[str, Any]) -> str:
        """The per-row part of the user message: the template filled with ``row``'s fields."""
        try:
            return self.template.format_map(row)
        except KeyError as exc:
            raise ValueError(
                f"task {self.name!r}: row {row.get('id', '?')!r} has no field {exc.args[0]!r} "
                f"needed by the template {self.template!r}"
            ) from None


def _data_file(data_dir: Path | str | None, name: str) -> Path:
    """A file of the demo data directory, checked (and the directory) to exist."""
    directory = DEFAULT_DATA_DIR if data_dir is None else Path(data_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"demo data directory not found: {directory} (the bundled data lives in "
            "examples/data of the llm-operator source checkout; pass data_dir=... to use "
            "another directory)"
        )
    path = directory / name
    if not path.is_file():
        present = ", ".join(sorted(p.name for p in directory.iterdir() if p.is_file()))
        raise FileNotFoundError(
            f"demo data file not found: {path} (files in {directory}: {present or 'none'})"
        )
    return path


def _task_from_json(entry: Mapping[str, Any]) -> DemoTask:
    """Build and check one task of ``tasks.json``."""
    missing = [field.name for field in fields(DemoTask) if field.name not in entry]
    if missing:
        raise ValueError(f"task {entry.get('name', '?')!r} lacks {', '.join(missing)}")
    text = {k: str(entry[k]) for k in ("name", "source", "system", "instructions", "template")}
    labels = tuple(str(label) for label in entry["labels"])
    examples = tuple((str(ex["input"]), str(ex["label"])) for ex in entry["examples"])
    task = DemoTask(**text, labels=labels, examples=examples)
    if not task.labels:
        raise ValueError(f"task {task.name!r} has no labels")
    if "\n" not in task.template or _PLACEHOLDER.search(task.answer_cue):
        raise ValueError(
            f"task {task.name!r}: the template's last line must be a plain answer cue, "
            f"got {task.template!r}"
        )
    for _, label in task.examples:
        if label not in task.labels:
            raise ValueError(f"task {task.name!r}: example label {label!r} is not in {task.labels}")
    return task


def load_tasks(data_dir: Path | None = None) -> list[DemoTask]:
    """The tasks of ``tasks.json``, in file order.

    Raises FileNotFoundError if the directory or file is missing and ValueError
    if a task is malformed or two tasks share a name.
    """
    path = _data_file(data_dir, TASKS_FILE)
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of tasks")
    tasks = [_task_from_json(entry) for entry in entries]
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate task names in {names}")
    return tasks


def load_rows(source: str, data_dir: Path | None = None) -> list[dict]:
    """The rows of ``<source>.jsonl`` (e.g. ``"reviews"``), in file order."""
    if not _SOURCE_NAME.fullmatch(source):
        raise ValueError(f"invalid source name {source!r}")
    path = _data_file(data_dir, f"{source}.jsonl")
    rows: list[dict] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    return rows


def _few_shot_messages(task: DemoTask) -> list[dict[str, str]]:
    """System prompt with the instructions, then each example as a user/assistant turn."""
    messages = [{"role": "system", "content": f"{task.system}\n\n{task.instructions}"}]
    for example, label in task.examples:
        messages.append({"role": "user", "content": f"{example}\n{task.answer_cue}"})
        messages.append({"role": "assistant", "content": label})
    return messages


def gold_label(task: DemoTask, row: Mapping[str, Any]) -> str | None:
    """The label a row's own fields imply, where they imply one (None otherwise):
    review-sentiment from the star rating (4-5 positive, 3 neutral, 1-2 negative),
    review-category from the product category."""
    if task.name == "review-sentiment" and isinstance(row.get("rating"), int):
        rating = row["rating"]
        return "positive" if rating >= 4 else "neutral" if rating == 3 else "negative"
    if task.name == "review-category" and row.get("category") in task.labels:
        return row["category"]
    return None


def _demo_row(task: DemoTask, row: Mapping[str, Any]) -> dict:
    """One row of the demo job: ``row`` rendered for ``task``."""
    per_row = task.render(row)
    return {
        "id": str(row["id"]),
        "task": task.name,
        "input": per_row,
        "messages": [*_few_shot_messages(task), {"role": "user", "content": per_row}],
        "prompt": task.prompt_prefix + per_row,
        "labels": list(task.labels),
        "gold": gold_label(task, row),
    }


def build_demo_rows(data_dir: Path | None = None, *, limit: int | None = None) -> list[dict]:
    """The demo job: every data row once, classified by one task of its source.

    The rows of a source take that source's tasks in turn (row 0 the first
    task, row 1 the second, ...), and the sources are interleaved row by row
    (review, ticket, review, ticket, ...), so the order is deterministic but not
    grouped by task: finding the shared prefixes is left to the planner.

    Each returned dict has ``id``, ``task``, ``input`` (the rendered per-row
    part, which both ``messages[-1]["content"]`` and ``prompt`` end with),
    ``messages`` (a system message with the instructions, the few-shot examples
    as user/assistant turns, then the row as the last user message), ``prompt``
    (plain text: system, a blank line, instructions, examples, then the row),
    ``labels`` and ``gold`` (see ``gold_label``).
    ``limit`` keeps only the first ``limit`` rows.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    tasks = load_tasks(data_dir)
    by_source: dict[str, list[DemoTask]] = {}
    for task in tasks:
        by_source.setdefault(task.source, []).append(task)
    streams = []
    for source, source_tasks in by_source.items():
        rows = load_rows(source, data_dir)
        streams.append(
            [_demo_row(source_tasks[i % len(source_tasks)], row) for i, row in enumerate(rows)]
        )
    demo = [row for rows in zip_longest(*streams) for row in rows if row is not None]
    return demo if limit is None else demo[:limit]


def parse_label(text: str, labels: Sequence[str]) -> str | None:
    """The allowed label that occurs first in a model's output, else None.

    Matching ignores case and needs whole words: a hyphen counts as part of a
    word, so ``"non-negative"`` matches neither ``negative`` nor anything else
    and ``"lower"`` does not match ``low``. When two labels start at the same
    place the longer wins. The label is returned as spelled in ``labels``.
    """
    found = []  # (where, -length, label) of each label that occurs
    for label in filter(None, labels):
        pattern = rf"(?<![\w-]){re.escape(label)}(?![\w-])"
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match is not None:
            found.append((match.start(), -len(label), label))
    return min(found, key=lambda key: key[:2])[2] if found else None
