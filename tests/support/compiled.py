"""The compiled kernels a block ran, as the instrumentation hook saw them (``cpslice._probe``)."""

from cpslice._probe import Seen


def ran(seen: Seen, rows: int) -> set[str]:
    """The compiled kernels launched within ``seen``'s block on chunks of ``rows`` rows
    (a compiled kernel's chunk shape is fixed: the launches' rows are its chunk's)."""
    return {e.name for e in seen.of("launch", backend="compiled") if e.rows == rows}
