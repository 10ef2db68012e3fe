"""Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``), read as Triton reads
it; the Triton backend's ``takes`` and its kernels' launches ask here."""

import os


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: numpy on
    the CPU, one program at a time), read at each call as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_interpreter() -> None:
    """Refuse to run a kernel on the CPU when Triton was imported before
    ``TRITON_INTERPRET=1`` was set: its language functions are then compiled ones, and
    the interpreter cannot call them (Triton reads the setting when it is imported).

    Raises:
        RuntimeError: the message says to set it before the process starts.
    """
    import triton.language as tl

    if type(tl.standard.max).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after Triton was imported, so its interpreter cannot run "
            "cpslice's kernels on CPU tensors; set it in the environment before the process starts "
            "(`make test` does)"
        )
