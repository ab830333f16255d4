"""The layering of fo_jax holds: the import-linter contracts of pyproject.toml (layers, no cycle,
pallas_kernels a leaf) with no exemption, and no module uses another module's private name."""

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("fo_jax", "pallas_kernels")

# Modules the private-name check skips: none (every module is covered).
PRIVATE_NAME_TODO = ()


def test_import_contracts_hold():
    """`lint-imports` (import-linter) keeps every contract of pyproject.toml."""
    run = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
         "lint_imports_command()", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "0 broken" in run.stdout, run.stdout[-6000:]


def test_contracts_have_no_exemption_and_declare_every_module():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["id"]: c for c in config["contracts"]}
    assert {"fo_jax-layers", "kernels-leaf", "no-cycles"} <= set(contracts)
    for contract in contracts.values():
        assert not contract.get("ignore_imports"), f"{contract['id']} has exemptions"
    layers = contracts["fo_jax-layers"]
    assert layers["containers"] == ["fo_jax"] and layers["exhaustive"] is True
    assert layers["layers"][0] == "cli" and layers["layers"][1] == "server"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def private_name_uses(root: pathlib.Path, packages=PACKAGES, skip=()) -> list[str]:
    """"file:line: ..." for every use in `packages` under `root` of a private name (one leading
    underscore) of another module of those packages: `from m import _x`, or `m._x` where `m`
    names an imported module. (A private method called on an object is not seen.)"""
    files = sorted(p for package in packages for p in (root / package).rglob("*.py"))
    modules = {_module_name(p, root) for p in files}
    found = []
    for path in files:
        where = str(path.relative_to(root))
        if where in skip:
            continue
        me, is_package = _module_name(path, root), path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=where)
        aliases = {}  # local name -> the fo_jax / pallas_kernels module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in packages:
                        local = alias.asname or alias.name.split(".")[0]
                        aliases[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = me.split(".") if is_package else me.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                if not source or source.split(".")[0] not in packages:
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif _private(alias.name) and source != me:
                        found.append(f"{where}:{node.lineno}: imports {alias.name} from {source}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain = _dotted(node.value)
                if chain and chain[0] in aliases:
                    module = ".".join([aliases[chain[0]]] + chain[1:])
                    if module in modules and module != me:
                        found.append(f"{where}:{node.lineno}: uses {module}.{node.attr}")
    return sorted(set(found))


def test_no_private_name_is_used_across_modules():
    found = private_name_uses(ROOT, skip=PRIVATE_NAME_TODO)
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("from fo_jax.a import _hidden\n", "pkg.py:1: imports _hidden from fo_jax.a"),
    ("from .a import _hidden\n", "pkg.py:1: imports _hidden from fo_jax.a"),
    ("from fo_jax import a\n\na._hidden()\n", "pkg.py:3: uses fo_jax.a._hidden"),
    ("import fo_jax.a as m\n\nm._hidden\n", "pkg.py:3: uses fo_jax.a._hidden"),
    ("import fo_jax.a\n\nfo_jax.a._hidden\n", "pkg.py:3: uses fo_jax.a._hidden"),
])
def test_the_private_name_check_finds_each_form(tmp_path, source, expected):
    package = tmp_path / "fo_jax"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def _hidden():\n    pass\n\n\ndef _own():\n    _hidden()\n")
    (package / "pkg.py").write_text(source)
    assert private_name_uses(tmp_path, ("fo_jax",)) == [f"fo_jax/{expected}"]


def test_the_private_name_check_allows_public_and_dunder_names(tmp_path):
    package = tmp_path / "fo_jax"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "0"\n')
    (package / "a.py").write_text("def shown():\n    pass\n")
    (package / "b.py").write_text("import fo_jax\nfrom fo_jax import a\n\n"
                                  "a.shown()\nfo_jax.__version__\n")
    assert private_name_uses(tmp_path, ("fo_jax",)) == []
