"""The examples run: the ETL notebook top to bottom (Dask, then a Spark extraction into
typed columns), the Dask and Spark quickstarts.

All use the tiny random Llama fixture, so they check that the examples work, not what
the labels are. The notebook and the Dask quickstart use a copy with its context raised
from 256 to 2048 positions (the few-shot demo prompts are about 1,000 tokens long), so
their rows really generate; see the Spark test for why it keeps the plain fixture.

The notebook runs in a kernel started from a temporary kernelspec whose argv is this
interpreter (``sys.executable -m ipykernel_launcher``): it needs no ``ipykernel
install`` step and cannot pick up a ``python3`` kernelspec of another environment
(one in ~/.local/share/jupyter would otherwise take precedence).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
KERNEL_NAME = "llm-operator-test-python"
CONTEXT_LENGTH = 2048


@pytest.fixture(scope="module")
def long_context_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny Llama whose context fits the demo prompts (RoPE: no new weights)."""
    model_dir = tmp_path_factory.mktemp("tiny-llama-long-context") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = model_dir / name
        settings = json.loads(path.read_text(encoding="utf-8"))
        settings[key] = CONTEXT_LENGTH
        path.write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return model_dir


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"llm_operator_example_{name}", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_kernelspec(kernels_dir: Path) -> Path:
    """A kernelspec named KERNEL_NAME under ``kernels_dir`` that runs this interpreter."""
    spec_dir = kernels_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "llm-operator tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return kernels_dir


def test_etl_notebook_runs(
    long_context_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel", reason="the notebook kernel needs ipykernel")
    pytest.importorskip("dask.dataframe", reason="the notebook's last part uses Dask")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    # the kernel inherits this environment (HF offline flags from conftest included)
    monkeypatch.setenv("LLM_OPERATOR_EXAMPLE_MODEL", str(long_context_llama_dir))
    monkeypatch.setenv("LLM_OPERATOR_EXAMPLE_ROWS", "12")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    # the notebook's Spark driver is a JVM of its own that runs one small job: the C1 compiler
    # alone (no C2 warm-up of Spark's startup code) saves it several CPU seconds
    java_options = os.environ.get("JAVA_TOOL_OPTIONS", "")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", f"{java_options} -XX:TieredStopAtLevel=1".strip())

    notebook = nbformat.read(EXAMPLES_DIR / "etl_notebook.ipynb", as_version=4)
    stored_outputs = [c.outputs for c in notebook.cells if c.cell_type == "code" and c.outputs]
    assert not stored_outputs, "commit the notebook with its outputs cleared"

    kernel_specs = KernelSpecManager(kernel_dirs=[str(write_kernelspec(tmp_path / "kernels"))])
    kernel_manager = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_specs)
    client = nbclient.NotebookClient(
        notebook,
        km=kernel_manager,
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute(cleanup_kc=True)  # raises CellExecutionError on the first failing cell

    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells), "every code cell ran"
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    printed = "".join(
        o.get("text", "") for c in code_cells for o in c.outputs if o.output_type == "stream"
    )
    assert "12 rows" in printed
    assert "prefix-sharing plan" in printed
    assert "0 error rows" in printed
    assert "every text equals the direct result" in printed
    # the Spark extraction: the schema's types, and every row's JSON typed (closed enough
    # for the random model: enums, a boolean, a bounded array and a bounded string)
    assert (
        "struct<sentiment:string,complaint:boolean,topics:array<string>,product:string>" in printed
    )
    assert "Spark: typed values for 6 of 6 rows" in printed, printed


@pytest.mark.parametrize("extra", [[], ["--scheduler", "threads"], ["--cluster"]])
def test_dask_quickstart_runs(
    long_context_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
) -> None:
    pytest.importorskip("dask.dataframe")
    if "--cluster" in extra:
        pytest.importorskip("distributed")
    import pandas as pd

    quickstart = load_example("dask_quickstart")
    output = tmp_path / "labels.parquet"
    argv = ["--model", str(long_context_llama_dir), "--limit", "8", "--partitions", "2"]
    assert quickstart.main([*argv, "--output", str(output), *extra]) == 0
    assert "8 rows in" in capsys.readouterr().out
    table = pd.read_parquet(output)
    assert sorted(table["id"]) == sorted(r["id"] for r in _demo_rows(8))
    assert list(table.columns) == ["id", "task", "out", "out_finish_reason"]
    assert set(table["out_finish_reason"]) <= {"stop", "length"}


def test_spark_quickstart_runs(
    request: pytest.FixtureRequest,
    tiny_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The quickstart reuses the suite's session, writes one row per input, leaves it running.

    It runs the plain tiny Llama (whose 256 positions the demo prompts overflow, so the
    rows come back as error rows): the Python workers of the shared session are reused
    across tests and cache one engine per model, and tests/test_spark.py checks that
    each worker built at most one, for that same model. Spark's outputs are checked
    there; here it is the example's wiring.
    """
    pytest.importorskip("pyspark")
    try:
        spark = request.getfixturevalue("spark")  # the suite's one shared session
    except pytest.FixtureLookupError:
        pytest.skip("no session-scoped `spark` fixture in conftest.py to share a session with")
    import pandas as pd

    quickstart = load_example("spark_quickstart")
    output = tmp_path / "labels.parquet"
    # one partition: one Python worker to start (and load the model) instead of two
    argv = ["--model", str(tiny_llama_dir), "--limit", "8", "--partitions", "1"]
    assert quickstart.main([*argv, "--output", str(output)]) == 0
    assert "8 rows in" in capsys.readouterr().out
    assert spark.sparkContext._jsc is not None, "the shared session must be left running"
    table = pd.read_parquet(output)
    assert sorted(table["id"]) == sorted(r["id"] for r in _demo_rows(8))
    assert list(table.columns) == ["id", "task", "text", "finish_reason"]
    assert set(table["finish_reason"]) <= {"stop", "length", "error"}


def _demo_rows(limit: int) -> list[dict]:
    from llm_operator.cli.demo_data import build_demo_rows

    return build_demo_rows(limit=limit)
