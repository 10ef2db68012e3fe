"""Starts the background jobs (``background.py``) that the session's tests wait for, as
soon as they are collected: the planted ``cpslice verify`` runs, the unchecked rerun of
the error tests and the compiled steps take many seconds of CPU each, and run, niced,
beside the tests instead of in line with them; and the fork server of the gloo worlds'
ranks (``_dist.py``), whose imports would otherwise hold up the first distributed
test. The tests that wait for the jobs run last, so that the jobs have the whole session
to finish in; before them, the tests marked ``discards_world``, which kill a shared gloo
world that later tests would start anew.

Each test also gets the markers it earns (``distributed``, ``triton``, ``slow``:
tests/support/marks.py), before ``-m`` selects by them."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # one intra-op thread, as each gloo rank has (tests/support/_dist.py): the session's small
    # ops gain nothing from a second one, whose OpenMP worker would spin between them on
    # the core the ranks and the background jobs need
    import os

    import torch

    torch.set_num_threads(1)
    # the Triton backend's kernels run on CPU tensors through Triton's interpreter
    # (tests/test_triton*.py): Triton reads it when imported, so `make test` sets it before
    # the process starts (a plugin may import Triton before this hook); here for the gloo
    # ranks, which inherit it
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before the mark plugin's -m deselects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # imported here, after collection: they import cpslice, which the jaxtyping plugin's
    # hook must see first (so that the session runs checked)
    from .support import background, checked, compile_job, marks, planted  # noqa: F401  (they register jobs)

    marks.mark(items)
    # stable: the tests that discard a shared world after every other (the next user of
    # that world would start a new one), then those that wait for background jobs
    items.sort(key=lambda item: (background.waits(item.nodeid),
                                 item.get_closest_marker("discards_world") is not None))


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    import sys

    from .support import background

    background.start_for([item.nodeid for item in session.items])
    if "tests.support._dist" in sys.modules and any(map(_runs_a_world, session.items)):
        from .support import _dist

        _dist.start_fork_server()


def _runs_a_world(item: pytest.Item) -> bool:
    """Whether the test runs a task on a gloo world of tests/support/_dist.py (its
    function, code nested in it or a fixture names ``run_distributed``; one that does it
    further in starts the fork server itself, at its world)."""
    from .support import marks

    return isinstance(item, pytest.Function) and "run_distributed" in marks.names(marks.functions(item))
