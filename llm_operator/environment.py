"""Every environment variable the library, its bench and its examples read, with its doc.

The docs' reference page is generated from ``VARIABLES`` (``llm_operator.reference``), and
the suite checks that every variable the code reads (``os.environ[...]``, ``.get``,
``.setdefault``, ``os.getenv``) is listed here, so the page cannot fall behind the code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One environment variable: who reads it (``library``, ``bench``, ``examples``,
    ``tests``), what it does, and its default when unset."""

    name: str
    read_by: str
    doc: str
    default: str = "unset"


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "LLM_OPERATOR_CACHE",
        "library",
        "Folder for converted GGUF models, assembled alias packages and cached quantized weights.",
        "~/.cache/llm-operator",
    ),
    Variable(
        "HF_HUB_CACHE",
        "library",
        "Hugging Face Hub cache a Hub id (`org/name`) is read from or downloaded into "
        "(read through `huggingface_hub`).",
        "$HF_HOME/hub",
    ),
    Variable(
        "HF_HOME",
        "library",
        "Hugging Face's home folder; the Hub cache is its `hub` folder unless "
        "`HF_HUB_CACHE` is set.",
        "~/.cache/huggingface",
    ),
    Variable(
        "HF_HUB_OFFLINE",
        "library",
        "`1`: nothing is downloaded; a Hub id must already be in the cache.",
    ),
    Variable("HF_TOKEN", "library", "Access token for gated and private Hub models."),
    Variable(
        "OPENAI_API_KEY",
        "library",
        "The `openai` backend's key when the `api_key` option is not given (read where the "
        "rows run: on Spark executors and Dask workers).",
    ),
    Variable(
        "CUDA_VISIBLE_DEVICES",
        "library",
        'GPUs a worker may use; `device="auto"` on Spark and Dask picks among them.',
    ),
    Variable(
        "PYSPARK_PYTHON",
        "library",
        "The Python of Spark's workers. The library's local sessions (the CLI, the demo) "
        "set it to the running interpreter when unset.",
        "the running interpreter (local sessions)",
    ),
    Variable(
        "SPARK_LOCAL_IP",
        "library",
        "Address a local Spark session binds; local sessions started by the library set "
        "`127.0.0.1` when unset.",
        "127.0.0.1 (local sessions)",
    ),
    Variable(
        "SPARK_HOME",
        "bench",
        "The Spark installation the deployment matrix (`bench deploy`) starts standalone "
        "masters and workers from; set by the bench to PySpark's own folder.",
    ),
    Variable(
        "PYTHONWARNINGS",
        "library",
        "Warning filters; the library's local Spark sessions add one that silences "
        "PySpark's pandas warning in workers.",
    ),
    Variable(
        "PATH",
        "library",
        "Searched for the C++ compiler and ninja that build the CPU kernels; the venv's "
        "`bin` folder is put first.",
    ),
    Variable(
        "OMP_NUM_THREADS",
        "bench",
        "Threads per process; `bench scale --threads N` sets it for the run.",
    ),
    Variable(
        "TRITON_INTERPRET",
        "library",
        "`1`: Triton kernels run in Triton's CPU interpreter (the test suite sets it); GPU "
        "timings are skipped under it.",
    ),
    Variable(
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "library",
        "The `vllm` backend sets it to `0` when unset, so vLLM's engine core runs in the "
        "worker's process.",
        "0 (set by the vllm backend)",
    ),
    Variable(
        "TOKENIZERS_PARALLELISM",
        "bench",
        "The bench and the scale suite set it to `false` in their workers, so tokenizers do "
        "not start threads beside the engine's.",
    ),
    Variable(
        "LLM_OPERATOR_VLLM_PYTHON",
        "bench",
        "The Python with vLLM installed that the bench's vLLM systems run in.",
        ".venv-vllm/bin/python",
    ),
    Variable(
        "LLM_OPERATOR_EXAMPLE_MODEL",
        "examples",
        "Model of the ETL notebook (an alias, a model folder or a `.gguf` file).",
        "smollm2-135m-instruct",
    ),
    Variable("LLM_OPERATOR_EXAMPLE_ROWS", "examples", "Rows of the ETL notebook.", "40"),
    Variable(
        "LLM_OPERATOR_CLUSTER_TESTS",
        "tests",
        "`1`: the fault tests also run a local Spark cluster and kill an executor "
        "(`make test-faults`).",
    ),
    Variable(
        "LLM_OPERATOR_BROWSER_TESTS",
        "tests",
        "`1`: the docs site's browser test fails instead of skipping when Chromium is "
        "missing (CI installs Debian's chromium and sets it).",
    ),
)
BY_NAME: dict[str, Variable] = {variable.name: variable for variable in VARIABLES}
assert len(BY_NAME) == len(VARIABLES), "no variable is listed twice"
