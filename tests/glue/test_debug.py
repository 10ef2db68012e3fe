"""CPSLICE_DEBUG: checking on when asked, no wrapper at all when not, bad values refused.

The variable is read once, when cpslice is imported, so each case needs an interpreter
that imported it under that value: the session's spawned gloo ranks are started with
``CPSLICE_DEBUG=1`` (tests/support/_dist.py), test_errors.py's unchecked interpreter without
it, and an invalid value fails ``import cpslice`` before torch is imported (a fresh
interpreter each, but a cheap one). This session itself runs checked, by jaxtyping's
pytest plugin.
"""

import os
import subprocess
import sys

import pytest

import cpslice
from cpslice._debug import debug_enabled

from ..support._dist import run_distributed
from ..support.checked import CHECKED


def _checked_by_the_variable(rank: int, world: int) -> str:
    """On a rank started with CPSLICE_DEBUG=1: every function wrapped, private ones too,
    and a dimension bound across arguments checked."""
    import torch
    from jaxtyping import TypeCheckError

    import cpslice._layout.plan

    assert os.environ.get("CPSLICE_DEBUG") == "1"
    assert hasattr(cpslice.extract_responses, "__wrapped__")
    assert hasattr(cpslice._layout.plan.runs, "__wrapped__"), "private functions are checked too"
    layout = cpslice.Layout([10], [4], cp_mode="zigzag", cp_size=2)
    try:
        cpslice.extract_responses(torch.zeros(6), layout, torch.zeros(6, 2))
    except TypeCheckError as e:
        return "entropy" if "entropy" in str(e) else str(e)
    return "entropy of another shape was not caught by the checker"


def test_one_checks_every_function_with_bound_dimensions() -> None:
    assert run_distributed(_checked_by_the_variable, 2) == ["entropy", "entropy"]


def test_unset_means_no_wrapper_and_plain_errors() -> None:
    """In the unchecked interpreter (CPSLICE_DEBUG unset, no plugin): no wrapper exists,
    and the errors are cpslice's own."""
    if CHECKED:
        pytest.skip("runs in test_errors.py's unchecked interpreter")
    import torch

    assert not hasattr(cpslice.extract_responses, "__wrapped__")
    assert not hasattr(cpslice._layout.plan.runs, "__wrapped__")
    layout = cpslice.Layout([10], [4], cp_mode="zigzag", cp_size=2)
    with pytest.raises(TypeError, match="must be floating point"):
        cpslice.extract_responses(torch.zeros(6, dtype=torch.int64), layout)
    with pytest.raises(TypeError, match="list of per-sample tensors"):
        cpslice.shard_responses(torch.zeros(4), layout)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="0-d"):
        cpslice.extract_responses(torch.tensor(1.0), layout)


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("0", False), ("1", True)])
def test_the_values_that_turn_checking_on_and_off(
    value: str | None, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("CPSLICE_DEBUG", raising=False)
    else:
        monkeypatch.setenv("CPSLICE_DEBUG", value)
    assert debug_enabled() is on


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_an_invalid_value_lists_the_valid_ones(value: str) -> None:
    env = {**os.environ, "CPSLICE_DEBUG": value}
    proc = subprocess.run([sys.executable, "-c", "import cpslice"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert f"CPSLICE_DEBUG={value!r} is not valid" in proc.stderr
    assert "'1'" in proc.stderr and "'0'" in proc.stderr


def test_this_session_runs_checked() -> None:
    # jaxtyping's pytest plugin (pyproject addopts) wraps cpslice once, here.
    assert hasattr(cpslice.extract_responses, "__wrapped__")
