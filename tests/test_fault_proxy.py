"""bench.testing.fault_proxy: forwarding, each injected fault as an httpx client sees it, fail_once,
concurrency. The upstream is a tiny in-process HTTP server echoing requests as JSON."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from llm_operator_bench.testing.fault_proxy import FaultProxy, fail_once, request_key

METRICS_TEXT = "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 3.0\n"


PEER_CLOSED: dict[str, bool] = {}


def _peer_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except OSError:
        return True  # reset
    finally:
        sock.setblocking(True)


class EchoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers
    disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms stalls

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, METRICS_TEXT.encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            body = {"object": "list", "data": [{"id": "model", "owned_by": "echo"}]}
            self._send(200, json.dumps(body).encode(), "application/json")
        else:
            self._send(404, b'{"error": "not found"}', "application/json")

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"raw": raw.decode("latin-1")}
        if body.get("status"):  # answer as told: the proxy passes status and headers through
            self._send(int(body["status"]), b'{"told": true}', "application/json", X_Echo="told")
            return
        time.sleep(float(body.get("sleep", 0)))
        if body.get("probe"):  # did the proxy give up on this request meanwhile?
            PEER_CLOSED[body["probe"]] = _peer_closed(self.connection)
        answer = {
            "path": self.path,
            "echo": body,
            "x_test": self.headers.get("X-Test"),
            "choices": [{"index": 0, "text": str(body.get("prompt"))}],
        }
        self._send(200, json.dumps(answer).encode(), "application/json", X_Upstream="echo")


class EchoServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # listen backlog: 64 connections at once


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = EchoServer(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _completion(client: httpx.Client, proxy: FaultProxy, prompt, **extra) -> httpx.Response:
    return client.post(
        f"{proxy.base_url}/completions", json={"model": "model", "prompt": prompt, **extra}
    )


def test_forwards_requests_and_answers(upstream: str) -> None:
    with FaultProxy(upstream + "/v1") as proxy, httpx.Client(timeout=5) as client:
        assert proxy.base_url == f"http://127.0.0.1:{proxy.port}/v1" and proxy.port > 0
        response = _completion(client, proxy, [1, 2, 3], max_tokens=2, headers_ignored=None)
        assert response.status_code == 200
        assert response.headers["x-upstream"] == "echo"
        assert response.json()["echo"]["prompt"] == [1, 2, 3]
        assert response.json()["path"] == "/v1/completions"
        sent = client.post(
            f"{proxy.base_url}/chat/completions?x=1",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Test": "kept"},
        )
        assert sent.json()["path"] == "/v1/chat/completions?x=1"
        assert sent.json()["x_test"] == "kept"
        told = _completion(client, proxy, "p", status=418)
        assert told.status_code == 418 and told.headers["x-echo"] == "told"
        assert told.json() == {"told": True}
        # GETs pass through, uncounted
        models = client.get(f"{proxy.base_url}/models")
        assert models.json()["data"][0]["owned_by"] == "echo"
        metrics = client.get(f"{proxy.url}/metrics")
        assert metrics.text == METRICS_TEXT
        assert metrics.headers["content-type"].startswith("text/plain")
        missing = client.get(f"{proxy.url}/nowhere")
        assert missing.status_code == 404
    assert [(index, fault) for index, fault, _ in proxy.log] == [(0, None), (1, None), (2, None)]
    assert proxy.log[0][2] == request_key({"prompt": [1, 2, 3]})
    assert proxy.counts() == {"forwarded": 3}


def test_each_fault_kind(upstream: str) -> None:
    faults = {0: "429", 1: "500", 2: "timeout", 3: "drop", 5: "503", 6: "timeout"}
    with FaultProxy(upstream, faults, timeout_hold=1.0) as proxy:
        with httpx.Client(timeout=5) as client:
            limited = _completion(client, proxy, "a")
            assert limited.status_code == 429
            assert limited.headers["retry-after"] == "1"
            assert limited.json()["error"]["code"] == "rate_limit_exceeded"
            assert "message" in limited.json()["error"]
            failed = _completion(client, proxy, "b")
            assert failed.status_code == 500 and "retry-after" not in failed.headers
            assert failed.json()["error"]["type"] == "server_error"
        with httpx.Client(timeout=0.3) as client:
            start = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                _completion(client, proxy, "c")
            assert time.monotonic() - start < 0.9
        with httpx.Client(timeout=5) as client:
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                _completion(client, proxy, "d")
            # the same client (a fresh connection) goes on after the drop
            assert _completion(client, proxy, "e").status_code == 200
            overloaded = _completion(client, proxy, "f")
            assert overloaded.status_code == 503 and overloaded.headers["retry-after"] == "1"
        with httpx.Client(timeout=5) as client:
            # a held connection closes after timeout_hold without an answer
            start = time.monotonic()
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                client.post(f"{proxy.base_url}/completions", json={"prompt": "g"})
            assert 0.9 < time.monotonic() - start < 3
    assert [fault for _, fault, _ in proxy.log] == [
        "429", "500", "timeout", "drop", None, "503", "timeout",
    ]  # fmt: skip
    assert proxy.counts() == {
        "forwarded": 1, "429": 1, "500": 1, "timeout": 2, "drop": 1, "503": 1,
    }  # fmt: skip


def test_callable_faults_see_index_and_body(upstream: str) -> None:
    seen = []

    def faults(index: int, body: dict) -> str | None:
        seen.append((index, body.get("prompt")))
        return "500" if body.get("prompt") == "bad" else None

    with FaultProxy(upstream, faults) as proxy, httpx.Client(timeout=5) as client:
        assert _completion(client, proxy, "good").status_code == 200
        assert _completion(client, proxy, "bad").status_code == 500
        assert client.post(f"{proxy.base_url}/completions", content=b"not json").status_code == 200
    assert seen == [(0, "good"), (1, "bad"), (2, None)]


def test_unknown_fault_answers_500(upstream: str) -> None:
    with FaultProxy(upstream, {0: "explode"}) as proxy, httpx.Client(timeout=5) as client:
        response = _completion(client, proxy, "x")
        assert response.status_code == 500
        assert "explode" in response.json()["error"]["message"]
        assert _completion(client, proxy, "y").status_code == 200


def test_fail_once_fails_each_body_at_most_once(upstream: str) -> None:
    prompts = [f"row {i}" for i in range(120)]
    faults = fail_once(0.3, seed=7, kinds=("429", "500", "drop"))
    planned = {
        request_key({"prompt": p}): faults.planned(request_key({"prompt": p})) for p in prompts
    }
    failing = {key for key, fault in planned.items() if fault}
    assert 0.2 < len(failing) / len(prompts) < 0.4
    assert {planned[key] for key in failing} == {"429", "500", "drop"}
    # deterministic in the seed, independent of arrival order
    again = fail_once(0.3, seed=7, kinds=("429", "500", "drop"))
    assert all(again.planned(key) == fault for key, fault in planned.items())
    other = fail_once(0.3, seed=8, kinds=("429", "500", "drop"))
    assert any(other.planned(key) != fault for key, fault in planned.items())

    with FaultProxy(upstream, faults) as proxy, httpx.Client(timeout=5) as client:
        for _ in range(2):  # every row, retried until it succeeds, twice over
            for prompt in prompts:
                for _attempt in range(3):
                    try:
                        if _completion(client, proxy, prompt).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                else:
                    raise AssertionError(f"{prompt!r} failed three times")
    failed_keys = [key for _, fault, key in proxy.log if fault]
    assert sorted(failed_keys) == sorted(failing)  # each planned body failed exactly once
    assert faults.failed == {key: planned[key] for key in failing}
    counts = proxy.counts()
    assert counts["forwarded"] == 2 * len(prompts)
    assert sum(counts.values()) == 2 * len(prompts) + len(failing)


def test_64_concurrent_requests(upstream: str) -> None:
    with (
        FaultProxy(upstream, fail_once(0.25, seed=3, kinds=("429", "500"))) as proxy,
        httpx.Client(timeout=10, limits=httpx.Limits(max_connections=100)) as client,
    ):

        def ask(i: int) -> int:
            return _completion(client, proxy, f"concurrent {i}", sleep=0.2).status_code

        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=64) as pool:
            statuses = list(pool.map(ask, range(64)))
        elapsed = time.monotonic() - start
    assert len(statuses) == 64 and set(statuses) <= {200, 429, 500}
    assert statuses.count(200) == proxy.counts()["forwarded"] >= 32
    assert elapsed < 5, f"64 requests of 0.2 s took {elapsed:.1f} s: not concurrent"
    assert sorted(index for index, _, _ in proxy.log) == list(range(64))


def test_unreachable_upstream_answers_502() -> None:
    with FaultProxy("http://127.0.0.1:9") as proxy, httpx.Client(timeout=5) as client:
        response = client.get(f"{proxy.base_url}/models")
        assert response.status_code == 502
        assert "upstream" in response.json()["error"]["message"]


def test_close_ends_held_connections(upstream: str) -> None:
    proxy = FaultProxy(upstream, {0: "timeout"}, timeout_hold=30).start()
    errors = []

    def held() -> None:
        try:
            with httpx.Client(timeout=10) as client:
                _completion(client, proxy, "held")
        except httpx.HTTPError as error:
            errors.append(error)

    thread = threading.Thread(target=held)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    proxy.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and errors
    assert time.monotonic() - start < 3


def test_client_leaving_cancels_the_upstream_request(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        with httpx.Client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
            _completion(client, proxy, "slow", sleep=0.8, probe="left")
        with httpx.Client(timeout=5) as client:
            assert _completion(client, proxy, "slow", sleep=0.8, probe="stayed").status_code == 200
        deadline = time.monotonic() + 3
        while "left" not in PEER_CLOSED and time.monotonic() < deadline:
            time.sleep(0.05)
    assert PEER_CLOSED == {"left": True, "stayed": False}
