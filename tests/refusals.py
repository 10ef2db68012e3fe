"""What a refused call raises: the refusal tables of test_padded.py and
test_row_offsets.py are lines of code, each evaluated with ``Layout`` and ``torch`` in
scope."""

import torch

from cpslice import Layout


def refusal(code: str) -> Exception:
    """The exception ``code`` raises; an AssertionError when it is accepted."""
    try:
        eval(code, {"Layout": Layout, "torch": torch})
    except Exception as e:  # noqa: BLE001 - returned for the caller to inspect
        return e
    raise AssertionError(f"{code} was accepted")
