"""The suite's markers (tests/support/marks.py): which test earns ``distributed``,
``triton`` and ``slow``, that conftest.py gives them before ``-m`` selects, and that
pyproject.toml declares every one of them, with ``--strict-markers`` refusing others."""

import tomllib
import types
from typing import Any

import pytest

from ..support import checked, marks
from ..support._docs import ROOT


def run_distributed(*args: Any) -> None:
    """A stand-in: the rules read names, never call them."""


def verify_main(*args: Any) -> None:
    """A stand-in, as above."""


def on_a_world() -> None:
    run_distributed(print, 2)


def on_a_world_further_in() -> None:
    def task() -> None:
        run_distributed(print, 2)

    task()


def on_the_verifiers_ranks() -> None:
    verify_main()


def alone() -> None:
    print("triton kernels", "distributed")  # strings that are not the backend's name


def with_the_triton_backend() -> None:
    using("triton")


def using(name: str) -> None:
    """A stand-in for ``selection.using``."""


def kinds(*functions: Any, params: tuple[object, ...] = (), module: types.ModuleType | None = None,
          nodeid: str = "tests/layout/test_x.py::test_x") -> set[str]:
    return marks.kinds(list(functions), params, module, nodeid)


def test_a_test_that_runs_a_world_is_distributed() -> None:
    assert kinds(on_a_world) == {"distributed"}
    assert kinds(on_a_world_further_in) == {"distributed"}  # a nested function's call
    assert kinds(alone, on_a_world) == {"distributed"}  # a fixture's call
    assert kinds(on_the_verifiers_ranks) == {"distributed"}
    assert kinds(alone) == set()


def test_a_test_that_runs_or_selects_triton_is_triton() -> None:
    assert kinds(with_the_triton_backend) == {"triton"}
    assert kinds(alone, with_the_triton_backend) == {"triton"}  # a fixture's selection
    assert kinds(alone, params=(1, "triton")) == {"triton"}
    assert kinds(alone, params=("eager", "compiled")) == set()
    assert kinds(alone, nodeid="tests/vocabulary/test_hidden_triton.py::test_x[a]") == {"triton"}
    assert kinds(alone, nodeid="tests/vocabulary/test_x.py::test_triton_kernels") == set()
    # a module that imports Triton itself, not one that imports cpslice's Triton backend
    module = types.ModuleType("tests.vocabulary.test_x")
    module.triton = types.ModuleType("triton")  # type: ignore[attr-defined]
    assert kinds(alone, module=module) == {"triton"}
    module.triton = types.ModuleType("cpslice._vocab.backends.triton")  # type: ignore[attr-defined]
    assert kinds(alone, module=module) == set()


def test_a_test_that_waits_for_a_background_job_is_slow() -> None:
    assert checked.UNCHECKED  # imported: checked.py registered its job, the unchecked rerun
    assert kinds(alone, nodeid="tests/layout/test_errors.py::test_error_tests_pass_unchecked") == {"slow"}
    assert kinds(alone, nodeid="tests/layout/test_errors.py::test_refusals[0]") == set()


@pytest.mark.parametrize("backend", ["triton"])
def test_conftest_gives_each_test_its_markers(request: pytest.FixtureRequest, backend: str) -> None:
    assert request.node.get_closest_marker("triton") is not None  # this test's own parameter
    for item in request.session.items:
        given = {mark.name for mark in item.iter_markers()}
        assert marks.of_item(item) <= given, item.nodeid


def test_every_marker_is_declared_and_no_other_is_accepted() -> None:
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {line.partition(":")[0] for line in pytest_options["markers"]}
    assert {marks.DISTRIBUTED, marks.TRITON, marks.SLOW} <= declared
    assert "--strict-markers" in pytest_options["addopts"].split()
