"""What cpslice's compiled chunk kernels ran, for test_kernels.py and the compiled TP cases."""

import torch

from cpslice._vocab.backends import selection as _backend


def ran(backend: object, dtype: torch.dtype, rows: int) -> set[str]:
    """Names of the kernels compiled and run for this backend, dtype and chunk rows."""
    return {str(k[0]) for k in _backend.selected.ready if k[1] == dtype and k[2] == rows and k[-1] == backend}
