"""bench.testing.model_server without vLLM: the Prometheus parser, the command line, and a server's
life (start, readiness, metrics, failure, close of its process group) with a stand-in
"python" whose ``-m vllm...`` runs a tiny stdlib server. The real server is exercised where
vLLM is installed, by the OpenAI-backend tests."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from llm_operator_bench.testing import model_server
from llm_operator_bench.testing.model_server import (
    parse_prometheus,
    sample_labels,
    server_command,
    server_environment,
    start_vllm_server,
)

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="model"} 140.0
vllm:prefix_cache_queries_total{engine="1",model_name="model"} 60.0
vllm:prefix_cache_hits_total{engine="0",model_name="model"} 64.0
vllm:prompt_tokens_total{engine="0",model_name="model"} 148.0
vllm:generation_tokens_total{engine="0",model_name="model"} 11.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="model"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="model"} 3.0
vllm:odd{label="a \\"quoted\\" b"} NaN
"""

# What the stand-in runs for `-m vllm.entrypoints.openai.api_server ...`: FAKE_MODE
# "serve" answers /health (after FAKE_DELAY seconds), /metrics and nothing else, with a
# child process in its group (as vLLM's engine core); "fail" prints and exits 3;
# "hang" never listens.
FAKE_SERVER = r"""
import http.server, os, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
print("fake vllm", " ".join(args), flush=True)
mode = os.environ.get("FAKE_MODE", "serve")
if mode == "fail":
    print("ValueError: the model is broken", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["FAKE_CHILD_FILE"], "w").write(str(child.pid))
if mode == "hang":
    time.sleep(600)
time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
METRICS = os.environ["FAKE_METRICS"].encode()

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        body = {"/health": b"", "/metrics": METRICS}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    server = tmp_path / "fake_vllm.py"
    server.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then exit 0; fi\n'  # find_vllm_python's probe: "has vllm"
        "shift 2\n"  # -m vllm.entrypoints.openai.api_server
        f'exec {sys.executable} {server} "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_METRICS", METRICS)
    monkeypatch.setenv("FAKE_CHILD_FILE", str(tmp_path / "child.pid"))
    monkeypatch.setattr(model_server, "POLL_SECONDS", 0.05)
    return python


def _gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie child of ours counts as gone
        status = Path(f"/proc/{pid}/stat")
        if status.exists() and status.read_text().split(")")[-1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_parse_prometheus() -> None:
    summed = parse_prometheus(METRICS)
    assert summed["vllm:prefix_cache_queries_total"] == 200.0  # over both engines
    assert summed["vllm:request_success_total"] == 5.0
    assert "vllm:odd" not in summed  # NaN
    samples = parse_prometheus(METRICS, labels=True)
    key = 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="model"}'
    assert samples[key] == 2.0
    assert sample_labels(key) == {"engine": "0", "finished_reason": "stop", "model_name": "model"}
    assert sample_labels('vllm:odd{label="a \\"quoted\\" b"}') == {"label": 'a \\"quoted\\" b'}


def test_server_command_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    command = server_command(
        "py", "/m", port=1234, kv_cache_bytes=1 << 20, block_size=32, max_model_len=256
    )
    assert command[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (
        "--model /m", "--served-model-name model", "--host 127.0.0.1", "--port 1234",
        "--dtype float32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enforce-eager", "--kv-cache-memory-bytes 1048576", "--block-size 32",
        "--max-model-len 256",
    ):  # fmt: skip
        assert part in joined, part
    plain = server_command("py", "/m", port=1, enforce_eager=False, prefix_caching=False)
    assert "--no-enable-prefix-caching" in plain and "--enforce-eager" not in plain
    assert "--max-num-seqs" not in plain and "--kv-cache-memory-bytes" not in plain

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    env = server_environment(None, kv_cache_bytes=1 << 20, dev_mode=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    assert env["HF_HUB_OFFLINE"] == "0"  # the caller's wins
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    kept = server_environment({"VLLM_CPU_KVCACHE_SPACE": "2"}, kv_cache_bytes=1, dev_mode=False)
    assert kept["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_SERVER_DEV_MODE" not in kept
    assert (
        server_environment(None, kv_cache_bytes=None, dev_mode=False)["VLLM_CPU_KVCACHE_SPACE"]
        == "4"
    )


def test_server_life(fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_DELAY", "0.5")
    with start_vllm_server(tmp_path, python=str(fake_python), served_model_name="m") as server:
        assert server.startup_seconds is not None and server.startup_seconds >= 0.4
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        assert server.model_name == "m" and server.alive() and server.healthy()
        assert server.prefix_cache() == {
            "queries": 200.0, "hits": 64.0, "hit_rate": 0.32,
            "prompt_tokens": 148.0, "generation_tokens": 11.0,
        }  # fmt: skip
        assert server.metrics()["vllm:request_success_total"] == 5.0
        assert "--served-model-name m" in server.log_path.read_text()
        log = server.log_path
        child = int((tmp_path / "child.pid").read_text())
    assert _gone(server.pid) and _gone(child)  # the whole process group
    assert not log.exists()  # a temporary log goes with a clean close
    server.close()  # twice is fine


def test_start_failures(fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        start_vllm_server(tmp_path / "missing", python=str(fake_python))
    monkeypatch.setenv("FAKE_MODE", "fail")
    with pytest.raises(RuntimeError, match="exited with status 3(.|\n)*the model is broken"):
        start_vllm_server(tmp_path, python=str(fake_python))
    monkeypatch.setenv("FAKE_MODE", "hang")
    log = tmp_path / "server.log"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready after 1 s(.|\n)*fake vllm"):
        start_vllm_server(tmp_path, python=str(fake_python), startup_timeout=1, log_path=log)
    assert time.monotonic() - start < 8
    assert _gone(int((tmp_path / "child.pid").read_text()))  # ended with its group
    assert log.exists()


def test_close_kills_what_ignores_sigterm(fake_python: Path, tmp_path: Path) -> None:
    server = start_vllm_server(tmp_path, python=str(fake_python))
    child = int((tmp_path / "child.pid").read_text())
    os.kill(server.pid, signal.SIGSTOP)  # a stopped process does not act on SIGTERM
    start = time.monotonic()
    server.close(grace=0.5)
    assert _gone(server.pid) and _gone(child)
    assert time.monotonic() - start < 5
