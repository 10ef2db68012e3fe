"""What a refused call raises: the refusal tables of test_padded.py and
test_row_offsets.py are lines of code, each evaluated with ``Layout`` and ``torch`` in
scope; ``refusal_test`` is the one test both files run over their tables."""

from collections.abc import Callable

import pytest
import torch

from cpslice import Layout, LayoutError

Table = list[tuple[str, str]]  # (code, a part of its message)


def refusal(code: str) -> Exception:
    """The exception ``code`` raises; an AssertionError when it is accepted."""
    try:
        eval(code, {"Layout": Layout, "torch": torch})
    except Exception as e:  # noqa: BLE001 - returned for the caller to inspect
        return e
    raise AssertionError(f"{code} was accepted")


def refusal_test(layout_errors: Table, type_errors: Table) -> Callable[[str, str, str], None]:
    """A test over every row of the two tables: the code of a ``layout_errors`` row
    raises a LayoutError, of a ``type_errors`` row a TypeError itself (not a
    subclass: LayoutError is none, nor the checker's TypeCheckError), with the row's
    message in its own."""

    @pytest.mark.parametrize(
        ("kind", "code", "message"),
        [("LayoutError", *row) for row in layout_errors] + [("TypeError", *row) for row in type_errors],
    )
    def test_refusals(kind: str, code: str, message: str) -> None:
        error = refusal(code)
        right = isinstance(error, LayoutError) if kind == "LayoutError" else type(error) is TypeError
        assert right and message in str(error), error

    return test_refusals
