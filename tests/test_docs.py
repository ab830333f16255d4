"""The documentation site builds with Sphinx with no warning (broken links and references,
docstring markup the API pages cannot render, a page left out of every table of contents)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_docs_build_without_warnings(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"sphinx-build failed:\n{run.stdout}\n{run.stderr}"
    assert not run.stderr.strip(), run.stderr
    api = (tmp_path / "html" / "api" / "engine.html").read_text()
    assert "add_request" in api, "the API reference lost Engine.add_request's docstring"


def test_docstring_blocks_become_literal():
    """conf.py's docstring hook turns indented plain-text blocks into literal blocks and leaves
    fields, list items and existing literal blocks alone."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import conf
    finally:
        sys.path.remove(str(ROOT / "docs"))
    lines = ["Example:", "    engine = Engine(...)", "    engine.run()", "Then `Engine`s run.",
             ":param x: first", "    more of x", "* item", "  continued", "Code::", "", "    kept"]
    assert conf.literal_blocks(lines) == [
        "Example: ::", "", "    engine = Engine(...)", "    engine.run()", "",
        "Then `Engine`\\ s run.", ":param x: first", "    more of x", "* item", "  continued",
        "Code::", "", "    kept"]


def test_results_tables_match_their_json_lines():
    """The benchmark tables between `<!-- results: NAME -->` markers (README and docs pages) are
    what docs/results.py makes of the results files (a retyped or stale figure fails)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import results
    finally:
        sys.path.remove(str(ROOT / "docs"))
    pages = [p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]]
    used = {name for page in pages for name in re.findall(r"<!-- results: (\w+) -->", page)}
    assert used == set(results.TABLES), (used ^ set(results.TABLES))  # every table shown
    assert results.main(["--check"]) == 0
