"""Sphinx configuration of the fo_jax documentation (MyST Markdown pages, API from docstrings).

Build: ``sphinx-build -W --keep-going -b html docs OUT`` (tests/test_docs.py runs it).
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "fo_jax"
author = "fo_jax authors"
copyright = "fo_jax authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = "fo_jax"

# The docstrings are prose with Google-style sections; signatures carry the types.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
# Backticks in docstrings are code, not cross-references to resolve.
default_role = "code"
napoleon_use_ivar = True

# The docstrings are plain text with Markdown-style backticks: indented lines (examples, aligned
# tables, hanging indents) are meant as they are typed. After napoleon has turned the Google
# sections into fields, every indented block that reStructuredText would not take as a field,
# list item or directive body is made a literal block, set off by blank lines, and a backtick
# span followed by a letter ("`Engine`s") gets the escaped space reStructuredText needs.

import re  # noqa: E402

_TAKES_INDENTED = re.compile(r"^\s*(:|\.\. |[*+-] |\d+\. |#\. )")
_GLUED_BACKTICK = re.compile(r"(`[^`\s][^`]*`)(?=[A-Za-z0-9(])")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def literal_blocks(lines: list[str]) -> list[str]:
    """Return the docstring `lines` with indented plain-text blocks made literal blocks."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        indented = (line.strip() and j < len(lines) and _indent(lines[j]) > _indent(line)
                    and not _TAKES_INDENTED.match(line) and not line.rstrip().endswith("::"))
        if not indented:
            out.append(_GLUED_BACKTICK.sub(r"\1\\ ", line) if line.strip() else line)
            i += 1
            continue
        out += [_GLUED_BACKTICK.sub(r"\1\\ ", line) + " ::", ""]
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > _indent(line)):
            k += 1
        block = lines[j:k]
        while block and not block[-1].strip():
            block.pop()
        out += block + [""]
        i = k
    return out


def _process_docstring(app, what, name, obj, options, lines):
    lines[:] = literal_blocks(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring, priority=600)
