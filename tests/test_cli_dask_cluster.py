"""``llm-operator run --engine dask`` on a real Dask cluster: --scheduler, an existing
client, DASK_SCHEDULER_ADDRESS, per-partition log lines forwarded from the workers."""

from __future__ import annotations

import json
import logging

import dask
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_operator.cli import main

distributed = pytest.importorskip("distributed")

TEMPLATE = "Classify the sentiment.\nReview: {text}\nSentiment:"
TEXTS = [
    "Great value for the price.",
    "The box arrived crushed.",
    "Works fine.",
    "Great value for the price.",
    "Too loud at night.",
    "Would buy again.",
]


@pytest.fixture(scope="module")
def cluster():
    """One scheduler and one worker process (the tiny model loads there)."""
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None
    ) as local:
        yield local


@pytest.fixture()
def table(tmp_path):
    path = tmp_path / "reviews.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), path)
    return path


def _run(table, out, model, *extra) -> int:
    return main(
        [
            "run",
            str(table),
            "--template",
            TEMPLATE,
            "--output",
            str(out),
            "--model",
            str(model),
            "--max-tokens",
            "4",
            "--partitions",
            "3",
            *extra,
        ]
    )


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_outputs(a: list[dict], b: list[dict]) -> None:
    assert [r["id"] for r in b] == list(range(len(TEXTS)))
    for key in ("out", "out_finish_reason", "out_completion_tokens", "out_error"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_scheduler_address_runs_on_the_cluster_and_forwards_partition_logs(
    cluster, table, tiny_llama_dir, tmp_path, caplog
):
    local = tmp_path / "local.jsonl"
    assert _run(table, local, tiny_llama_dir, "--no-progress") == 0
    remote = tmp_path / "remote.jsonl"
    with caplog.at_level(logging.INFO, logger="llm_operator.integrations"):
        code = _run(
            table,
            remote,
            tiny_llama_dir,
            "--engine",
            "dask",
            "--scheduler",
            cluster.scheduler_address,
            "--no-progress",
        )
    assert code == 0
    _same_outputs(_rows(local), _rows(remote))
    # the worker process built the engine (the client never did: it has no partition lines
    # of its own), and its per-partition lines came back through forward_logging
    with distributed.Client(cluster.scheduler_address) as client:
        pids = set(client.run(lambda: __import__("os").getpid()).values())
        built = client.run(
            lambda: __import__(
                "llm_operator.integrations.worker", fromlist=["engine_constructions"]
            ).engine_constructions()
        )
    assert list(built.values()) == [1]
    lines = [r for r in caplog.records if "dask partition" in r.getMessage()]
    assert len(lines) == 3, [r.getMessage() for r in lines]
    assert {r.process for r in lines} == pids  # emitted in the worker, shown here


def test_existing_client_and_config_address_are_used(cluster, table, tiny_llama_dir, tmp_path):
    with distributed.Client(cluster.scheduler_address) as client:
        before = sum(client.run(_constructions).values())
        out = tmp_path / "client.jsonl"
        assert _run(table, out, tiny_llama_dir, "--engine", "dask", "--no-progress") == 0
        tasks_after_client = _tasks_run(client)
    with dask.config.set({"scheduler-address": cluster.scheduler_address}):
        out2 = tmp_path / "config.jsonl"
        assert _run(table, out2, tiny_llama_dir, "--engine", "dask") == 0  # with progress
    with distributed.Client(cluster.scheduler_address) as client:
        tasks_after_config = _tasks_run(client)
        after = sum(client.run(_constructions).values())
    assert tasks_after_client > 0 and tasks_after_config > tasks_after_client
    assert after == before or (before == 0 and after == 1)  # one engine per worker, reused
    _same_outputs(_rows(out), _rows(out2))


def _constructions() -> int:
    from llm_operator.integrations.worker import engine_constructions

    return engine_constructions()


def _tasks_run(client) -> int:
    """Tasks the cluster's workers have run so far (the llm_infer partitions among them)."""
    return sum(client.run(lambda dask_worker: dask_worker.state.executed_count).values())


def test_scheduler_errors_name_what_to_do(table, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    code = _run(table, out, tiny_llama_dir, "--engine", "spark", "--scheduler", "tcp://x:1")
    assert code == 2
    assert "--scheduler is for --engine dask" in capsys.readouterr().err
    code = _run(table, out, tiny_llama_dir, "--engine", "dask", "--scheduler", "tcp://127.0.0.1:9")
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in err
    assert "dask scheduler" in err
    assert not out.exists()
