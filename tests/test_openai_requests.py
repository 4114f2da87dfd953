"""backend="openai" without vLLM: a small fake OpenAI server (its "model" answers a
prompt with the prompt's first tokens) behind the fault proxy, for the retry policy,
error rows, the probe on the driver (Spark and Dask), what a server that cannot constrain
refuses, and the parsers. The real server's tests are tests/test_openai_backend.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llm_operator import LLMOperator, SamplingParams
from llm_operator.engine.openai.client import cache_tokens_of, retry_after
from llm_operator_bench.testing.fault_proxy import FaultProxy

TOO_LONG = 40  # prompts longer than this get a 400, as a server's max_model_len would


class FakeServer(BaseHTTPRequestHandler):
    """GET /v1/models, /metrics; POST /v1/completions answering with the prompt's first
    max_tokens tokens (``return_token_ids``), usage counting every prompt token cached
    after the first request of that prompt."""

    protocol_version = "HTTP/1.1"
    owner = "vllm"
    seen: set = set()
    streamed = 0  # requests answered as server-sent events

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, payload) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"data": [{"id": "fake", "owned_by": self.owner}]})
        elif self.path == "/metrics":
            labels = 'block_size="16",kv_cache_size_tokens="4096",num_gpu_blocks="256"'
            self._send(200, f"vllm:cache_config_info{{{labels}}} 1.0\n".encode())
        else:
            self._send(404, {"error": {"message": "no such route"}})

    def _stream(self, tokens: list[int], usage: dict) -> None:
        """Server-sent events: a chunk per token, then the usage, then [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for position, token in enumerate(tokens):
            reason = "length" if position == len(tokens) - 1 else None
            choice = {"index": 0, "text": "", "token_ids": [token], "finish_reason": reason}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if len(prompt) > TOO_LONG:
            self._send(400, {"error": {"message": f"prompt of {len(prompt)} tokens is too long"}})
            return
        key = tuple(prompt)
        cached = len(prompt) if key in FakeServer.seen else 0
        FakeServer.seen.add(key)
        tokens = list(prompt[: body["max_tokens"]])
        choice = {"text": "", "token_ids": tokens, "finish_reason": "length"}
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream"):
            FakeServer.streamed += 1
            self._stream(tokens, usage)
        else:
            self._send(200, {"choices": [choice], "usage": usage})


@pytest.fixture(scope="module")
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


PROMPTS = ["alpha beta gamma delta", "alpha beta gamma epsilon", "zeta eta theta"]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_retries_wait_for_retry_after_and_a_refused_row_is_that_row_s_error(
    tiny_llama_dir: Path, fake_server: str
) -> None:
    prompts = [*PROMPTS, " ".join(["word"] * 60)]  # the last one is too long for the server
    params = SamplingParams(max_tokens=3)
    direct = LLMOperator(tiny_llama_dir, backend="openai", base_url=f"{fake_server}/v1")
    expected = direct.generate(prompts, params)
    ids = direct.tokenize(prompts)
    assert [list(r.token_ids) for r in expected[:3]] == [i[:3] for i in ids[:3]]
    assert expected[3].error.startswith("model server: HTTP 400: prompt of")
    assert all(r.error is None for r in expected[:3])
    assert direct.backend().cache_tokens == 4096  # the waves' budget, from /metrics
    assert FakeServer.streamed == 1  # the first of the two rows sharing "alpha beta gamma"
    direct.backend().close()

    faults = {0: "429", 1: "500", 2: "drop"}  # the first three requests, whichever they are
    with FaultProxy(fake_server, faults) as proxy:
        op = LLMOperator(tiny_llama_dir, backend="openai", base_url=proxy.base_url)
        started = time.perf_counter()
        results = op.generate(prompts, params)
        seconds = time.perf_counter() - started
        profile = op.backend().last_profile
        op.backend().close()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.error for r in results[:3]] == [None] * 3
    # the refused row says so whatever it met first ("... after 2 tries" if a fault)
    assert results[3].error.startswith(expected[3].error)
    assert profile["retries"] == 3 and profile["retried"] == {"429": 1, "500": 1, "connection": 1}
    assert seconds >= 1.0  # the 429's Retry-After: 1
    stats = op.last_stats
    assert stats.server_prompt_tokens == sum(len(i) for i in ids[:3])
    assert stats.server_cached_tokens == stats.server_prompt_tokens  # the fake caches whole prompts
    assert stats.prefill_tokens_computed == 0


def test_a_row_out_of_retries_names_the_status_and_the_message(
    tiny_llama_dir: Path, fake_server: str
) -> None:
    with FaultProxy(fake_server, lambda index, body: "500") as proxy:
        op = LLMOperator(tiny_llama_dir, backend="openai", base_url=proxy.base_url, max_retries=1)
        results = op.generate(PROMPTS[:2], SamplingParams(max_tokens=2))
        op.backend().close()
    for result in results:
        assert result.finish_reason == "error"
        assert (
            result.error.startswith("model server: HTTP 500:") and "after 2 tries" in result.error
        )


def test_the_driver_probes_the_server_before_any_job(
    tiny_llama_dir: Path, fake_server: str, spark
) -> None:
    from llm_operator.integrations import dask as llm_dask
    from llm_operator.integrations import spark as llm_spark

    port = _closed_port()
    for bad, error, message in [
        ({"base_url": f"http://127.0.0.1:{port}/v1"}, ConnectionError, "cannot reach"),
        ({"base_url": f"{fake_server}/v1", "server_model": "gpt"}, ValueError, r"\['fake'\]"),
    ]:
        with pytest.raises(error, match=message):
            llm_spark.llm_infer("prompt", model=str(tiny_llama_dir), backend="openai", **bad)
        frame = _dask_frame()
        with pytest.raises(error, match=message):
            llm_dask.llm_infer(frame, "prompt", model=str(tiny_llama_dir), backend="openai", **bad)
    with pytest.raises(ValueError, match="needs base_url"):
        LLMOperator(tiny_llama_dir, backend="openai")
    with pytest.raises(ValueError, match='is for backend="openai"'):
        LLMOperator(tiny_llama_dir, base_url=f"{fake_server}/v1")


def _dask_frame():
    import dask.dataframe as dd
    import pandas as pd

    return dd.from_pandas(pd.DataFrame({"prompt": ["a", "b"]}), npartitions=1)


def test_a_server_that_cannot_constrain_refuses_before_any_row(
    tiny_llama_dir: Path, fake_server: str, monkeypatch
) -> None:
    monkeypatch.setattr(FakeServer, "owner", "someone")  # not vLLM: the chat API, no grammars
    op = LLMOperator(tiny_llama_dir, backend="openai", base_url=f"{fake_server}/v1")
    try:
        assert op.backend().api == "chat"
        for constraint in ({"choices": ["yes", "no"]}, {"regex": "[a-z]+"}):
            with pytest.raises(ValueError, match="not a vLLM server"):
                op.generate(PROMPTS[:1], SamplingParams(max_tokens=4, **constraint))
        with pytest.raises(ValueError, match="choice scores"):
            op.generate(PROMPTS[:1], SamplingParams(max_tokens=4, choices=["a"], logprobs=True))
    finally:
        op.backend().close()


def test_retry_after_and_the_cache_size_are_read_from_the_server_s_words() -> None:
    import httpx

    def response(value: str | None) -> httpx.Response:
        return httpx.Response(429, headers={} if value is None else {"Retry-After": value})

    assert retry_after(response("3")) == 3.0
    assert retry_after(response(None)) is None
    assert retry_after(response("soon")) is None
    assert retry_after(response("100000")) == 120.0  # capped
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= retry_after(response(later)) <= 31
    text = (
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="10",kv_cache_size_tokens="None"} 1'
    )
    assert cache_tokens_of(text) == 320
    assert cache_tokens_of('vllm:cache_config_info{kv_cache_size_tokens="777"} 1') == 777
    assert cache_tokens_of("vllm:other 1") is None


def test_the_cli_summary_shows_the_server_s_counts_after_a_resume(
    tiny_llama_dir: Path, fake_server: str, tmp_path: Path, capsys
) -> None:
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_operator.cli import main

    source = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": [*PROMPTS, "iota kappa"]}), source)
    folder = tmp_path / "ckpt"
    argv = ["run", str(source), "--prompt-col", "prompt", "--model", str(tiny_llama_dir),
            "--backend", "openai", "--base-url", f"{fake_server}/v1", "--max-tokens", "2",
            "--no-progress", "--no-chat", "--checkpoint", str(folder), "--checkpoint-rows", "2"]  # fmt: skip
    pattern = r"model server: ([\d,]+) prompt tokens, ([\d,]+) from its prefix cache"
    assert main([*argv, "--output", str(tmp_path / "a.jsonl")]) == 0
    whole = re.search(pattern, capsys.readouterr().out)
    prompt_tokens = sum(len(ids) for ids in LLMOperator(tiny_llama_dir).tokenize(
        [*PROMPTS, "iota kappa"]))  # fmt: skip
    assert whole and int(whole[1].replace(",", "")) == prompt_tokens
    sorted(folder.glob("part-*.jsonl"))[1].unlink()  # as if the run had died there
    assert main([*argv, "--output", str(tmp_path / "b.jsonl")]) == 0
    resumed = re.search(pattern, capsys.readouterr().out)
    assert resumed and resumed[1] == whole[1]  # every chunk's, the earlier run's included
