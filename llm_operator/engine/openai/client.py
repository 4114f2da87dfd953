"""HTTP to an OpenAI-compatible server: the probe before a job, and one request with retries.

Every request of a run goes through ``Endpoint.post``, a coroutine run on the endpoint's
own event loop (a daemon thread, so a caller on any thread, such as a Spark task's, steps
the run while requests are in flight). A ``RETRY_STATUSES`` status, a timeout or a dropped
connection is retried up to ``max_retries`` times, after the server's ``Retry-After`` or
an exponential backoff with full jitter (0.5 s doubling, at most 30 s); another status, or
the last failure, raises ``RequestFailed`` naming the status and the server's message (the
row's error). ``probe`` runs before a job: an unreachable server, a refused key or a model
the server does not serve fails there, with the address and what the server lists.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, NamedTuple

import httpx

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 30.0
PROBE_TIMEOUT_SECONDS = 15.0


class RequestFailed(Exception):
    """A request the server did not answer, after its retries: the row's error."""


class Served(NamedTuple):
    """What the probe learnt: the model name to send, and the server's kind ("vllm" when
    it owns the model, which accepts vLLM's extra fields; else "openai")."""

    model: str
    kind: str


class _Failure(NamedTuple):
    """A failed try: its kind ("429", "timeout", ...), what went wrong, whether it is
    retried, and the seconds the server's ``Retry-After`` asks for."""

    kind: str
    message: str
    retryable: bool = True
    wait: float | None = None


class Endpoint:
    """The server an ``EngineConfig`` names (its base_url, api_key else ``$OPENAI_API_KEY``,
    request_timeout, max_retries and max_concurrency connections; ``timeout`` and
    ``max_retries`` given here in place of the config's): an ``httpx.AsyncClient`` on an
    event loop of its own."""

    def __init__(
        self, config, *, timeout: float | None = None, max_retries: int | None = None
    ) -> None:
        self.base_url = config.base_url.rstrip("/")
        self.max_retries = config.max_retries if max_retries is None else max_retries
        self.failures: dict[str, int] = {}  # retried failures by kind ("429", "timeout", ...)
        timeout = config.request_timeout if timeout is None else timeout
        api_key = config.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        limits = httpx.Limits(
            max_connections=config.max_concurrency, max_keepalive_connections=None
        )

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
                limits=limits,
            )

        self._client = self.run(make()).result()

    def run(self, coroutine: Coroutine) -> Future:
        """Schedule ``coroutine`` on the endpoint's loop; a concurrent Future of its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.run(self._client.aclose()).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def _get(self, url: str) -> httpx.Response:
        return self.run(self._client.get(url, timeout=PROBE_TIMEOUT_SECONDS)).result()

    # -- before a job ------------------------------------------------------------------
    def probe(self, model: str | None) -> Served:
        """The served model to send (``model``, or the only one the server lists) and the
        server's kind; ValueError / ConnectionError saying what is wrong."""
        try:
            response = self._get("/models")
        except httpx.HTTPError as error:
            raise ConnectionError(
                f"cannot reach the model server at {self.base_url} ({type(error).__name__}: "
                f"{error}); is it running, and is base_url its API root (such as "
                "http://host:8000/v1)?"
            ) from None
        if response.status_code in (401, 403):
            raise PermissionError(
                f"the model server at {self.base_url} refused the API key (HTTP "
                f"{response.status_code}: {_message(response)}); set api_key or OPENAI_API_KEY"
            )
        if response.status_code != 200:
            raise ConnectionError(
                f"the model server at {self.base_url} answered GET /models with HTTP "
                f"{response.status_code}: {_message(response)}"
            )
        try:
            listed = response.json()["data"]
            names = [str(entry["id"]) for entry in listed]
            owners = {str(entry["id"]): str(entry.get("owned_by", "")) for entry in listed}
        except (ValueError, KeyError, TypeError):
            raise ConnectionError(
                f"{self.base_url}/models is not an OpenAI model list: {response.text[:200]!r}"
            ) from None
        if model is None:
            if len(names) != 1:
                raise ValueError(
                    f"the model server at {self.base_url} serves {names}; name one "
                    "with server_model"
                )
            model = names[0]
        elif model not in owners:
            raise ValueError(
                f"server_model={model!r} is not served at {self.base_url}; it serves {names}"
            )
        return Served(model, "vllm" if owners[model] == "vllm" else "openai")

    def cache_tokens(self) -> int | None:
        """The tokens the server's KV cache holds, from a vLLM server's ``/metrics``
        (``cache_tokens_of``); None where the server does not say."""
        try:
            response = self._get(f"{self.base_url.removesuffix('/v1')}/metrics")
        except httpx.HTTPError:
            return None
        return cache_tokens_of(response.text) if response.status_code == 200 else None

    # -- one request -------------------------------------------------------------------
    async def post(
        self, path: str, body: dict[str, Any], first: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """POST ``body`` (JSON) to ``path`` with the retry policy (module doc); the answer's
        JSON, or RequestFailed. ``first``: stream the answer, and call ``first()`` when its
        first chunk arrives (the prompt is computed, so in the server's prefix cache); the
        chunks are joined into the answer a plain request gets."""
        attempt = 0
        while True:
            answer = await self._attempt(path, body, first)
            if not isinstance(answer, _Failure):
                return answer
            if not answer.retryable or attempt >= self.max_retries:
                tries = f" after {attempt + 1} tries" if attempt else ""
                raise RequestFailed(f"model server: {answer.message}{tries}")
            self.failures[answer.kind] = self.failures.get(answer.kind, 0) + 1
            backoff = random.uniform(0, min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2**attempt))
            await asyncio.sleep(backoff if answer.wait is None else answer.wait)
            attempt += 1

    async def _attempt(self, path: str, body: dict[str, Any], first) -> dict[str, Any] | _Failure:
        """One try: the answer's JSON, or a ``_Failure``; with ``first``, streamed."""
        try:
            if first is None:
                return _answer(await self._client.post(path, json=body))
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            chunks: list[dict[str, Any]] = []
            async with self._client.stream("POST", path, json=streamed) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _answer(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        break
                    chunks.append(json.loads(data))
                    if len(chunks) == 1:
                        first()
            return join_chunks(chunks)
        except httpx.TimeoutException as error:
            return _Failure("timeout", f"timed out ({type(error).__name__})")
        except httpx.HTTPError as error:  # refused, reset, dropped mid-answer
            return _Failure("connection", f"connection failed ({type(error).__name__}: {error})")
        except ValueError as error:
            return _Failure("body", f"a streamed chunk that is not JSON ({error})")


def _answer(response: httpx.Response) -> dict[str, Any] | _Failure:
    """A whole response: its JSON object, or a ``_Failure``."""
    status = response.status_code
    if status != 200:
        message = f"HTTP {status}: {_message(response)}"
        return _Failure(str(status), message, status in RETRY_STATUSES, retry_after(response))
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        return answer
    return _Failure(
        "body", f"HTTP 200 with a body that is not a JSON object: {response.text[:200]!r}"
    )


def join_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed answer's chunks as the one answer a plain request gets: the first
    choice's text (or message content), token ids and log-probabilities concatenated,
    its last finish reason, the usage of the chunk that has it."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    content: list[dict[str, Any]] = []
    reason = usage = None
    chat = False
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            chat = chat or delta is not None
            text.append((choice.get("text") if delta is None else delta.get("content")) or "")
            token_ids.extend(choice.get("token_ids") or ())
            entries = choice.get("logprobs") or {}
            logprobs.extend(entries.get("token_logprobs") or ())
            content.extend(entries.get("content") or ())
            reason = choice.get("finish_reason") or reason
    joined: dict[str, Any] = {"finish_reason": reason}
    if chat:
        joined["message"] = {"content": "".join(text)}
        joined["logprobs"] = {"content": content} if content else None
    else:
        joined["text"] = "".join(text)
        joined["logprobs"] = {"token_logprobs": logprobs} if logprobs else None
    if token_ids:
        joined["token_ids"] = token_ids
    return {"choices": [joined], "usage": usage}


endpoint_for = Endpoint  # the name the driver's probe (integrations.infer_options) imports


def cache_tokens_of(metrics: str) -> int | None:
    """The KV cache size in tokens from vLLM's Prometheus text (the labels of
    ``vllm:cache_config_info``: ``kv_cache_size_tokens``, else blocks x block size)."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            try:
                if labels.get("kv_cache_size_tokens", "None") != "None":
                    return int(labels["kv_cache_size_tokens"])
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a ``Retry-After`` header asks for (delta seconds or an HTTP date,
    at most 120), else None."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), 120.0)


def _message(response: httpx.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message": ...}}`` or vLLM's
    ``{"message": ...}``), else the body's start."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:300].strip() or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    return json.dumps(data)[:300]
