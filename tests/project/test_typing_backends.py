"""Every backend module implements the one interface (``KernelBackend``): checked by mypy
in `make typecheck` (a module assigned to the protocol is checked member by member), and
at run time against the registry's modules."""

import importlib

from cpslice._vocab.backends import compiled, eager, selection, triton
from cpslice._vocab.backends.interface import KernelBackend

MODULES: dict[str, KernelBackend] = {"eager": eager, "compiled": compiled, "triton": triton}


def test_the_registry_lists_exactly_the_modules_mypy_checks() -> None:
    assert {name: importlib.import_module(path) for name, path in selection.REGISTRY} == MODULES
    assert all(module.NAME == name for name, module in MODULES.items())
    assert selection.NAMES == ("auto", "triton", "compiled", "eager")  # auto tries them in this order
