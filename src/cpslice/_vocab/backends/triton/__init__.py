"""The Triton backend's kernels: hand-written Triton for CUDA tensors, and for CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``, the tests' way to run them without
a GPU).

Nothing here is imported unless the Triton backend is chosen: ``triton`` comes with the
CUDA builds of torch and is no dependency of cpslice. ``default`` holds the default
reduction's kernels (online statistics forward, one read; the gradient backward, one read
and one write), ``invariant`` invariant mode's (the spec of docs/invariance.md: 128-column
tiles, the spec's ``exp``, pairwise-halving sums, no contraction, correctly rounded
divisions). Every launch is a ``launch`` event of ``cpslice._probe`` (backend
``triton``), so that a test (and a benchmark) can see that a Triton kernel ran: a silent
fallback to another backend shows as no launch.
"""

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
