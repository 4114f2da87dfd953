"""Shared offline fixtures: a tiny trained tokenizer and tiny random Llama/Qwen2/Mistral models.

Everything is built once per session under tmp_path_factory with fixed seeds,
in a few seconds, without network access.

- tiny_tokenizer_dir: byte-level BPE (vocab ~512) trained on TINY_CORPUS; eos = pad =
  `<|endoftext|>` (id 0), `<|im_start|>` = 1, `<|im_end|>` = 2, no bos, ChatML template.
- tiny_llama_dir / tiny_qwen2_dir / tiny_mistral_dir: config.json, model.safetensors (fp32),
  generation_config.json (eos 0) and the tokenizer files. See helpers.tiny_config.
- tiny_model_dir: parametrized over ("llama", "qwen2", "mistral").
- tiny_qwen3_dir: Qwen3 (q/k RMSNorm, head_dim 32 != hidden / heads); it is in
  NATIVE_FAMILIES, not TINY_FAMILIES. native_model_dir: parametrized over NATIVE_FAMILIES.
- tiny_llama3_rope_dir: the tiny Llama with llama3 rope scaling (helpers.LLAMA3_ROPE_PARAMETERS).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test runs the suite on 2 processes
    # each worker (and the processes it starts: Spark and Dask workers, bench systems)
    # takes its share of the cores: two of all cores each would spin against each other
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)  # so tests can `from helpers import ...`

from helpers import (  # noqa: E402
    LLAMA3_ROPE_PARAMETERS,
    LONGROPE_FAMILY,
    NATIVE_FAMILIES,
    TINY_FAMILIES,
    WINDOW_FAMILIES,
    build_tiny_model,
    build_tiny_tokenizer,
)

TINY_MODEL_SEEDS = {"llama": 1234, "qwen2": 2345, "mistral": 3456, "qwen3": 4567}
LLAMA3_ROPE_SEED = 5678

TINY_CORPUS = (
    "The battery lasts two full days and charges in under an hour.",
    "I returned the headphones because the left ear cup stopped working after a week.",
    "Great value for the price, would buy again.",
    "Shipping took 12 days and the box arrived crushed.",
    "Customer support answered my email within 24 hours and solved the problem.",
    "The blender is loud, but it crushes ice in seconds.",
    "My order #4521 was charged twice; please refund the duplicate payment.",
    "How do I reset my password? The link in the email has expired.",
    "The app crashes every time I open the settings page on Android 14.",
    "Terrible fit: the shoes run a full size small.",
    "Five stars! The coffee maker brews a hot, strong cup every morning.",
    "The screen has a dead pixel in the top right corner.",
    "Can I change the delivery address after the order has shipped?",
    "Product works as described, nothing more, nothing less.",
    "The instructions were confusing, so assembly took three hours.",
    "Ticket 88: user cannot log in after the latest update.",
    "Priority: high. The checkout page returns error 500 for all customers.",
    "Please cancel my subscription and confirm by email.",
    "The jacket is warm, light and the zipper feels sturdy.",
    "I love the color, but the fabric pills after washing.",
    "Refund received, thank you for the quick help!",
    "The laptop gets very hot when playing video games.",
    "Summarize the review in one sentence.",
    "Classify the sentiment as positive, negative or neutral.",
    "Extract the product name and the main complaint.",
    "Answer with a single word: yes or no.",
    "The vacuum cleaner picks up pet hair easily and is quiet.",
    "Battery drains fast; it barely lasts four hours.",
    "The package was left at the wrong door and a neighbor found it.",
    "Our team uses this printer daily and it has never jammed.",
    "The discount code SAVE10 did not apply at checkout.",
    "Why was my account locked? I did not try to log in.",
    "The tent kept us dry during a heavy storm.",
    "Sound quality is clear, but the bass is weak.",
    "Received the wrong size; I need an exchange for a medium.",
    "The keyboard is comfortable and the keys are quiet.",
    "It stopped charging after the warranty ended, of course.",
    "Delivery was fast and the packaging was recyclable.",
    "The manual is only in French; please send an English copy.",
    "Is this item compatible with the older model?",
    "The water bottle leaks when it is laid on its side.",
    "Excellent service from start to finish.",
    "The knife set is sharp, balanced and easy to clean.",
    "I was on hold for 45 minutes before anyone answered.",
    "Label: billing, shipping, technical or other.",
    "Rate the urgency from 1 to 5 and explain briefly.",
    "The smart watch counts steps accurately and the strap is soft.",
    "Two of the six glasses arrived broken.",
    "Works fine with Windows, but the Mac driver is missing.",
    "Thanks! The replacement part fixed the noise.",
    "User reports slow loading times on the dashboard since Monday.",
    "The mattress is firm, which helped my back pain.",
    "Stop sending me marketing emails, I unsubscribed twice.",
    "Overall a solid purchase; setup took five minutes.",
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fast byte-level BPE tokenizer directory (eos = pad = `<|endoftext|>` = 0, ChatML)."""
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"), TINY_CORPUS)


def _build_family(
    family: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    output_dir = tmp_path_factory.mktemp(f"tiny-{family}")
    return build_tiny_model(output_dir, family, tokenizer_dir, TINY_MODEL_SEEDS[family])


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Tiny random LlamaForCausalLM (tied embeddings) + tokenizer, fp32 safetensors."""
    return _build_family("llama", tmp_path_factory, tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Tiny random Qwen2ForCausalLM (q/k/v bias, untied head) + tokenizer, fp32 safetensors."""
    return _build_family("qwen2", tmp_path_factory, tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Tiny random MistralForCausalLM (no sliding window, untied head) + tokenizer, fp32."""
    return _build_family("mistral", tmp_path_factory, tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Tiny random Qwen3ForCausalLM (q/k norm, head_dim 32, untied head) + tokenizer, fp32."""
    return _build_family("qwen3", tmp_path_factory, tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path
) -> Path:
    """Tiny random Llama with llama3 rope scaling (LLAMA3_ROPE_PARAMETERS) + tokenizer, fp32."""
    output_dir = tmp_path_factory.mktemp("tiny-llama3-rope")
    return build_tiny_model(
        output_dir,
        "llama",
        tiny_tokenizer_dir,
        LLAMA3_ROPE_SEED,
        rope_parameters=LLAMA3_ROPE_PARAMETERS,
    )


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_model_dir(request: pytest.FixtureRequest) -> Path:
    """Each tiny model directory in turn: llama, qwen2, mistral."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="session")
def window_family_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    """Tiny random models of every sliding-window family (``WINDOW_FAMILIES``) and of
    ``LONGROPE_FAMILY``, built on first use: family -> directory."""
    root = tmp_path_factory.mktemp("window_families")
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            seed = 7000 + (*WINDOW_FAMILIES, LONGROPE_FAMILY).index(family)
            built[family] = build_tiny_model(root / family, family, tiny_tokenizer_dir, seed)
        return built[family]

    return build


@pytest.fixture(scope="session", params=NATIVE_FAMILIES)
def native_model_dir(request: pytest.FixtureRequest) -> Path:
    """Each tiny model directory the native forward supports: llama, qwen2, qwen3, mistral."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="session")
def spark():
    """The suite's one local Spark session (they take 15-30 s to start).

    ``local[2,4]``: two task slots, and up to 4 attempts per task so tests can check
    retries. Workers run this interpreter, so they import llm_operator from the venv.
    """
    pytest.importorskip("pyspark")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("llm-operator-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


# -- a Spark Connect server ---------------------------------------------------------------
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from helpers import MODE  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(server: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            pytest.fail(f"the Spark Connect server exited ({server.returncode}):\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:]
    pytest.fail(f"the Spark Connect server did not listen on {port} in {timeout} s:\n{tail}")


@pytest.fixture(scope="session")
def connect_url(tmp_path_factory):
    """``sc://127.0.0.1:PORT`` of a local Spark Connect server (local[2]), one for the
    session (test_spark_connect.py and test_spark_ml.py share it)."""
    if MODE in os.environ or "SPARK_REMOTE" in os.environ:
        pytest.skip("this process is in Spark Connect mode already: no classic side to compare")
    pytest.importorskip("grpc", reason="the Spark Connect client needs the spark extra's grpcio")
    import pyspark

    from llm_operator.integrations import spark_session

    home = Path(pyspark.__file__).resolve().parent
    script = home / "sbin" / "start-connect-server.sh"
    if not script.is_file():
        pytest.skip(f"no {script} in this PySpark")
    folder = tmp_path_factory.mktemp("connect-server")
    port = _free_port()
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOG_DIR": str(folder),
        "SPARK_PID_DIR": str(folder),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,  # the workers import llm_operator from this venv
    }
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.driver.extraJavaOptions": "-Dlog4j.configurationFile="
        + spark_session.LOG4J_CONFIG.as_uri(),  # the CLI's quiet logging
    }
    command = ["bash", str(script), "--wait", "--master", "local[2]"]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    log_path = folder / "server.log"
    with open(log_path, "wb") as log:
        # a process group of its own: stopping it stops the JVM and its Python workers
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_for_port(server, port, log_path, timeout=240)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
