"""A local HTTP proxy that injects faults in front of an OpenAI-compatible server.

::

    with FaultProxy(server.url, fail_once(0.3, seed=1)) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, ...)   # or httpx on proxy.base_url
        ...
        proxy.counts()   # {"forwarded": 17, "429": 1, "500": 1, "timeout": 0, "drop": 1}

The proxy listens on 127.0.0.1 (a free port) with an asyncio server in a background
thread and forwards every request (method, path and query, headers, body) to the
upstream with ``httpx.AsyncClient``, answering with the upstream's status, headers and
body (the whole body, buffered: a streamed answer arrives at once). Hop-by-hop headers
are dropped both ways. An upstream it cannot reach is answered 502.

Each ``POST`` to ``/v1/completions`` or ``/v1/chat/completions`` (a *generation request*)
gets an index, 0, 1, 2, ... in arrival order, and ``faults(index, body)`` (body: the
parsed JSON, ``{}`` when it is not JSON) says what happens to it:

- None: forwarded.
- ``"429"``: answered 429 with ``Retry-After: 1`` and an OpenAI-style JSON error body,
  not forwarded. Any other three-digit status (``"500"``, ``"503"``, ...) likewise, with
  ``Retry-After`` only for 429 and 503.
- ``"timeout"``: no answer: the connection is held open for ``timeout_hold`` seconds,
  then closed (a client with a shorter read timeout times out first).
- ``"drop"``: the connection is closed at once without any answer (httpx raises
  ``RemoteProtocolError``: "Server disconnected without sending a response").

`faults` may also be a mapping index -> fault (indices not in it are forwarded) or None.
``fail_once`` builds a callable that fails each distinct request body at most once.

``proxy.log`` lists ``(index, fault or None, key)`` per generation request (key:
``request_key(body)``), ``proxy.counts()`` tallies them. Only the standard library and
httpx are used, so this runs in both the main and the vLLM venv.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Iterable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import httpx

HOST = "127.0.0.1"
T = TypeVar("T")
FAULT_KINDS = ("429", "500", "timeout", "drop")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_TIMEOUT_HOLD = 30.0
UPSTREAM_TIMEOUT = 600.0
MAX_HEAD_BYTES = 1 << 20
# hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy rewrites itself
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)

Faults = Callable[[int, dict], str | None] | Mapping[int, str] | None


def request_key(body: Mapping[str, Any] | None) -> str:
    """A short hash of a request body's ``prompt`` / ``messages`` (what identifies a row's
    request across retries; other fields do not enter it)."""
    body = body or {}
    identity = {"prompt": body.get("prompt"), "messages": body.get("messages")}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class FailOnce:
    """``fail_once``'s faults callable; ``failed`` maps each key failed so far to its fault."""

    def __init__(self, fraction: float, seed: int, kinds: Iterable[str]) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.fraction = float(fraction)
        self.seed = seed
        self.kinds = tuple(kinds)
        if not self.kinds:
            raise ValueError("kinds is empty")
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def planned(self, key: str) -> str | None:
        """The fault this key draws (deterministic in seed and key), used or not."""
        rng = random.Random(f"{self.seed}:{key}")
        if rng.random() >= self.fraction:
            return None
        return self.kinds[rng.randrange(len(self.kinds))]

    def __call__(self, index: int, body: dict) -> str | None:
        key = request_key(body)
        with self._lock:
            if key in self.failed:
                return None
            fault = self.planned(key)
            if fault is not None:
                self.failed[key] = fault
            return fault


def fail_once(fraction: float, seed: int = 0, kinds: Iterable[str] = FAULT_KINDS) -> FailOnce:
    """A faults callable that fails about `fraction` of the distinct request bodies (by
    ``request_key``), each once: its first arrival gets a fault, later ones (retries) are
    forwarded. Which bodies fail, and with which of `kinds`, is drawn from `seed` and the
    key alone (so independent of arrival order and concurrency); the fraction is a
    per-body probability, not an exact count."""
    return FailOnce(fraction, seed, kinds)


def _error_body(status: int, message: str) -> bytes:
    kinds = {429: ("rate_limit_error", "rate_limit_exceeded"), 503: ("server_error", "overloaded")}
    error_type, code = kinds.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return json.dumps(payload).encode()


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class _Connection:
    """One client connection: reads HTTP/1.1 requests; notices the client leaving."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.pushback = b""  # a byte read while watching for the client to leave

    async def read_request(
        self,
    ) -> tuple[str, str, str, list[tuple[str, str]], bytes] | None:
        """(method, target, version, headers, body), or None when the client closed."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None  # the client closed the connection between requests
        head, self.pushback = self.pushback + head, b""
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers.append((name.strip(), value.strip()))
        fields = {name.lower(): value for name, value in headers}
        if "chunked" in fields.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        else:
            body = await self.reader.readexactly(int(fields.get("content-length") or 0))
        return method.upper(), target, version, headers, body

    async def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await self.reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    async def _client_left(self) -> None:
        """Return when the client closes its side; a pipelined byte is kept for later."""
        data = await self.reader.read(1)
        if data:
            self.pushback += data
            await asyncio.Future()  # still there: wait until cancelled

    async def unless_client_leaves(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result; cancels it and raises ConnectionResetError if the client
        closes its connection first."""
        job = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._client_left())
        try:
            await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (job, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(job, watch, return_exceptions=True)
        if job.cancelled() or not job.done():
            raise ConnectionResetError("the client closed its connection")
        return job.result()


class FaultProxy:
    """A fault-injecting proxy to `upstream_url` (module doc); a context manager.

    upstream_url: the server's address, with or without a trailing ``/v1``
    (``VLLMServer.url`` or ``.base_url``). timeout_hold: seconds a "timeout" fault holds
    its connection. upstream_timeout: seconds the proxy waits for the upstream.
    """

    def __init__(
        self,
        upstream_url: str,
        faults: Faults = None,
        *,
        timeout_hold: float = DEFAULT_TIMEOUT_HOLD,
        upstream_timeout: float = UPSTREAM_TIMEOUT,
        port: int = 0,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream_url.rstrip("/"))
        prefix = parsed.path.removesuffix("/v1")
        self.upstream = urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, prefix, "", ""))
        self.faults = faults
        self.timeout_hold = float(timeout_hold)
        self.upstream_timeout = float(upstream_timeout)
        self.log: list[tuple[int, str | None, str]] = []
        self.port = port
        self._next_index = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    # -- addresses and records ------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def counts(self) -> dict[str, int]:
        """Generation requests per outcome: "forwarded" and each fault kind seen."""
        tally: dict[str, int] = {"forwarded": 0}
        with self._lock:
            for _, fault, _ in self.log:
                name = fault or "forwarded"
                tally[name] = tally.get(name, 0) + 1
        return tally

    def __repr__(self) -> str:
        return f"FaultProxy({self.base_url} -> {self.upstream})"

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._open())
            except BaseException as error:  # reported by start()
                failure.append(error)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise RuntimeError(f"FaultProxy could not start: {failure[0]!r}") from failure[0]
        return self

    def close(self) -> None:
        if self._thread is None or self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop already gone
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _open(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.upstream_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # never through an HTTP proxy from the environment
            follow_redirects=False,
        )
        self._server = await asyncio.start_server(
            self._serve_connection, HOST, self.port, limit=MAX_HEAD_BYTES, backlog=1024
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        if self._client is not None:
            await self._client.aclose()

    # -- one connection: HTTP/1.1 requests, keep-alive --------------------------------------
    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(writer)
        connection = _Connection(reader, writer)
        try:
            while True:
                request = await connection.read_request()
                if request is None:
                    break
                try:
                    keep_alive = await self._answer(connection, *request)
                except (ConnectionError, asyncio.CancelledError):
                    raise
                except Exception as error:  # a faults callable's, or a bad fault name
                    message = f"FaultProxy failed: {error!r}"
                    await self._respond(writer, 500, [], _error_body(500, message), False)
                    break
                if not keep_alive:
                    break
        except (
            ConnectionError,
            ValueError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass  # the client went away, or sent what is not HTTP
        except asyncio.CancelledError:
            pass  # close()
        finally:
            self._writers.discard(writer)
            if task is not None:
                self._tasks.discard(task)
            if not writer.transport.is_closing():
                writer.close()

    async def _answer(
        self,
        connection: _Connection,
        method: str,
        target: str,
        version: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> bool:
        """Answer one request; whether the connection stays open for another."""
        writer = connection.writer
        fields = {name.lower(): value for name, value in headers}
        option = fields.get("connection", "").lower()
        keep_alive = option != "close" and (version != "HTTP/1.0" or option == "keep-alive")
        path = urllib.parse.urlsplit(target).path.rstrip("/")
        if method == "POST" and path in GENERATION_PATHS:
            fault = self._decide(body)
            if fault == "drop":
                writer.transport.abort()
                return False
            if fault == "timeout":
                await connection.unless_client_leaves(asyncio.sleep(self.timeout_hold))
                writer.transport.abort()
                return False
            if fault is not None:
                status = int(fault)
                extra = [("Retry-After", "1")] if status in (429, 503) else []
                message = f"{status} {_reason(status)} (injected by FaultProxy)"
                await self._respond(writer, status, extra, _error_body(status, message), keep_alive)
                return keep_alive
        # a client that leaves (its timeout) cancels the upstream request, as it would
        # have without the proxy (vLLM aborts a request whose connection closes)
        status, response_headers, response_body = await connection.unless_client_leaves(
            self._forward(method, target, headers, body)
        )
        await self._respond(writer, status, response_headers, response_body, keep_alive)
        return keep_alive

    def _decide(self, body: bytes) -> str | None:
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
        key = request_key(parsed)
        with self._lock:
            index = self._next_index
            self._next_index += 1
        faults = self.faults
        if faults is None:
            fault = None
        elif callable(faults):
            fault = faults(index, parsed)
        else:
            fault = faults.get(index)
        if fault is not None:
            fault = str(fault)
            if fault not in ("timeout", "drop") and not (fault.isdigit() and len(fault) == 3):
                raise ValueError(f"unknown fault {fault!r} for request {index}")
        with self._lock:
            self.log.append((index, fault, key))
        return fault

    async def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        assert self._client is not None
        outgoing = [(name, value) for name, value in headers if name.lower() not in _HOP_BY_HOP]
        try:
            request = self._client.build_request(
                method, self.upstream + target, headers=outgoing, content=body
            )
            response = await self._client.send(request, stream=True)
            try:
                content = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
        except httpx.HTTPError as error:
            message = f"FaultProxy could not reach the upstream: {error!r}"
            return 502, [("Content-Type", "application/json")], _error_body(502, message)
        returned = [
            (name, value)
            for name, value in response.headers.multi_items()
            if name.lower() not in _HOP_BY_HOP
        ]
        return response.status_code, returned, content

    @staticmethod
    async def _respond(
        writer: asyncio.StreamWriter,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        keep_alive: bool,
    ) -> None:
        if not any(name.lower() == "content-type" for name, _ in headers):
            headers = [*headers, ("Content-Type", "application/json")]
        lines = [f"HTTP/1.1 {status} {_reason(status)}"]
        lines += [f"{name}: {value}" for name, value in headers]
        lines += [
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
