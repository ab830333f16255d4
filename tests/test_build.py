"""BUILD declares every module (py_library srcs) and every test file (py_test)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY_DIRS = ("fo_jax", "pallas_kernels", "experiments")


def _read_build():
    """Evaluate BUILD with stand-ins for the Bazel rules; return (library srcs, test srcs)."""
    libraries, tests = [], []

    def py_library(name, srcs=(), **_):
        libraries.extend(srcs)

    def py_binary(name, srcs=(), **_):
        libraries.extend(srcs)

    def py_test(name, srcs=(), **_):
        tests.extend(srcs)

    def glob(*_, **__):
        raise AssertionError("BUILD must list files explicitly, not glob them")

    def package(**_):
        pass

    exec((ROOT / "BUILD").read_text(), {"py_library": py_library, "py_binary": py_binary,
                                        "py_test": py_test, "glob": glob, "package": package})
    return set(libraries), set(tests)


def test_every_module_and_test_is_declared():
    libraries, tests = _read_build()
    modules = {str(p.relative_to(ROOT)) for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py")}
    test_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert not modules - libraries, f"modules missing from BUILD: {sorted(modules - libraries)}"
    assert not test_files - tests, f"tests missing from BUILD: {sorted(test_files - tests)}"
    listed = libraries | tests
    gone = {f for f in listed if not (ROOT / f).exists()}
    assert not gone, f"BUILD lists files that do not exist: {sorted(gone)}"


def test_test_files_have_distinct_names():
    """pytest imports test modules by basename (the test folders are not packages): two files
    of one name in different folders stop the whole run with "import file mismatch"."""
    import collections
    import pathlib

    root = pathlib.Path(__file__).parent
    names = collections.Counter(p.name for p in root.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], names.most_common(3)


def test_docs_pages_are_declared():
    """BUILD's DOCS_PAGES (the data of the docs and README tests) lists README.md and every
    page under docs/, and nothing else."""
    namespace = {name: (lambda *_, **__: None) for name in ("py_library", "py_binary",
                                                             "py_test", "glob", "package")}
    exec((ROOT / "BUILD").read_text(), namespace)
    pages = {"README.md"} | {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert set(namespace["DOCS_PAGES"]) == pages, set(namespace["DOCS_PAGES"]) ^ pages
