"""``CPSLICE_DEBUG``: read once, at import."""

import os
import sys
from pathlib import Path

VALID = ("", "0", "1")

DEBUG_EXTRA = (
    "CPSLICE_DEBUG=1 checks every call with beartype, which is not installed: "
    "pip install 'cpslice[debug]' (or unset CPSLICE_DEBUG)"
)


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


def _running_the_command_line() -> bool:
    """Whether this interpreter was started as ``cpslice ...`` (the console script)
    or ``python -m cpslice ...``: then the package is imported on the command line's
    behalf, before its ``main`` can catch anything."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[1:]:
        at = argv.index("-m", 1)
        if argv[at + 1 : at + 2] == ["cpslice"]:
            return True
    return bool(sys.argv) and Path(sys.argv[0]).stem == "cpslice"


def debug_setting() -> bool:
    """``debug_enabled()`` for ``import cpslice``: with checking on, beartype must be
    importable. Run from the command line, an invalid value is one line on stderr and
    exit status 2 instead of a traceback.

    Raises:
        ValueError: as ``debug_enabled`` (outside the command line).
        ImportError: checking is on but beartype (the ``cpslice[debug]`` extra) is not
            installed.
    """
    try:
        enabled = debug_enabled()
    except ValueError as err:
        if _running_the_command_line():
            sys.stderr.write(f"cpslice: error: {err}\n")
            raise SystemExit(2) from None
        raise
    if enabled:
        try:
            import beartype  # noqa: F401
        except ImportError as err:
            raise ImportError(DEBUG_EXTRA) from err
    return enabled
