"""The code blocks of README.md and of the docs pages work as written.

Every ```python block runs (the blocks of one page in order, in one namespace, so a later block
may use what an earlier one defined). Every `fo-jax` command of a ```bash / ```sh block is
parsed by the command's own argument parser (not run). A block whose fence follows a
`<!-- skip: reason -->` line does not run: keep those few (a server that must be running, a
machine with 8 devices).
"""

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP = re.compile(r"^<!-- skip: \S.* -->$")
SHELLS = ("bash", "sh", "shell", "console")
MAX_SKIPPED = 4
BUILT = {"fo_jax/offload/ffi/lib/"}  # named by the pages, made by a build command


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: pathlib.Path):
    """Yield (language, first line number, code, skipped) for each fenced block of `page`."""
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        match = re.match(r"^(`{3,})(.*)$", lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.groups()
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != fence:
            end += 1
        assert end < len(lines), f"{_name(page)}:{i + 1}: the code block is never closed"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        yield info.strip(), i + 2, "\n".join(lines[i + 1:end]) + "\n", bool(SKIP.match(before))
        i = end + 1


def _python_pages():
    return [p for p in PAGES if any(lang == "python" and not skipped
                                    for lang, _, _, skipped in blocks(p))]


def test_pages_are_found():
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 10, PAGES


@pytest.mark.parametrize("page", _python_pages(), ids=_name)
def test_python_blocks_run(page, capsys):
    namespace = {"__name__": "__main__"}
    for lang, line, code, skipped in blocks(page):
        if lang == "python" and not skipped:
            # Pad so that a traceback names the page's own line numbers.
            exec(compile("\n" * (line - 1) + code, _name(page), "exec"), namespace)
    assert capsys.readouterr().out.strip(), f"{_name(page)}: its examples print nothing"


def test_python_blocks_are_marked_python():
    """A ```py or ```python3 block would escape the test above: every Python block says
    `python`, and skips stay few and say why."""
    skipped, bad = [], []
    for page in PAGES:
        for lang, line, _, skip in blocks(page):
            if lang.split(" ")[0] in ("py", "python3", "pycon", "ipython"):
                bad.append(f"{_name(page)}:{line}: ```{lang}")
            if skip:
                skipped.append(f"{_name(page)}:{line}")
    assert not bad, bad
    assert len(skipped) <= MAX_SKIPPED, skipped


def commands(code: str):
    """Yield the argument lists of the `fo-jax` commands in a shell block."""
    logical, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", code).split("\n"):
        pending += line
        try:  # a quoted string may span lines: take the next line too
            logical.append(shlex.split(pending, comments=True))
            pending = ""
        except ValueError:
            pending += "\n"
    assert not pending, f"an unclosed quote in {code!r}"
    for words in logical:
        start = 0
        for k, word in enumerate(words + [";"]):
            if word in ("&&", "||", ";", "|") or k == len(words):
                command = words[start:k]
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command = command[1:]  # VAR=value prefixes
                if command and command[0].endswith("fo-jax"):
                    yield command[1:]
                start = k + 1


def test_shell_commands_parse():
    from fo_jax.cli import _build_parser

    parser = _build_parser()
    parsed, failed = 0, []
    for page in PAGES:
        for lang, line, code, skipped in blocks(page):
            if lang not in SHELLS or skipped:
                continue
            for argv in commands(code):
                try:
                    parser.parse_args(argv)
                    parsed += 1
                except SystemExit:
                    failed.append(f"{_name(page)}:{line}: fo-jax {shlex.join(argv)}")
    assert not failed, "commands the fo-jax parser refuses:\n" + "\n".join(failed)
    assert parsed >= 20, f"only {parsed} fo-jax commands found"


def test_command_finder():
    code = ("fo-jax generate --offload  # a comment\n"
            "XLA_FLAGS=--x=8 \\\n  fo-jax serve --seats 2 && curl -s localhost\n"
            "python -m pip install fo-jax-not\n")
    assert list(commands(code)) == [["generate", "--offload"], ["serve", "--seats", "2"]]


def test_readme_links_resolve():
    """Every relative link of README.md (the docs pages, the results files) names a file that
    exists; the docs build checks the links between docs pages."""
    text = (ROOT / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text) if "://" not in t]
    assert len(links) > 10, links
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, missing


def test_named_files_exist():
    """Every file or folder of the repository that README.md or a docs page names (scripts,
    tests, results files) exists, so a moved script or results file shows up here."""
    path = re.compile(r"(?<![\w/.])((?:experiments|tests|fo_jax|pallas_kernels|docs)/"
                      r"(?:[\w.-]+/)*(?:[\w.-]*\w\.(?:py|sh|jsonl|json|png|log|npz)\b|(?=[`\s),;])))")
    named, missing = 0, []
    for page in PAGES:
        for match in path.finditer(page.read_text()):
            named += 1
            if not (ROOT / match.group(1)).exists() and match.group(1) not in BUILT:
                missing.append(f"{_name(page)}: {match.group(1)}")
    assert named > 100, named
    assert not missing, "named but not in the repository:\n" + "\n".join(sorted(set(missing)))
