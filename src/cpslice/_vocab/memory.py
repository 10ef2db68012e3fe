"""A fresh buffer for a backward's gradient, advised as transparent huge pages (the
logits driver's ``[T, V_local]``: ``buffer``)."""

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

HUGE_PAGE = 2**21
MADV_HUGEPAGE = 14
ADVISE_MIN_BYTES = 32 * 2**20


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux, else None."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


def buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, zero: bool) -> Tensor:
    """A new (zeroed if ``zero``) tensor for the backward's ``[T, V_local]`` gradient.

    A fresh CPU buffer of hundreds of MiB is new memory from the kernel: its first
    write takes one page fault per 4 KiB page, which at ``T = 4096, V = 32768`` costs
    more than the fused gradient kernel itself. On Linux a CPU buffer of at least
    ``ADVISE_MIN_BYTES`` is therefore advised as transparent huge pages (``madvise
    MADV_HUGEPAGE`` on its 2 MiB-aligned interior) before it is touched: 512 times
    fewer faults where the system's THP setting is ``madvise`` or ``always``, nothing
    where it is ``never``. Advice only: the memory, its size and its contents are what
    ``torch.empty`` gave, and the advice leaves with the memory when it is freed."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if out.device.type == "cpu" and nbytes >= ADVISE_MIN_BYTES else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # a refusal (EINVAL) changes nothing
    return out.zero_() if zero else out
