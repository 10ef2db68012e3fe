"""The suite's markers (declared in pyproject.toml), read off what each test does, so that
a new test carries them without being told (conftest.py adds them at collection):

- ``distributed``: the test runs a task on gloo ranks: its function, a function nested
  in it or one of its fixtures names ``run_distributed`` (tests/support/_dist.py's
  worlds) or ``verify_main`` (``cpslice verify``'s ranks); a test that starts ranks in
  another way says so with ``@pytest.mark.distributed``;
- ``triton``: the test runs or selects the Triton backend: its module's file is named for
  Triton (``test_*triton*.py``) or imports ``triton`` itself, its code (or a fixture's)
  passes the string ``"triton"`` (``selection.using("triton")``), or one of its
  parameters is ``"triton"``;
- ``slow``: the test waits for a background job (tests/support/background.py), which
  takes many seconds of CPU; a test slow for another reason says so with
  ``@pytest.mark.slow``.

``make test-fast`` leaves out the ``slow`` ones; ``pytest -m "not distributed"`` runs
without gloo worlds.
"""

from collections.abc import Callable, Iterable, Iterator
from types import CodeType, ModuleType
from typing import Any

import pytest

from . import background

DISTRIBUTED, TRITON, SLOW = "distributed", "triton", "slow"
RUNNERS = frozenset({"run_distributed", "verify_main"})
"""The functions that run a task on gloo ranks: a test that names one is ``distributed``."""


def codes(function: Callable[..., Any]) -> Iterator[CodeType]:
    """The code of ``function`` and of every function, lambda or comprehension nested in it."""
    stack = [code] if (code := getattr(function, "__code__", None)) is not None else []
    while stack:
        code = stack.pop()
        yield code
        stack.extend(const for const in code.co_consts if isinstance(const, CodeType))


def names(functions: Iterable[Callable[..., Any]]) -> set[str]:
    """The global and attribute names the functions' code (nested code too) refers to."""
    return {name for function in functions for code in codes(function) for name in code.co_names}


def strings(functions: Iterable[Callable[..., Any]]) -> set[str]:
    """The string constants of the functions' code (nested code too)."""
    return {const for function in functions for code in codes(function)
            for const in code.co_consts if isinstance(const, str)}


def kinds(functions: list[Callable[..., Any]], params: Iterable[object], module: ModuleType | None,
          nodeid: str) -> set[str]:
    """The markers a test earns: ``functions``, its own function first, then its fixtures';
    ``params``, its parameters' values; ``module``, its module; ``nodeid``, its pytest id."""
    found = set()
    if names(functions) & RUNNERS:
        found.add(DISTRIBUTED)
    file = nodeid.partition("::")[0].rpartition("/")[2]
    imports_triton = getattr(getattr(module, "triton", None), "__name__", None) == "triton"
    if ("triton" in file or imports_triton or "triton" in strings(functions)
            or any(p == "triton" for p in params if isinstance(p, str))):
        found.add(TRITON)
    if background.waits(nodeid):
        found.add(SLOW)
    return found


def functions(item: pytest.Function) -> list[Callable[..., Any]]:
    """A collected test's function, then the functions of the fixtures it uses."""
    fixtures = [fixture.func for name in item.fixturenames
                for fixture in item._fixtureinfo.name2fixturedefs.get(name, ())]
    return [item.function, *fixtures]


def of_item(item: pytest.Item) -> set[str]:
    """``kinds`` of a collected test: its function, its fixtures' functions, its
    parameters, its module."""
    if not isinstance(item, pytest.Function):
        return set()
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return kinds(functions(item), params, item.module, item.nodeid)


def mark(items: list[pytest.Item]) -> None:
    """Add the markers each test earns (``of_item``)."""
    for item in items:
        for kind in sorted(of_item(item)):
            item.add_marker(kind)
