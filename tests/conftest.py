"""Starts the planted ``cpslice verify`` runs (``planted.py``) as soon as the session's
tests are collected, when ``test_verify_planted.py`` is among them: they take most of a
minute of both cores, and run beside the single-process tests instead of after them."""

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith("tests/test_verify_planted.py") for item in session.items):
        from . import planted

        planted.start()
