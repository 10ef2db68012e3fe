"""``CPSLICE_DEBUG``: read once, at import."""

import os

VALID = ("", "0", "1")


def debug_enabled() -> bool:
    """Whether ``CPSLICE_DEBUG`` asks for run-time shape and type checking.

    Raises:
        ValueError: the variable holds anything but one of ``VALID``.
    """
    value = os.environ.get("CPSLICE_DEBUG", "")
    if value not in VALID:
        raise ValueError(
            f"CPSLICE_DEBUG={value!r} is not valid; use one of: unset or '' or '0' "
            "(no checking), '1' (jaxtyping + beartype checks on every cpslice function)"
        )
    return value == "1"
