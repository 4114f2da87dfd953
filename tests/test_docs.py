"""The docs' examples run: every ```python and ```bash block of README.md and docs/**/*.md.

Blocks of one page run in order, the Python ones in one namespace, in a fresh working
directory, with the venv's ``llm-operator`` first on PATH. The model alias the docs use,
``smollm2-135m-instruct``, is replaced by the tiny random Llama fixture (the answers are
junk; the examples are checked to work, not for what they say). A block preceded by
``<!-- example: KIND -->`` (gpu, server, cluster, setup, slow) cannot run here and is
only compiled (Python) or checked by ``bash -n`` (shell).

Markdown is parsed with markdown-it-py (the parser mkdocs' extensions also follow for
fences), so what runs is what the site shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MODEL_ALIAS = "smollm2-135m-instruct"
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
MARKS = ("gpu", "server", "cluster", "setup", "slow")
MARK = re.compile(r"<!--\s*example:\s*([a-z-]+)\s*-->\s*$")
SHELL_TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mark: str | None  # None: the block runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    found += sorted(
        path
        for path in DOCS.rglob("*.md")
        if "results" not in path.relative_to(DOCS).parts
        and "hooks" not in path.relative_to(DOCS).parts
    )
    return found


def blocks(path: Path) -> list[Block]:
    """The page's Python and shell fences, each with the mark on the line above it."""
    from markdown_it import MarkdownIt

    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for token in MarkdownIt().parse(text):
        if token.type != "fence" or token.map is None:
            continue
        language = (token.info.split() or [""])[0].lower().strip("{}.")
        if language not in PYTHON + SHELL:
            continue
        start = token.map[0]
        above = lines[start - 1] if start > 0 else ""
        match = MARK.search(above)
        mark = match.group(1) if match else None
        where = f"{path.relative_to(ROOT)}:{start + 1}"
        assert mark is None or mark in MARKS, f"{where}: unknown example mark {mark!r}"
        found.append(Block(str(path.relative_to(ROOT)), start + 1, language, token.content, mark))
    return found


PAGES = [path for path in pages() if blocks(path)]


def substituted(code: str, model: str) -> str:
    return code.replace(MODEL_ALIAS, model)


def run_python(block: Block, code: str, namespace: dict) -> None:
    try:
        exec(compile(code, block.where, "exec"), namespace)  # noqa: S102 - the docs' examples
    except Exception:  # noqa: BLE001 - reported with the page and line
        pytest.fail(f"the example at {block.where} failed:\n{traceback.format_exc()}")


def run_shell(block: Block, code: str, cwd: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SHELL_TIMEOUT,
    )
    assert done.returncode == 0, (
        f"the shell example at {block.where} exited {done.returncode}:\n{code}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )


def check_syntax(block: Block) -> None:
    if block.language in PYTHON:
        compile(block.code, block.where, "exec")
    else:
        done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples_run(
    page: Path,
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    page_blocks = blocks(page)
    runnable = [block for block in page_blocks if block.mark is None]
    monkeypatch.chdir(tmp_path)
    if any("pyspark" in block.code for block in runnable):
        # the suite's one session (getOrCreate() finds it), its relative paths resolved in
        # the page's folder (Spark resolves them against the JVM's working directory)
        spark = request.getfixturevalue("spark")
        local_files = _spark_local_files(spark)
        before = local_files.getWorkingDirectory()
        local_files.setWorkingDirectory(spark._jvm.org.apache.hadoop.fs.Path(tmp_path.as_uri()))
        request.addfinalizer(lambda: local_files.setWorkingDirectory(before))
    namespace: dict = {"__name__": "__docs_example__"}
    for block in page_blocks:
        if block.mark is not None:
            check_syntax(block)
            continue
        code = substituted(block.code, str(tiny_llama_dir))
        if block.language in PYTHON:
            run_python(block, code, namespace)
        else:
            run_shell(block, code, tmp_path)


def _spark_local_files(spark):
    """Hadoop's local file system of ``spark``'s JVM (where file paths resolve)."""
    jvm = spark._jvm
    return jvm.org.apache.hadoop.fs.FileSystem.getLocal(spark._jsc.hadoopConfiguration())


def test_every_page_is_collected() -> None:
    """The parser finds the fences a page has (a fence it misses would never run)."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fences = len(re.findall(r"^\s*```(?:python|py|bash|sh|shell)\b", text, re.MULTILINE))
        assert len(blocks(page)) == fences, page


def test_marks_are_next_to_a_block() -> None:
    """A mark that no fence follows would silently mark nothing."""
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if MARK.search(line):
                following = lines[number + 1] if number + 1 < len(lines) else ""
                assert following.lstrip().startswith("```"), (
                    f"{page.relative_to(ROOT)}:{number + 1}: a mark must be on the line "
                    "directly above a fence"
                )


def test_the_substitution_reaches_the_examples() -> None:
    """Runnable examples name the model by the alias the suite replaces (a model named
    otherwise would run the real one, or fail offline)."""
    named = [
        block.where
        for page in pages()
        for block in blocks(page)
        if block.mark is None and re.search(r"SmolLM2-135M|gemma3-270m", block.code)
    ]
    assert not named, f"runnable examples naming another model: {named}"
