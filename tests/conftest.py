"""Starts the background jobs (``background.py``) that the session's tests wait for, as
soon as they are collected: the planted ``cpslice verify`` runs and the unchecked rerun
of the error tests take many seconds of CPU each, and run, niced, beside the tests
instead of in line with them."""

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    # imported here, after collection: they import cpslice, which the jaxtyping plugin's
    # hook must see first (so that the session runs checked)
    from . import background, checked, planted  # noqa: F401  (they register their jobs)

    background.start_for([item.nodeid for item in session.items])
