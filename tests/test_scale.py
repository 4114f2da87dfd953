"""The scale benchmark's parts, small (``make scale`` runs them at 25k-100k rows and the
planner at 1M prompts): the memory sampler sees a process tree and names its kinds; the
Spark and Dask jobs write every row exactly once (checked by aggregates over the Parquet
they wrote, nothing collected)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from llm_operator_bench.suites import scale

ROWS = 2000


def test_prompts_are_short_and_shared():
    prompts = [scale.prompt_text(row) for row in range(ROWS)]
    assert len(set(prompts)) == ROWS  # unique rows (review number x two words)
    assert all(len(p) < 80 for p in prompts)
    assert len({p.split(" review ")[0] for p in prompts}) == len(scale.INSTRUCTIONS)


def test_memory_sampler_sees_the_process_tree(tmp_path):
    pytest.importorskip("psutil")
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            f"""
            import json, multiprocessing, time

            def worker():
                block = bytearray(160 << 20)  # touched: resident
                time.sleep(1.5)

            if __name__ == "__main__":
                block = bytearray(96 << 20)
                process = multiprocessing.get_context("spawn").Process(target=worker)
                process.start()
                process.join()
                print({scale.RESULT_PREFIX!r} + json.dumps({{"ok": True}}))
            """
        )
    )
    result, memory, seconds = scale.run_sampled([sys.executable, str(child)], interval=0.1)
    assert result == {"ok": True}
    assert memory["samples"] >= 5
    assert memory["driver"]["processes"] == 1
    assert memory["driver"]["max_one_mib"] >= 96
    assert memory["python_worker"]["processes"] == 1  # the spawned process
    assert memory["python_worker"]["max_one_mib"] >= 160
    assert memory["tree_mib"] >= 96 + 160
    timeline = memory["timeline"]  # [seconds, driver, largest JVM, largest Python worker]
    assert 1 <= len(timeline) <= 40 and max(row[3] for row in timeline) >= 160


def test_run_sampled_reports_a_failed_child(tmp_path):
    pytest.importorskip("psutil")
    with pytest.raises(RuntimeError, match="exit 3"):
        scale.run_sampled([sys.executable, "-c", "import sys; sys.exit(3)"])


def _assert_complete(result: dict) -> None:
    assert result["rows_lost"] == 0 and result["rows_duplicated"] == 0, result
    assert result["written_rows"] == ROWS and result["written_distinct_ids"] == ROWS
    assert (result["written_min_id"], result["written_max_id"]) == (0, ROWS - 1)
    assert result["written_error_rows"] == 0 and result["written_null_outputs"] == 0
    assert result["written_output_tokens"] == ROWS  # max_tokens=1 (no row stops early)


def test_spark_job_writes_every_row_once(spark, tiny_llama_dir, tmp_path):
    result = scale.spark_job(spark, str(tiny_llama_dir), ROWS, 4, tmp_path, max_tokens=1)
    _assert_complete(result)


def test_dask_job_writes_every_row_once(tiny_llama_dir, tmp_path):
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        result = scale.dask_job(client, str(tiny_llama_dir), ROWS, 4, tmp_path, max_tokens=1)
    _assert_complete(result)
