"""The code blocks of README.md and of the docs pages work as written.

Every ```python block runs (the blocks of one page in order, in one namespace, so a later block
may use what an earlier one defined). Every `fo-jax` command of a ```bash / ```sh block is
parsed by the command's own argument parser (not run), and so is every `python -m experiments...`
/ `python -m fo_jax...` command there: the module is run as __main__ only until its argparse
parser has parsed the arguments; the same for such commands written as inline code in the text
(a results table's "how it was run"). A block whose fence follows a
`<!-- skip: reason -->` line does not run: keep those few (a server that must be running, a
machine with 8 devices).
"""

import argparse
import importlib.util
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
import warnings

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


REDIRECT = re.compile(r"^(\d*|&)(>>?|<)")  # > f, 2>> f, < f, >f, 2>&1, &> f


def shell_commands(code: str):
    """Yield the word lists of the simple commands of a shell block: lines joined at `\\`,
    comments dropped, split at `&&` / `||` / `;` / `|` / `&`, without `VAR=value` prefixes and
    redirections."""
    logical, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", code).split("\n"):
        pending += line
        try:  # a quoted string may span lines: take the next line too
            words = shlex.split(pending, comments=True)
            # `a; b`: shlex keeps the `;` on the word before it
            logical.append([part for w in words for part in
                            ([w[:-1], ";"] if len(w) > 1 and w.endswith(";") else [w])])
            pending = ""
        except ValueError:
            pending += "\n"
    assert not pending, f"an unclosed quote in {code!r}"
    for words in logical:
        start = 0
        for k, word in enumerate(words + [";"]):
            if word in ("&&", "||", ";", "|", "&") or k == len(words):
                command, rest = [], iter(words[start:k])
                for w in rest:
                    if not REDIRECT.match(w):
                        command.append(w)
                    elif REDIRECT.sub("", w) == "":
                        next(rest, None)  # its target is the next word
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command = command[1:]  # VAR=value prefixes
                if command:
                    yield command
                start = k + 1


def commands(code: str):
    """Yield the argument lists of the `fo-jax` commands in a shell block."""
    for command in shell_commands(code):
        if command[0].endswith("fo-jax"):
            yield command[1:]


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


PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
OWN = ("experiments", "fo_jax", "docs")  # the project's modules and scripts
LAUNCHERS = ("fo_jax.distributed",)  # `... -- ARGS` runs `python ARGS`: checked too
NO_ARG_FLAGS = ("-u", "-B", "-O", "-OO", "-s", "-S", "-E", "-I")


def _python(words):
    """(kind, target, args) of the project's module or script that `python WORDS` runs."""
    while words and (words[0] in NO_ARG_FLAGS or words[0] in ("-X", "-W")):
        words = words[2:] if words[0] in ("-X", "-W") else words[1:]
    if words[:1] == ["-m"] and len(words) > 1 and words[1].split(".")[0] in OWN:
        yield "module", words[1], words[2:]
        if words[1] in LAUNCHERS and "--" in words:
            yield from _python(words[words.index("--") + 1:])
    elif words and words[0].endswith(".py") and words[0].split("/")[0] in OWN:
        yield "script", words[0], words[1:]


def project_commands(code: str):
    """Yield (kind, target, args) for each command of a shell block that runs the project's own
    code: `python -m experiments.x.y ARGS` / `python -m fo_jax.z ARGS` ("module"), `python
    docs/x.py ARGS` ("script"), `bash experiments/x.sh` ("bash")."""
    for command in shell_commands(code):
        if PYTHON.search(command[0]):
            yield from _python(command[1:])
        elif command[0] in ("bash", "sh") and command[1:] and command[1].split("/")[0] in OWN:
            yield "bash", command[1], command[2:]


class _Parsed(Exception):
    """Raised by the patched parse_args once the arguments parsed: the script stops there."""


def _parse_only(kind: str, target: str, argv: list, monkeypatch) -> str | None:
    """Run module or script `target` as __main__ under `argv` until its argparse parser has
    parsed them, not further: None when they parse, else why not."""
    if kind == "bash":
        if not (ROOT / target).is_file():
            return "no such script"
        result = subprocess.run(["bash", "-n", str(ROOT / target)], capture_output=True, text=True)
        return f"bash -n refuses it: {result.stderr.strip()}" if result.returncode else None
    real, called = argparse.ArgumentParser.parse_args, []

    def parse_args(self, args=None, namespace=None):
        called.append(self.prog)
        real(self, args, namespace)
        raise _Parsed

    environ = dict(os.environ)
    try:
        with monkeypatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: already imported
            patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
            patch.setattr(sys, "argv", [target, *argv])
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / target), run_name="__main__")
    except _Parsed:
        return None
    except ImportError as e:
        return f"cannot be imported: {e}"
    except SystemExit as e:
        if called:
            return None if e.code in (0, None) else "its parser refuses the arguments"
        return f"exits ({e.code}) before it parses its arguments"
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return ("it ran to the end without calling argparse's parse_args: parse its arguments "
            "with argparse, or check this command another way")


def _check_commands(found, monkeypatch, capsys):
    """Check each (page:line, (kind, target, args)) of `found`: the count and the failures."""
    checked, failed = 0, []
    for where, (kind, target, argv) in found:
        why = _parse_only(kind, target, argv, monkeypatch)
        error = capsys.readouterr().err.strip().split("\n")[-1]
        checked += 1
        if why:
            shown = f"python -m {target}" if kind == "module" else f"{kind} {target}"
            failed.append(f"{where}: {shown} {shlex.join(argv)}: {why}"
                          + (f" ({error})" if error else ""))
    return checked, failed


def test_project_commands_parse(monkeypatch, capsys):
    """Every `python -m experiments...` / `python -m fo_jax...` command (and `python
    docs/x.py`, `bash experiments/x.sh`) of a shell block names a module or file that exists,
    and the script's own argparse parser takes its arguments; nothing runs past the parse."""
    found = [(f"{_name(page)}:{line}", command)
             for page in PAGES for lang, line, code, skipped in blocks(page)
             if lang in SHELLS and not skipped for command in project_commands(code)]
    checked, failed = _check_commands(found, monkeypatch, capsys)
    assert not failed, "project commands that do not parse:\n" + "\n".join(failed)
    assert checked >= 25, f"only {checked} project commands found"


INLINE = re.compile(r"(?<!`)`(python -m [^`]+)`(?!`)")
FENCED = re.compile(r"^(`{3,}).*?^\1[ \t]*$", re.M | re.S)
NEEDS = {"experiments.training.make_parity_fixtures": ("torch", "transformers")}  # not in [test]


def inline_commands(text: str):
    """Yield (kind, target, args) of each whole `python -m ...` command written as an inline
    code span (in prose or a table) outside the code blocks; a span with `...` elides arguments
    and is left out, and so is a module whose extra packages are not installed (NEEDS)."""
    for match in INLINE.finditer(FENCED.sub("", text).replace("\n", " ")):
        if "..." not in match.group(1):
            for kind, target, argv in _python(shlex.split(match.group(1))[1:]):
                if all(importlib.util.find_spec(p) for p in NEEDS.get(target, ())):
                    yield kind, target, argv


def test_inline_commands_parse(monkeypatch, capsys):
    """The same for the commands written inline: the results tables' "how it was run" and the
    experiments page's table, which a reader copies as they are."""
    found = [(_name(page), command) for page in PAGES
             for command in inline_commands(page.read_text())]
    checked, failed = _check_commands(found, monkeypatch, capsys)
    assert not failed, "inline commands that do not parse:\n" + "\n".join(failed)
    assert checked >= 40, f"only {checked} inline commands found"


def test_inline_command_finder():
    text = ("Run `python -m experiments.a --n 1\n--m 2`, not `python -m experiments.b --x ...`.\n"
            "```bash\n`python -m experiments.c`\n```\n| `python -m fo_jax.d cpu` |\n")
    assert list(inline_commands(text)) == [("module", "experiments.a", ["--n", "1", "--m", "2"]),
                                           ("module", "fo_jax.d", ["cpu"])]


def test_project_command_finder():
    code = ("python -m experiments.a.b --x 1 \\\n    --y 2 > out.log 2>&1  # a comment\n"
            "XLA_FLAGS=--x=8 python3 -u -m fo_jax.z cuda && python -m experiments.c | tee f\n"
            ".venv/bin/python -m pytest -q tests && python -m pip install x\n"
            "python -m fo_jax.distributed launch --processes 2 -- -m experiments.d --out /tmp/d\n"
            "python docs/results.py --check >>log; OUT=o bash experiments/e.sh; bash -c ls\n")
    assert list(project_commands(code)) == [
        ("module", "experiments.a.b", ["--x", "1", "--y", "2"]),
        ("module", "fo_jax.z", ["cuda"]), ("module", "experiments.c", []),
        ("module", "fo_jax.distributed", ["launch", "--processes", "2", "--", "-m",
                                          "experiments.d", "--out", "/tmp/d"]),
        ("module", "experiments.d", ["--out", "/tmp/d"]),
        ("script", "docs/results.py", ["--check"]), ("bash", "experiments/e.sh", [])]


def test_parse_only(tmp_path, monkeypatch):
    """The check stops a script right after its parse, reports a refused flag, and fails a
    script that never parses its arguments (it would otherwise have run in full)."""
    parses = ("import argparse, pathlib\n"
              "p = argparse.ArgumentParser()\np.add_argument('--n', type=int)\n"
              "p.parse_args()\npathlib.Path(__file__).with_name('ran').touch()\n")
    (tmp_path / "parses_args.py").write_text(parses)
    (tmp_path / "never_parses.py").write_text("print('working')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _parse_only("module", "parses_args", ["--n", "3"], monkeypatch) is None
    assert not (tmp_path / "ran").exists()  # stopped right after the parse
    assert _parse_only("module", "parses_args", ["--m", "3"], monkeypatch) == \
        "its parser refuses the arguments"
    assert "without calling argparse's parse_args" in _parse_only(
        "module", "never_parses", [], monkeypatch)
    assert _parse_only("module", "no_such_module_here", [], monkeypatch).startswith(
        "cannot be imported")
    assert _parse_only("bash", "experiments/no_such.sh", [], monkeypatch) == "no such script"


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
