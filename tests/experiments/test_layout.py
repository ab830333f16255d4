"""The experiments' layout: a package of one subpackage per question, run as modules (no
`sys.path` edits), every script listed in the index page (docs/experiments.md) with its
command, and every `python -m experiments...` that the README or a docs page names exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
INDEX = ROOT / "docs" / "experiments.md"
GROUPS = {"decode", "serving", "traces", "accelerator", "training", "parallel"}


def _scripts():
    return sorted(p for p in EXPERIMENTS.glob("*/*") if p.suffix in (".py", ".sh")
                  and p.name != "__init__.py" and p.parent.name in GROUPS)


def test_no_sys_path_edits():
    edits = [f"{p.relative_to(ROOT)}:{i}" for p in EXPERIMENTS.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "sys.path.insert" in line or "sys.path.append" in line]
    assert not edits, edits


def test_one_package_per_question():
    assert (EXPERIMENTS / "__init__.py").exists()
    folders = {p.name for p in EXPERIMENTS.iterdir() if p.is_dir()
               and p.name not in ("results", "__pycache__")}
    assert folders == GROUPS, folders
    assert all((EXPERIMENTS / g / "__init__.py").exists() for g in GROUPS)
    assert not [p.name for p in EXPERIMENTS.glob("*.py")
                if p.name not in ("__init__.py", "common.py")], "a script outside the groups"


def test_index_lists_every_script():
    text = INDEX.read_text()
    scripts = _scripts()
    assert len(scripts) > 25
    missing = []
    for p in scripts:
        group, name = p.parent.name, p.stem
        named = (f"-m experiments.{group}.{name}" if p.suffix == ".py"
                 else f"experiments/{group}/{p.name}")
        if named not in text:
            missing.append(named)
    assert not missing, missing


def test_named_modules_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted(EXPERIMENTS.rglob("*.py")), *sorted(EXPERIMENTS.rglob("*.sh"))]
    named, missing = 0, []
    for page in pages:
        for group, name in re.findall(r"experiments\.(\w+)\.(\w+)", page.read_text()):
            named += 1
            if not (EXPERIMENTS / group / f"{name}.py").exists():
                missing.append(f"{page.relative_to(ROOT)}: experiments.{group}.{name}")
    assert named > 30, named
    assert not missing, missing
