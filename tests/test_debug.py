"""CPSLICE_DEBUG: checking on when asked, no wrapper at all when not, bad values refused.

Each case runs in a fresh interpreter (the pytest session itself has checking
turned on by jaxtyping's plugin, and the variable is read once at import).
"""

import os
import subprocess
import sys

import pytest

import cpslice


def _run(code: str, debug: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
    if debug is not None:
        env["CPSLICE_DEBUG"] = debug
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_unset_means_no_wrapper_and_plain_errors() -> None:
    # one interpreter, cpslice imported afresh for each value (torch once: seconds)
    code = """
import os, sys, torch
for value in (None, "", "0"):
    for name in [m for m in sys.modules if m == "cpslice" or m.startswith("cpslice.")]:
        del sys.modules[name]
    os.environ.pop("CPSLICE_DEBUG", None)
    if value is not None:
        os.environ["CPSLICE_DEBUG"] = value
    import cpslice, cpslice._plan
    assert not hasattr(cpslice.extract_responses, "__wrapped__"), value
    assert not hasattr(cpslice._plan.runs, "__wrapped__"), value
    assert "megatron" not in sys.modules, "import cpslice must not import megatron"
    layout = cpslice.Layout([10], [4], cp_mode="zigzag", cp_size=2)
    try:
        cpslice.extract_responses(torch.zeros(6, dtype=torch.int64), layout)
    except TypeError as e:
        assert "must be floating point" in str(e), e
    else:
        raise SystemExit("no error")
    try:
        cpslice.shard_responses(torch.zeros(4), layout)
    except TypeError as e:
        assert "list of per-sample tensors" in str(e), e
    try:
        cpslice.extract_responses(torch.tensor(1.0), layout)
    except TypeError as e:
        assert "0-d" in str(e), e
print("ok")
"""
    proc = _run(code, None)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_one_checks_every_function_with_bound_dimensions() -> None:
    code = """
import torch, cpslice, cpslice._plan
from jaxtyping import TypeCheckError
assert hasattr(cpslice.extract_responses, "__wrapped__")
assert hasattr(cpslice._plan.runs, "__wrapped__"), "private functions are checked too"
layout = cpslice.Layout([10], [4], cp_mode="zigzag", cp_size=2)
try:
    cpslice.extract_responses(torch.zeros(6), layout, torch.zeros(6, 2))
except TypeCheckError as e:
    assert "entropy" in str(e)
else:
    raise SystemExit("entropy of another shape was not caught by the checker")
print("ok")
"""
    proc = _run(code, "1")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_an_invalid_value_lists_the_valid_ones(value: str) -> None:
    proc = _run("import cpslice", value)
    assert proc.returncode != 0
    assert f"CPSLICE_DEBUG={value!r} is not valid" in proc.stderr
    assert "'1'" in proc.stderr and "'0'" in proc.stderr


def test_this_session_runs_checked() -> None:
    # jaxtyping's pytest plugin (pyproject addopts) wraps cpslice once, here.
    assert hasattr(cpslice.extract_responses, "__wrapped__")
