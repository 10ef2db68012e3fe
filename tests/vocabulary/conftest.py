"""The vocabulary tests' fixture ``seen``: the instrumentation hook watching the whole test."""

from collections.abc import Iterator

import pytest

from cpslice import _probe


@pytest.fixture
def seen() -> Iterator[_probe.Seen]:
    """The library's events of this test (``cpslice._probe.watch``)."""
    with _probe.watch() as events:
        yield events
