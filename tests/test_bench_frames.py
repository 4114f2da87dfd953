"""``llm-operator bench frames`` on a small Dask frame: both modes of every shape run,
every row comes back, and the figures say what co-location did."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("distributed")

from llm_operator_bench.suites.frames import run_frames  # noqa: E402


def test_frames_bench_runs_both_modes_and_reports_co_location(tmp_path):
    report = run_frames(
        rows=[320],
        partitions=[4],
        engines=["dask"],
        shapes=["shuffled", "no-sharing"],
        smollm2=False,
        out=tmp_path,
        name="frames",
        repeat=2,
    )
    runs = report["runs"]
    assert len(runs) == 2 * 2 * 2  # shapes x attempts x modes, the modes alternating
    assert [run["mode"] for run in runs[:4]] == ["default", "co_locate=False"] * 2
    by = {(run["shape"], run["mode"], run["attempt"]): run for run in runs}
    for attempt in (0, 1):
        moved = by["shuffled", "default", attempt]
        kept = by["shuffled", "co_locate=False", attempt]
        assert moved["co_location"] == "moved" and kept["co_location"] == "off"
        assert moved["prefill_tokens"] < 0.8 * kept["prefill_tokens"]
        skipped = by["no-sharing", "default", attempt]
        assert skipped["co_location"] == "skipped" and skipped["co_location_seconds"] > 0
        assert (
            skipped["prefill_tokens"]
            == by["no-sharing", "co_locate=False", attempt]["prefill_tokens"]
        )
    assert all(run["error_rows"] == 0 and run["rows"] == 320 for run in runs)
    assert json.loads((tmp_path / "frames.json").read_text()) == report
    table = (tmp_path / "frames.md").read_text().splitlines()
    assert len(table) == 2 + 2 and "| moved, " in table[2] and "| skipped, " in table[3]
