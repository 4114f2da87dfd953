"""Resumable runs: finished rows written atomically as they complete, the rest run later.

``llm-operator run ... --checkpoint DIR`` cuts the input into chunks of
``--checkpoint-rows`` rows. Each finished chunk is written to ``DIR`` as
``part-<first row>-<end row>.jsonl`` (written to a temporary name, flushed to disk, then
renamed: a part either exists whole or not at all), its records carrying their row ids.
After a crash or a ``kill -9``, the same command reads the parts back, runs only the
missing chunks and assembles the output in input order; every row is checked to be
answered exactly once. ``DIR/job.json`` holds a fingerprint of the job (model, options,
prompts, chunking): a different job refuses the folder instead of mixing outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_operator.results import GenerationResult

JOB_FILE = "job.json"
# options that do not change any output
_NOT_IN_FINGERPRINT = ("progress",)


def fingerprint(model: str, options: Mapping[str, Any], prompts: Sequence[Any]) -> str:
    """A hash of what decides the outputs: the model, the options and every prompt."""
    digest = hashlib.sha256()
    kept = {k: v for k, v in sorted(options.items()) if k not in _NOT_IN_FINGERPRINT}
    digest.update(json.dumps([str(model), kept], default=repr, sort_keys=True).encode())
    for prompt in prompts:
        text = json.dumps(prompt, default=repr, ensure_ascii=True)
        digest.update(text.encode("utf-8", "surrogatepass") + b"\n")
    return digest.hexdigest()


class Checkpoint:
    """The parts of one job in ``folder``."""

    def __init__(self, folder: str | Path, *, job: str, rows: int, chunk_rows: int) -> None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"checkpoint rows per chunk must be an int >= 1, got {chunk_rows!r}")
        self.folder = Path(folder)
        self.rows, self.chunk_rows = rows, chunk_rows
        description = {"job": job, "rows": rows, "chunk_rows": chunk_rows}
        self.folder.mkdir(parents=True, exist_ok=True)
        job_file = self.folder / JOB_FILE
        if job_file.exists():
            found = json.loads(job_file.read_text())
            if found != description:
                raise ValueError(
                    f"checkpoint folder {str(self.folder)!r} belongs to another job (its model, "
                    "options, input or --checkpoint-rows differ); use a new folder or remove it"
                )
        else:
            _write_atomically(job_file, json.dumps(description))

    def chunks(self) -> list[tuple[int, int]]:
        return [
            (start, min(start + self.chunk_rows, self.rows))
            for start in range(0, self.rows, self.chunk_rows)
        ]

    def _part(self, start: int, end: int) -> Path:
        return self.folder / f"part-{start:010d}-{end:010d}.jsonl"

    def missing(self) -> list[tuple[int, int]]:
        """The chunks with no finished part yet."""
        return [(s, e) for s, e in self.chunks() if not self._part(s, e).exists()]

    def save(
        self,
        start: int,
        end: int,
        results: Sequence[GenerationResult],
        computed: Sequence[float] | None = None,
    ) -> None:
        """Write the chunk's part; ``computed``: what the engine computed for it (prefill
        tokens, output tokens, generate seconds; None where the workers kept it), written
        first, so that a part never exists without it."""
        assert len(results) == end - start, f"chunk {start}-{end}: {len(results)} results"
        stats = self._stats(start, end)
        if computed is not None:  # a model server's counts (a 4th item) flattened
            flat = [*computed[:3], *(computed[3] if len(computed) > 3 else ())]
            _write_atomically(stats, json.dumps(flat))
        elif stats.exists():  # from an attempt that did not finish: not this part's
            stats.unlink()
        lines = [
            json.dumps({"row": start + i, **r._asdict()}, ensure_ascii=True) + "\n"
            for i, r in enumerate(results)
        ]
        _write_atomically(self._part(start, end), "".join(lines))

    def _stats(self, start: int, end: int) -> Path:
        return self.folder / f"stats-{start:010d}-{end:010d}.json"

    def computed(self) -> tuple[int, int, float, tuple[int, ...]] | None:
        """Prefill tokens, output tokens, generate seconds and a model server's (prompt,
        cached, output) tokens summed over every finished chunk (of this run and earlier
        ones), or None when a chunk's are unknown."""
        totals = [0, 0, 0.0, 0, 0, 0]
        for start, end in self.chunks():
            stats = self._stats(start, end)
            if not (self._part(start, end).exists() and stats.exists()):
                return None
            for i, value in enumerate(json.loads(stats.read_text())):
                totals[i] += value
        return int(totals[0]), int(totals[1]), float(totals[2]), tuple(map(int, totals[3:]))

    def results(self) -> list[GenerationResult]:
        """Every row's result, in input order, from the parts (all chunks must be done)."""
        missing = self.missing()
        assert not missing, f"chunks {missing[:5]} are not done"
        results: list[GenerationResult | None] = [None] * self.rows
        for start, end in self.chunks():
            for line in self._part(start, end).read_text().splitlines():
                record = json.loads(line)
                row = record.pop("row")
                assert start <= row < end and results[row] is None, f"row {row} answered twice"
                record["token_ids"] = tuple(record["token_ids"])
                results[row] = GenerationResult(**record)
        lost = [row for row, r in enumerate(results) if r is None]
        assert not lost, f"rows {lost[:10]} have no result in the checkpoint"
        return results


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
