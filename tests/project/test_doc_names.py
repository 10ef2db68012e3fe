"""The docs name what exists: every module, file and dotted path that README.md, the
pages under docs/ or a docstring or comment of src/ names is there (CHANGELOG.md is
history: it may name what was). Read precisely, no near matches:

- a dotted path ``cpslice.x.y`` (or one that starts at a private module of the package,
  ``_vocab.backends.selection.using``, or at benchmarks, tests or examples): each part a
  package, module, or a name that module defines or imports (a class's methods and
  attributes too), read from the source, nothing imported;
- a file path with a ``/`` (``tests/support/oracle.py``, ``_layout/pieces.py``,
  ``triton/default.py``, ``docs/dev/``): a file or folder relative to the repository's
  root, to a package of src/cpslice/, or to the naming file's folder or one above it; a
  ``*`` in it is a pattern that must match at least one;
- a bare file name (``plan.py``, ``layouts.md``): a file of that name in the repository;
- a bare private name (``_plan``; on a page, in backticks): a module or package of
  cpslice; in a module of src/, also a name bound in that module or another of its
  folder (``EXTERNAL`` lists the few that belong to torch).
"""

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support._docs import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "cpslice"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TREES = ("src", "tests", "benchmarks", "examples", "docs", "typings", ".ci")
EXTERNAL = {
    "_context_parallel_buffers", "_generate_indices",  # torch.distributed.tensor.experimental's
    "_context_parallel_shard",
    "_api",  # torch.distributed.tensor._api, which defines DTensor
    "_at", "_from_hidden",  # the suffixes of a family of names (``log_probs_at``, ``..._from_hidden``)
}
FRAMEWORKS = ("areal", "nemo_rl", "slime", "trl", "verl", "megatron", "torch", "transformers", "liger_kernel")
"""The packages of the frameworks the recipes map (docs/recipes.md): a path that starts at
one of them (``verl/utils/torch_functional.py``) is theirs, not the repository's."""
FOREIGN_FILES = {"cp_utils.py"}
"""Files of those frameworks the recipes name bare (AReaL's ``cp_utils.py``)."""
"""Bare private names that are not cpslice's: torch's, or a suffix standing for a family."""

_DOTTED = re.compile(r"(?<![\w./-])(?:cpslice|benchmarks|tests|examples|_[a-z]\w*)(?:\.\w+)+")
_PATH = re.compile(r"(?<![\w./*<-])((?:\.\./|\./)?[\w.*-]+/[\w.*/-]*|[\w*-]+\.(?:py|md))(?![\w*<>/-])")
_BARE = re.compile(r"(?<![\w.`])`{1,2}(_[a-z]\w*)`{1,2}(?![\w`])")
_PRIVATE = re.compile(r"(?<![\w.`/*'-])`{0,2}(_[a-z]\w*)`{0,2}(?![\w`(/*])")
"""A private name in a module's prose, in backticks or not (a call, ``_f(``, is code; a
primed symbol's subscript, ``M'_w``, is math)."""


def readable(path: Path) -> str:
    """What of a file is prose: a page whole, a Python module's docstrings (every string
    statement) and comments."""
    source = path.read_text()
    if path.suffix != ".py":
        return source
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    strings = [node.value.value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str)]
    return "\n".join(comments + strings)


@functools.cache
def files() -> frozenset[Path]:
    """Every file of the repository's own trees (no environment, cache or build output)."""
    found = {path for path in ROOT.iterdir() if path.is_file()}
    for tree in TREES:
        found |= {p for p in (ROOT / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return frozenset(found)


@functools.cache
def basenames() -> frozenset[str]:
    return frozenset(path.name for path in files())


@functools.cache
def bound_in(folder: Path) -> frozenset[str]:
    """Every name the Python modules of ``folder`` (not its subfolders) bind, at any
    depth: functions, classes, assignments' targets, imports."""
    names: set[str] = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
    return frozenset(names)


@functools.cache
def packages() -> tuple[Path, ...]:
    """src/cpslice/ and every folder of it."""
    return (PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"))


def module_file(parts: list[str]) -> Path | None:
    """The file of module ``<parts>`` (``cpslice...`` from src/, ``benchmarks...``,
    ``tests...`` from the root): its ``.py`` or its package's ``__init__.py``."""
    base = (SRC if parts[:1] == ["cpslice"] else ROOT).joinpath(*parts)
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if parts and path.is_file():
            return path
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _binding(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The statement of ``body`` that binds ``name``: a def, a class, an assignment, an
    annotated name, or an import."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
                (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
            return node
        if isinstance(node, ast.If | ast.Try):  # a name bound in a branch (if TYPE_CHECKING, try/except)
            inner = [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
            if (found := _binding(inner, name)) is not None:
                return found
    return None


def _imported_from(module: list[str], path: Path, node: ast.ImportFrom, name: str) -> list[str] | None:
    """Where ``from ... import name`` in ``module`` (its file ``path``) reads ``name``
    from, a dotted path; None for an import from outside the repository."""
    if node.level:
        package = module if path.name == "__init__.py" else module[:-1]
        base = package[: len(package) - node.level + 1]
    elif module_file((node.module or "").split(".")[:1]) is not None:
        base = []
    else:
        return None
    alias = next(a for a in node.names if (a.asname or a.name) == name)
    return [*base, *filter(None, (node.module or "").split(".")), alias.name]


def resolves(parts: list[str]) -> bool:
    """Whether ``<parts>`` is a package, module or name of the repository's Python (read
    from the source: a module's names, a class's members, through ``from`` imports)."""
    for i in range(len(parts), 0, -1):
        path = module_file(parts[:i])
        if path is not None:
            return _has(parts[:i], path, parts[i:])
    return False


def _has(module: list[str], path: Path, rest: list[str]) -> bool:
    """Whether ``module`` (its file ``path``) has the attribute chain ``rest``."""
    body: list[ast.stmt] = _tree(path).body
    for depth, name in enumerate(rest):
        node = _binding(body, name)
        if isinstance(node, ast.ImportFrom):
            source = _imported_from(module, path, node, name)
            return source is None or resolves([*source, *rest[depth + 1:]])
        if isinstance(node, ast.ClassDef):
            body = node.body
        elif node is None:
            return False
        else:
            return depth == len(rest) - 1 or isinstance(node, ast.Import)
    return True


def _path_exists(token: str, page: Path) -> bool:
    bases = [ROOT, *packages(), *[p for p in page.parents if p.is_relative_to(ROOT)]]
    if "*" in token:
        return any(any(True for _ in base.glob(token.rstrip("/"))) for base in bases)
    return any((base / token).exists() for base in bases)


def stale(page: Path) -> Iterator[str]:
    """The names ``page`` (a doc page or a module of src/) gives that do not exist."""
    text = readable(page)
    yield from _stale_dotted(text)
    yield from _stale_paths(text, page)
    for name in (_PRIVATE if page.suffix == ".py" else _BARE).findall(text):
        if not (name in EXTERNAL or _is_a_module(name)
                or page.suffix == ".py" and name in bound_in(page.parent)):
            yield f"`{name}`"


def _stale_dotted(text: str) -> Iterator[str]:
    for token in _DOTTED.findall(text):
        parts = token.split(".")
        if parts[0].startswith("_"):
            if module_file(["cpslice", parts[0]]) is None:
                continue  # a private name that is not one of cpslice's modules: read as a bare name
            parts = ["cpslice", *parts]
        if parts[-1] not in ("py", "md", "toml", "txt") and not resolves(parts):  # a file: read as a path
            yield token


def _stale_paths(text: str, page: Path) -> Iterator[str]:
    for token in (t.rstrip(".") for t in _PATH.findall(text)):
        if token.startswith(("http", "www.")) or "//" in token:
            continue
        if token.lstrip("./").split("/")[0] in FRAMEWORKS or token in FOREIGN_FILES:
            continue
        if "/" not in token:
            if token not in basenames() and not ("*" in token and any(True for _ in ROOT.rglob(token))):
                yield token
        elif _looks_like_a_path(token) and not _path_exists(token, page):
            yield token


def _looks_like_a_path(token: str) -> bool:
    """A token with a ``/`` that names a file or folder: it starts at one of the
    repository's trees or cpslice's private packages, or it ends in a file's suffix."""
    first = token.lstrip("./").split("/")[0]
    return (first in TREES or first.startswith("_") or first in ("cpslice", "backends", "triton")
            or re.search(r"\.(?:py|md|toml|txt|in|cfg|ini)$", token) is not None)


def _is_a_module(name: str) -> bool:
    """Whether some module or package anywhere in cpslice is called ``name``."""
    return any(path.stem == name or path.name == name for path in PACKAGE.rglob("*")
               if path.suffix == ".py" or path.is_dir())


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES + SOURCES, ids=_name)
def test_every_name_exists(page: Path) -> None:
    assert sorted(set(stale(page))) == [], f"{_name(page)} names what does not exist"


def test_the_reader_finds_each_kind_of_stale_name(tmp_path: Path) -> None:
    """Planted names, one of each kind, are found; their living forms are not."""
    page = tmp_path / "page.md"
    page.write_text(
        "The rows come from `cpslice._layout.plan.select` and `cpslice._layout.plan.selectt`;\n"
        "`cpslice.Layout.from_order`, `cpslice.Layout.from_orders`, `_vocab.backends.selection.using`,\n"
        "`cpslice._plan.select`, `benchmarks.bench_extract.main`, `benchmarks.bench_extractt`;\n"
        "see `_layout/pieces.py` and `_layout/piece.py`, tests/support/oracle.py and tests/oracle.py,\n"
        " `benchmarks/bench_*.py` and `benchmarks/bnch_*.py`; `plan.py`, `plann.py`;\n"
        "``_plan`` and ``_layout``, `_pieces`; src/cpslice/_vocab/backends and docs/dev/none.md.\n")
    assert sorted(stale(page)) == sorted([
        "cpslice._layout.plan.selectt", "cpslice.Layout.from_orders", "cpslice._plan.select",
        "benchmarks.bench_extractt", "_layout/piece.py", "tests/oracle.py", "benchmarks/bnch_*.py",
        "plann.py", "`_plan`", "`_pieces`", "docs/dev/none.md"])
    # in a module, a private name bound there or beside it is found (a docstring, a comment)
    (tmp_path / "b.py").write_text("def _helper() -> None: ...\n")
    module = tmp_path / "a.py"
    module.write_text('"""Calls ``_helper`` and ``_local``."""\n\n_local = 1  # not ``_gone``, nor _layoutt\n')
    assert sorted(stale(module)) == ["`_gone`", "`_layoutt`"]


def imports_of(path: Path) -> set[str]:
    """The modules a module of src/ imports anywhere, by full name (``from . import x``:
    ``package`` and ``package.x``)."""
    module = list(path.relative_to(SRC).with_suffix("").parts)
    package = module[:-1]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *filter(None, (node.module or "").split("."))])
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def test_the_offset_arithmetic_is_where_the_docs_say() -> None:
    """README.md, docs/layouts.md and docs/dev/architecture.md put the offset arithmetic
    in ``_layout/pieces.py`` (where each rank's rows sit) and ``_layout/plan.py`` (every
    offset read from that placement): only the Layout and plan.py import the placement,
    and every module of public layout functions reads its offsets through plan.py."""
    importers = {_name(p) for p in SOURCES if "cpslice._layout.pieces" in imports_of(p)}
    assert importers == {"src/cpslice/_layout/layout.py", "src/cpslice/_layout/plan.py"}
    for name in ("pack", "extract", "redistribute", "reduce", "positions", "unshard"):
        assert "cpslice._layout.plan" in imports_of(PACKAGE / "_layout" / f"{name}.py"), name
    for page in (ROOT / "README.md", ROOT / "docs/layouts.md", ROOT / "docs/dev/architecture.md"):
        claims = [p for p in re.split(r"\n\s*\n", page.read_text()) if "offset arithmetic" in p
                  or "offsets from the rules" in p]
        assert claims and all("pieces" in c and "plan" in c for c in claims), _name(page)


def test_the_glossary_defines_the_layout_and_engine_words() -> None:
    """docs/layouts.md's *Words* table gives each word of the layout and the engine one row."""
    text = (ROOT / "docs/layouts.md").read_text()
    section = text[text.index("\n## Words\n"):]
    section = section[: section.index("\n## ", 1)]
    words = re.findall(r"^\| (\w+) \|", section, re.M)
    assert sorted(words) == sorted(set(words)), "a word defined twice"
    assert {"chunk", "block", "piece", "run", "part", "span", "share", "star", "tile",
            "split", "shard", "depth", "support", "extent"} <= set(words)
