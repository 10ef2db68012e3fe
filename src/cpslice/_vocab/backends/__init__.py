"""The vocabulary engine's backends: ``selection`` (``CPSLICE_BACKEND`` and what the
backends learn at run time) and ``triton`` (hand-written Triton kernels, imported only
when chosen)."""
