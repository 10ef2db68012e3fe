"""Error tests that hold with run-time checking on and off.

The suite runs checked (jaxtyping's pytest plugin wraps cpslice with beartype), so a
mistyped argument may be refused by the checker before cpslice's own check runs. In
that session ``refused`` accepts the checker's ``TypeCheckError`` (a ``TypeError``) in
place of cpslice's error; ``test_errors.py::test_error_tests_pass_unchecked`` runs the
same tests again in a fresh interpreter with checking off, where only cpslice's own
exception type and message pass. A deleted check therefore fails there.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from jaxtyping import TypeCheckError

import cpslice

CHECKED = hasattr(cpslice.extract_responses, "__wrapped__")


@contextmanager
def refused(error: type[Exception], match: str) -> Iterator[None]:
    """Expect cpslice's ``error`` whose message matches ``match`` (a regex); in a checked
    session the checker's ``TypeCheckError`` is also accepted."""
    allowed: tuple[type[Exception], ...] = (error, TypeCheckError) if CHECKED else (error,)
    with pytest.raises(allowed) as info:
        yield
    if CHECKED and isinstance(info.value, TypeCheckError):
        return
    assert not isinstance(info.value, TypeCheckError), info.value
    assert isinstance(info.value, error), info.value
    assert re.search(match, str(info.value)), f"{match!r} not in {str(info.value)!r}"
