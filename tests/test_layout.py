"""The layout's promises: what a driver imports, and which layer may import which.

- Building ``SamplingParams`` and ``EngineConfig``, importing the Spark and Dask
  integrations and building a Dask ``llm_infer`` graph (what a driver does) import
  neither torch, transformers nor xgrammar: a fresh interpreter checks ``sys.modules``.
- ``kernels/`` imports nothing above it; the library (``llm_operator``, ``kernels``,
  ``integrations``) never imports ``llm_operator_bench`` (its ``bench`` command comes
  through an entry point of group ``llm_operator.commands``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "xgrammar")

DRIVER_SCRIPT = f"""
HEAVY = {HEAVY!r}
import json, sys, time
started = time.perf_counter()
from llm_operator import EngineConfig, SamplingParams
SamplingParams(max_tokens=8, stop=["\\n"], temperature=0.5, seed=3, choices=["yes", "no"])
EngineConfig(backend="native", prefill_batch_tokens=512)
params_seconds = time.perf_counter() - started
import pandas as pd
import dask.dataframe as dd
from llm_operator.integrations import dask as llm_dask
import llm_operator.integrations.spark  # noqa: F401
frame = dd.from_pandas(pd.DataFrame({{"p": ["a", "b", "c"]}}), npartitions=2)
out = llm_dask.llm_infer(frame, "p", model="/nowhere/model", max_tokens=4, temperature=0.0)
assert "out" in out.columns
vectors = llm_dask.llm_embed(frame, "p", model="/nowhere/model", pooling="mean", dimensions=8)
assert "embedding" in vectors.columns
print(json.dumps({{
    "loaded": [name for name in HEAVY if name in sys.modules],
    "params_seconds": params_seconds,
}}))
"""


def test_a_driver_imports_no_torch_transformers_or_xgrammar() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", DRIVER_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], f"a driver imported {report['loaded']}"


def _imports(path: Path) -> list[str]:
    """Every module a file imports (absolute names; relative imports are not used here)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_kernels_import_nothing_above_them() -> None:
    offending = {
        f"{path.name}: {name}"
        for path in (ROOT / "kernels").glob("*.py")
        for name in _imports(path)
        if name.startswith("llm_operator") and not name.startswith("llm_operator.kernels")
    }
    assert not offending, sorted(offending)


def test_the_library_never_imports_the_benchmarks() -> None:
    offending = {
        f"{path.relative_to(ROOT)}: {name}"
        for folder in ("llm_operator", "kernels", "integrations")
        for path in (ROOT / folder).rglob("*.py")
        for name in _imports(path)
        if name.startswith("llm_operator_bench")
    }
    assert not offending, sorted(offending)


def test_setup_cfg_lists_every_package() -> None:
    """A wheel carries only the packages setup.cfg names (an editable install hides a
    missing one): every folder with an __init__.py must be there."""
    import configparser

    root = Path(__file__).resolve().parent.parent
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    folders = {"llm_operator": "llm_operator", "kernels": "llm_operator.kernels",
               "integrations": "llm_operator.integrations",
               "llm_operator_bench": "llm_operator_bench"}  # fmt: skip
    found = set()
    for folder, name in folders.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *parts)))
    assert found - listed == set(), f"setup.cfg [options] packages misses {sorted(found - listed)}"


def test_the_operator_stays_a_coordinator() -> None:
    """``LLMOperator`` plans, runs a backend and assembles rows; backends live behind
    ``engine.factory`` and the contract of ``engine.base`` (issue 31: at most 200 lines)."""
    source = (ROOT / "llm_operator" / "operator.py").read_text()
    assert len(source.splitlines()) <= 200
    for backend in ("openai", "native", "hf.backend", "NativeBackend", "HFBackend", "httpx"):
        assert backend not in source, backend


def _module_graph() -> dict[str, set[str]]:
    """The library's modules (llm_operator, kernels and integrations under their installed
    names) and, for each, the library modules it imports: at the top, inside functions and
    under TYPE_CHECKING alike. ``from package import name`` counts as the submodule when
    ``name`` is one, else as the package."""
    folders = {"llm_operator": "llm_operator", "kernels": "llm_operator.kernels",
               "integrations": "llm_operator.integrations"}  # fmt: skip
    modules: dict[str, Path] = {}
    for folder, name in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((name, *parts))] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else resolve(node.module))
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def test_no_import_circles_lazy_or_type_only() -> None:
    """No module reaches itself through imports, counting lazy (in-function) and
    TYPE_CHECKING imports: the layers import one way."""
    graph = _module_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_the_kernels_package_only_re_exports() -> None:
    """kernels/__init__.py holds a docstring, imports and __all__: no state, no dispatch."""
    tree = ast.parse((ROOT / "kernels" / "__init__.py").read_text())
    kinds = set()
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            kinds.add("docstring")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            kinds.add("import")
        elif isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]:
            kinds.add("__all__")
        else:
            kinds.add(type(node).__name__)
    assert kinds == {"docstring", "import", "__all__"}, kinds


def test_the_library_reads_no_llm_operator_switches() -> None:
    """Every LLM_OPERATOR_* switch is an option (EngineConfig) or gone: the library reads
    only LLM_OPERATOR_CACHE, the default of the cache_dir option. (The reads are found by
    the scan behind the docs' environment page; llm_operator/environment.py names the
    bench's, the examples' and the tests' variables without reading them.)"""
    from llm_operator.reference import source_files, variables_read

    found = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in source_files(ROOT, ("llm_operator", "kernels", "integrations"))
        for name in variables_read(path)
        if name.startswith("LLM_OPERATOR_") and name != "LLM_OPERATOR_CACHE"
    }
    assert not found, sorted(found)
