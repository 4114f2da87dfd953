"""The docs site: it builds with ``mkdocs build --strict``, its generated reference lists
every option and environment variable, the docs carry no development notes, and the
built site works in headless Chromium (navigation, search, code blocks; a screenshot).

The browser test needs Debian's ``chromium`` (``/usr/bin/chromium``) and the
``playwright`` package (driving that Chromium; no browser download). Without Chromium it
skips, unless ``LLM_OPERATOR_BROWSER_TESTS=1`` (set by CI, which installs it).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# development notes the docs must not carry: issue numbers, sessions, how code was built
NOTES = re.compile(
    r"\bissues?\s*#?\d+|\bissue\d+|#\d{1,3}\b(?![0-9a-f])|\bthis session\b|\bno device was lent\b"
    r"|\bwas built without\b|\bin CI\b.*\b\d+ ?(?:min|s)\b",
    re.IGNORECASE,
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs-material (make setup-test)")
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    return out


def page_text(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text(encoding="utf-8")


def test_every_option_is_in_the_reference(site: Path) -> None:
    from llm_operator.options import OPTIONS

    html = page_text(site, "reference/options")
    missing = [o.name for o in OPTIONS if f"<code>{o.name}</code>" not in html]
    assert not missing, f"options missing from the reference: {missing}"
    assert all(o.doc.strip() for o in OPTIONS)


def test_every_variable_is_in_the_reference(site: Path) -> None:
    from llm_operator import reference
    from llm_operator.environment import VARIABLES

    assert reference.undocumented_variables(ROOT) == {}
    html = page_text(site, "reference/environment")
    missing = [v.name for v in VARIABLES if f"<code>{v.name}</code>" not in html]
    assert not missing


def test_the_variable_scan_finds_reads(tmp_path: Path) -> None:
    """The scan behind the environment page sees each way code reads a variable."""
    from llm_operator.reference import variables_read

    source = tmp_path / "module.py"
    source.write_text(
        "import os\nNAME = 'FROM_CONSTANT'\n"
        "a = os.environ['SUBSCRIPT']\nb = os.environ.get('GET')\n"
        "os.environ.setdefault('SETDEFAULT', '1')\nc = os.getenv('GETENV')\n"
        "d = os.environ.get(NAME)\n"
        "def f(environ=None):\n    return (os.environ if environ is None else environ).get('PICKED')\n"
        "e = {'NOT_AN_ENV': 1}.get('NOT_AN_ENV')\n",
        encoding="utf-8",
    )
    assert variables_read(source) == {
        "SUBSCRIPT", "GET", "SETDEFAULT", "GETENV", "FROM_CONSTANT", "PICKED"
    }  # fmt: skip


def test_every_nav_page_is_built(site: Path) -> None:
    import yaml

    def entries(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from entries(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from entries(value)

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = list(entries(config["nav"]))
    assert len(pages) >= 20
    for page in pages:
        built = site / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert built.exists(), page
        assert "</article>" in built.read_text(encoding="utf-8"), page


def _texts() -> list[Path]:
    found = [ROOT / "README.md"]
    found += sorted(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".json"))
    for folder in ("llm_operator", "integrations", "kernels", "llm_operator_bench", "examples"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return found


def test_no_development_notes() -> None:
    """No issue numbers, sessions or remarks on how the code was written in the docs,
    the result files (names and contents), docstrings or CLI output."""
    hits = []
    for path in _texts():
        relative = path.relative_to(ROOT)
        if NOTES.search(str(relative)):
            hits.append(f"{relative}: in the file name")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = NOTES.search(line)
            if match:
                hits.append(f"{relative}:{number}: {match.group(0)!r}")
    assert not hits, "development notes in the docs or code:\n" + "\n".join(hits[:40])


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"


# -- the built site in a browser ----------------------------------------------------------
@pytest.fixture(scope="module")
def served(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("LLM_OPERATOR_BROWSER_TESTS") == "1":
            pytest.fail(f"LLM_OPERATOR_BROWSER_TESTS=1 but no Chromium at {CHROMIUM}")
        pytest.skip("no Chromium (apt-get install chromium); CI installs it")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def test_site_in_a_browser(served: str, browser, tmp_path: Path) -> None:
    """Navigation, search and a highlighted code block render; one screenshot."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{served}/quickstart/", wait_until="networkidle")

    # navigation: the sections and their pages are links
    nav = page.locator("nav.md-nav--primary a.md-nav__link")
    titles = [text.strip() for text in nav.all_inner_texts()]
    for title in ("Quickstart", "Spark", "Dask", "Options", "Benchmarks"):
        assert any(title in text for text in titles), (title, titles)

    # code blocks: highlighted (tokens in spans) and with the copy button
    code = page.locator(".highlight code").first
    assert code.is_visible()
    assert code.locator("span").count() > 5
    assert page.locator("button[title='Copy to clipboard']").count() > 0

    # a screenshot of the page as a reader sees it
    shot = tmp_path / "quickstart.png"
    page.screenshot(path=str(shot))
    _check_screenshot(shot)

    # search: the index loads in a web worker and answers
    search = page.locator("input.md-search__input")
    search.click()
    search.press_sequentially("kv_cache_memory", delay=20)  # the search listens to keys
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=30_000)
    assert results.count() > 0
    assert "kv_cache_memory" in page.locator(".md-search-result").inner_text()

    # a link of the navigation leads to its page
    page.goto(f"{served}/reference/options/", wait_until="networkidle")
    assert page.locator("h1").first.inner_text().strip().rstrip("¶") == "Options"
    assert page.locator("table").count() >= 3
    assert not errors, errors
    page.close()


def _check_screenshot(path: Path) -> None:
    """A real render: a page-sized PNG with text-like variety, not a blank or error page."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.size == (1280, 900)
        gray = image.convert("L")
        histogram = gray.histogram()
    dark = sum(histogram[:128]) / sum(histogram)
    levels = sum(1 for count in histogram if count)
    assert 0.005 < dark < 0.6, f"{dark:.3f} of the pixels are dark"
    assert levels > 30, f"only {levels} gray levels"
