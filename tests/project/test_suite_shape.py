"""The suite's own shape, kept by a test: test files live in the folders of their half
(layout, vocabulary, glue, distributed, cli, project), shared helpers in the helper package
tests/support/ (and nowhere else: a module of tests/ outside it is a ``test_*.py``, a
conftest.py or an ``__init__.py``), so no test file imports another test file;
every test file holds tests; and only the verifier's own tests import the verifier
(``cpslice._verify*``, which may move), so the rest of the suite never depends on it; and
no test sets an attribute of cpslice's own modules (docs/dev/instrumentation.md)."""

import ast
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {"layout", "vocabulary", "glue", "distributed", "cli", "project"}
SUPPORT = TESTS / "support"
"""The helper package: every module of the suite that is not a test file, a conftest.py or
a package's ``__init__.py``."""
VERIFIER_TESTS = {"test_cli_verify.py", "_verify_ranks.py", "test_verify_oracle.py"}


@functools.cache
def parsed(source: str) -> tuple[ast.Module, tuple[ast.AST, ...]]:
    """A source's tree and every node of it (``ast.walk``), each source parsed once for
    the whole module's tests (they read the same files)."""
    tree = ast.parse(source)
    return tree, tuple(ast.walk(tree))


def imported(source: str, package: str = "tests") -> set[str]:
    """Every module a source imports anywhere (function bodies too), by its full name,
    a module of tests/ as ``tests.name`` (``package``: the importing file's package);
    ``from package import name`` counts both ``package`` and ``package.name``, which may
    be a module."""
    found: set[str] = set()
    for node in parsed(source)[1]:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(filter(None, [*base, node.module or ""]))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_import_reader_sees_every_form() -> None:
    source = """
import tests.test_a
from tests.test_b import x
from tests import test_c
from .test_d import y
from . import test_e, helper
import cpslice._verify as v

def later():
    from .test_f import z
"""
    names = imported(source)
    assert {"tests.test_a", "tests.test_b", "tests.test_c", "tests.test_d", "tests.test_e",
            "tests.test_f", "tests.helper", "cpslice._verify"} <= names
    assert "tests.test_g" not in names


def module_of(path: Path) -> str:
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def test_every_test_file_sits_in_a_folder_of_its_half() -> None:
    loose = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert loose == [], "move these into a folder of tests/: " + ", ".join(loose)
    folders = {path.parent.name for path in TESTS.rglob("test_*.py")}
    assert folders == FOLDERS, sorted(folders ^ FOLDERS)


def loose_helpers(tests: Path) -> list[str]:
    """The modules under ``tests`` (a folder laid out as tests/) that are neither a test
    file, a conftest.py nor an ``__init__.py``, outside its support/ package."""
    return sorted(path.relative_to(tests).as_posix() for path in tests.rglob("*.py")
                  if not path.is_relative_to(tests / "support")
                  and not path.name.startswith("test_")
                  and path.name not in ("conftest.py", "__init__.py"))


def test_the_helper_reader_sees_every_loose_helper(tmp_path: Path) -> None:
    for name in ("__init__.py", "conftest.py", "test_a.py", "helper.py", "layout/__init__.py",
                 "layout/test_b.py", "layout/cases.py", "support/__init__.py", "support/oracle.py",
                 "support/deep/reference.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert loose_helpers(tmp_path) == ["helper.py", "layout/cases.py"]


def test_every_helper_module_lives_in_the_support_package() -> None:
    """A module the tests share goes to tests/support/ (``from ..support.name import
    ...``), not beside the tests, so that tests/ and its folders hold tests alone."""
    loose = loose_helpers(TESTS)
    assert loose == [], "move these helpers into tests/support/ (git mv): " + ", ".join(loose)
    assert not list(SUPPORT.rglob("test_*.py")), "tests/support/ holds helpers, not tests"


def test_no_test_file_imports_another_test_file() -> None:
    test_files = sorted(TESTS.rglob("test_*.py"))
    modules = {module_of(path) for path in test_files}
    offenders = {path.name: sorted(imported(path.read_text(), module_of(path).rpartition(".")[0]) & modules)
                 for path in test_files}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_every_test_file_holds_tests() -> None:
    empty = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = parsed(path.read_text())[0]
        if not any(isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
                   or isinstance(node, ast.ClassDef) and node.name.startswith("Test")
                   for node in tree.body):
            empty.append(path.name)
    assert empty == []


def test_only_the_verifier_tests_import_the_verifier() -> None:
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        package = module_of(path).rpartition(".")[0]
        found = sorted(m for m in imported(path.read_text(), package) if m.startswith("cpslice._verify"))
        if found and path.name not in VERIFIER_TESTS:
            offenders[path.name] = found
    assert offenders == {}


def cpslice_patches(source: str) -> list[int]:
    """The lines where a source sets an attribute of cpslice's own state: ``setattr`` (a
    ``monkeypatch``'s too) or ``mock.patch``/``patch.object`` on a name bound to
    something imported from cpslice, or on a ``"cpslice...."`` path."""
    nodes = parsed(source)[1]
    bound: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cpslice":
            bound.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            bound.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] == "cpslice")
    found = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and node.args):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in ("setattr", "patch", "object", "setitem"):
            continue
        target = node.args[0]
        while isinstance(target, ast.Attribute):
            target = target.value
        if (isinstance(target, ast.Name) and target.id in bound) or (
                isinstance(target, ast.Constant) and str(target.value).startswith("cpslice")):
            found.append(node.lineno)
    return found


def test_the_patch_reader_sees_every_form() -> None:
    source = """
import cpslice
import cpslice._vocab.spec as spec
from cpslice._vocab.backends.triton import invariant as tri
from cpslice import _probe
import torch
def t(monkeypatch):
    monkeypatch.setattr(tri, "SCRATCH_BYTES", 1)
    setattr(spec, "TILE", 64)
    monkeypatch.setattr(cpslice._vocab.spec, "TILE", 64)
    mock.patch("cpslice._vocab.spec.TILE", 64)
    mock.patch.object(_probe, "active", None)
    monkeypatch.setattr(torch, "compile", None)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
"""
    assert cpslice_patches(source) == [8, 9, 10, 11, 12]


def test_no_test_patches_cpslice_state() -> None:
    """Tests choose backends by the public setting or the selection's seam and look inside
    through ``cpslice._probe`` (docs/dev/instrumentation.md), never by setting a module's
    attribute."""
    found = [f"{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
             for line in cpslice_patches(path.read_text())]
    assert found == [], "patches cpslice's state: " + ", ".join(found)


def make_rule(name: str) -> str:
    """The Makefile's variable or target ``name``: its definition and recipe, lines joined."""
    text = (TESTS.parent / "Makefile").read_text().replace("\\\n", " ")
    found = re.search(rf"^{re.escape(name)}\s*(?::=|:)(.*(?:\n\t.*)*)", text, re.M)
    assert found, f"the Makefile has no {name}"
    return found.group(1)


def test_make_test_fast_touches_every_area_and_make_test_runs_all() -> None:
    """``make test-fast``'s files exist and include every folder of the suite but
    distributed, one test on a gloo world (``run_distributed``) and the project's gates;
    ``make test`` runs the whole suite, unfiltered, and CI runs ``make test``."""
    fast = make_rule("FAST").split()
    assert all((TESTS.parent / path).exists() for path in fast), fast
    areas = {Path(path).relative_to("tests").parts[0] for path in fast}
    assert areas == FOLDERS - {"distributed"}, sorted(areas)
    assert "tests/project" in fast, "every gate that is not slow"
    files = [path for f in fast for path in ((TESTS.parent / f).rglob("test_*.py") if (TESTS.parent / f).is_dir()
                                             else [TESTS.parent / f])]
    assert any("run_distributed(" in path.read_text() for path in files), "no test on a gloo world"
    assert '-m "not slow" $(FAST)' in make_rule("test-fast")
    assert make_rule("test").split()[-1].endswith("pytest"), "make test runs every test"
    assert "make test\n" in (TESTS.parent / ".ci/run").read_text()
