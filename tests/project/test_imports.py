"""What ``import cpslice`` does: it imports no module that it does not need, and there
is no import cycle among cpslice's modules.

``import cpslice`` loads neither ``torch._dynamo`` (``torch.compile`` imports it, and
the planning boundaries decide at each call: ``_cache.boundary``), nor megatron-core
(``Layout.from_parallel_state`` imports it), nor beartype outside debug mode: each in a
fresh interpreter, where nothing else imported them. How long the import takes is
``benchmarks/bench_import.py``'s, not a test's.

Every module under ``src/cpslice`` is parsed (not imported) and every import
statement in it counts, wherever it sits: at module level, inside a function or
under ``if TYPE_CHECKING:``. A function-level import hides a cycle from the
interpreter, not from the design: the two modules still need each other.

Edges: ``import cpslice.a.b`` and ``from cpslice.a.b import x`` (or the relative
forms) go to ``cpslice.a.b``, and to ``cpslice.a.b.x`` instead when ``x`` is a
submodule there; ``from . import x`` goes to submodule ``x`` when it is one, else
to the package. Loading a submodule runs its packages' ``__init__``, but that is no
edge: an ``__init__`` that imports its submodules is no cycle.
"""

import ast
import os
import sys
from pathlib import Path

import pytest

from ..support import background
from ..support.background import Job

SRC = Path(__file__).resolve().parents[2] / "src"

Graph = dict[str, set[str]]

HEAVY = ("torch._dynamo", "megatron", "beartype")
LOADED = f"""
import sys
import cpslice
print(" ".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def module_names(src: Path) -> dict[str, Path]:
    """``cpslice.x.y`` -> its file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted((src / "cpslice").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The cpslice modules that module ``name`` (at ``path``) imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def import_graph(src: Path) -> Graph:
    names = module_names(src)
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle() -> None:
    graph = import_graph(SRC)
    assert "cpslice" in graph and len(graph) > 10, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "cpslice"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from .sub import inner\n",
        "b.py": "import cpslice.sub.inner\nfrom . import a, VERSION\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cpslice.b import x\n",
        "sub/__init__.py": "from .inner import thing\nfrom .. import c\n",
        "sub/inner.py": "import torch\nfrom ... import outside\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert import_graph(tmp_path) == {
        "cpslice": {"cpslice.a"},
        "cpslice.a": {"cpslice.sub.inner"},
        "cpslice.b": {"cpslice.sub.inner", "cpslice.a", "cpslice"},  # VERSION: the package's
        "cpslice.c": {"cpslice.b"},
        "cpslice.sub": {"cpslice.sub.inner", "cpslice.c"},
        "cpslice.sub.inner": set(),
    }
    assert find_cycle(import_graph(tmp_path)) is None
    (pkg / "b.py").write_text("def g():\n    from .c import y\n")
    assert find_cycle(import_graph(tmp_path)) == ["cpslice.b", "cpslice.c", "cpslice.b"]


# The two halves of docs/dev/architecture.md, each a package, and what both may import.
# Every other module (the glue, the command line, the verifier, the package) may import
# anything.
LAYOUT = "cpslice._layout"
VOCAB = "cpslice._vocab"
GLUE = "cpslice._glue"
SHARED = {f"cpslice.{m}" for m in ("_checks", "_errors", "_types", "_cache", "_probe")}
OUTSIDE = {"cpslice", "cpslice.__main__", "cpslice._debug"}
OUTSIDE_PACKAGES = ("cpslice._cli", "cpslice._verify")


def _in(package: str, name: str) -> bool:
    return name == package or name.startswith(package + ".")


def _in_vocab(name: str) -> bool:
    return _in(VOCAB, name)


def reachable(graph: Graph, start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others, with one import path
    ``[start, ..., module]`` to each."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph[node]):
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                todo.append(nxt)
    del paths[start]
    return paths


def half_violations(graph: Graph) -> list[str]:
    """Each import path by which a ``_vocab`` module reaches a layout module, a layout
    module reaches ``_vocab``, or a shared module reaches either half or the glue."""
    found = []
    layout = {m for m in graph if _in(LAYOUT, m)}
    glue = {m for m in graph if _in(GLUE, m)}
    vocab = {m for m in graph if _in_vocab(m)}
    for name in sorted(graph):
        if name in vocab:
            banned = layout | glue
        elif name in layout:
            banned = vocab | glue
        elif name in SHARED:
            banned = layout | glue | vocab
        else:
            continue
        for target, path in sorted(reachable(graph, name).items()):
            if target in banned:
                found.append(" -> ".join(path))
    return found


def test_every_module_has_a_place() -> None:
    """A new module joins a half, the shared modules, the glue or the outside here, so
    that the test below covers it."""
    graph = import_graph(SRC)
    unplaced = {
        m for m in graph
        if m not in SHARED | OUTSIDE and not any(_in(p, m) for p in (LAYOUT, VOCAB, GLUE, *OUTSIDE_PACKAGES))
    }
    assert not unplaced, f"place these modules in tests/project/test_imports.py: {sorted(unplaced)}"
    assert ({LAYOUT, VOCAB, GLUE} | SHARED) <= set(graph), sorted(({LAYOUT, VOCAB, GLUE} | SHARED) - set(graph))


def test_the_halves_do_not_import_each_other() -> None:
    """No ``_vocab`` module imports a layout module (or the glue), directly or through
    others; no layout module imports ``_vocab`` (or the glue); the shared modules import
    neither half."""
    violations = half_violations(import_graph(SRC))
    assert not violations, "imports across the halves:\n" + "\n".join(violations)


def test_a_path_across_the_halves_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "cpslice"
    for sub in ("_vocab", "_layout", "_glue"):
        (pkg / sub).mkdir(parents=True)
    files = {
        "__init__.py": "",
        "_types.py": "",
        "_layout/__init__.py": "",
        "_layout/plan.py": "from .._types import x\n",
        "_glue/__init__.py": "",
        "_glue/support.py": "from .._layout.plan import y\n",
        "_vocab/__init__.py": "",
        "_vocab/args.py": "from . import set_elements\n",
        "_vocab/set_elements.py": "def f():\n    from .. import _types\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert half_violations(import_graph(tmp_path)) == []
    # through the glue, inside a function: still a path from the engine to the layout
    (pkg / "_vocab" / "set_elements.py").write_text("def f():\n    from .._glue.support import Support\n")
    assert half_violations(import_graph(tmp_path)) == [
        "cpslice._vocab.args -> cpslice._vocab.set_elements -> cpslice._glue.support",
        "cpslice._vocab.args -> cpslice._vocab.set_elements -> cpslice._glue.support -> cpslice._layout.plan",
        "cpslice._vocab.set_elements -> cpslice._glue.support",
        "cpslice._vocab.set_elements -> cpslice._glue.support -> cpslice._layout.plan",
    ]
    (pkg / "_vocab" / "set_elements.py").write_text("")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._vocab import args\n"
    (pkg / "_types.py").write_text(type_only)
    assert half_violations(import_graph(tmp_path)) == [
        "cpslice._layout.plan -> cpslice._types -> cpslice._vocab.args",
        "cpslice._layout.plan -> cpslice._types -> cpslice._vocab.args -> cpslice._vocab.set_elements",
        "cpslice._types -> cpslice._vocab.args",
        "cpslice._types -> cpslice._vocab.args -> cpslice._vocab.set_elements",
    ]


DEBUGS = (None, "0", "1")


def _imports() -> dict[str, Job]:
    """``import cpslice`` in a fresh interpreter per ``CPSLICE_DEBUG`` (unset, each value)."""
    jobs = {}
    for debug in DEBUGS:
        env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
        if debug is not None:
            env["CPSLICE_DEBUG"] = debug
        jobs[str(debug)] = Job((sys.executable, "-c", LOADED), env, SRC.parent)
    return jobs


# seconds of imports each, run in the background beside the session (tests/support/background.py)
background.register("imports", ("tests/project/test_imports.py::test_the_import_loads",
                                "tests/project/test_imports.py::test_debug_mode_loads"), _imports)


def loaded_by_import(debug: str | None) -> set[str]:
    """The ``HEAVY`` modules in ``sys.modules`` after ``import cpslice`` in a fresh
    interpreter with ``CPSLICE_DEBUG`` unset or ``debug``."""
    proc = background.result("imports", timeout=200)[str(debug)]
    assert proc.code == 0, proc.err[-4000:]
    return set(proc.out.split())


@pytest.mark.parametrize("debug", DEBUGS[:2])
def test_the_import_loads_no_compiler_megatron_or_checker(debug: str | None) -> None:
    assert loaded_by_import(debug) == set()


def test_debug_mode_loads_the_checker() -> None:
    # and torch._dynamo, on purpose: cpslice/__init__.py loads it before the hook
    assert loaded_by_import("1") == {"beartype", "torch._dynamo"}
