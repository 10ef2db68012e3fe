"""A float's bits, for invariant mode's compiled kernels: a comparison bit for bit
(``same``), bfloat16 logits two columns to an int32 (``pairs``) and the bfloat16 rounding
by the bits (``bfloat16_bits``). No arithmetic of the spec here (``spec`` holds it)."""

import sys
from collections.abc import Sequence
from typing import no_type_check

import torch
from torch import Tensor


def as_int(t: Tensor) -> Tensor:
    """``t``'s bits as the signed integers of its width (a view)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(got: Sequence[Tensor], want: Sequence[Tensor]) -> bool:
    """Bit for bit (a zero's sign included), but a NaN's payload: NaN where the other is
    NaN is enough (ATen's own bfloat16 rounding gives a NaN one payload in its vector
    code and another in its scalar code)."""
    def one(g: Tensor, w: Tensor) -> bool:
        nan = g.isnan()
        return bool(torch.equal(nan, w.isnan()) and torch.equal(as_int(g)[~nan], as_int(w)[~nan]))

    return all(g.dtype == w.dtype and one(g, w) for g, w in zip(got, want))


def pairs(t: Tensor) -> Tensor | None:
    """``[R, w / 2]`` int32 view of bfloat16 ``t`` ``[R, w]`` (two columns an element,
    the even one in the low half: little-endian), where its shape, strides and offset
    allow one; else None."""
    if (t.dtype != torch.bfloat16 or sys.byteorder != "little" or t.shape[1] % 2 or t.stride(1) != 1
            or t.stride(0) % 2 or t.storage_offset() % 2):
        return None
    return t.view(torch.int32)


NAN_BITS = 0x7FC00000
"""The float32 quiet NaN whose bfloat16 rounding is bfloat16's (0x7FC0)."""


@no_type_check
def bfloat16_bits(g):
    """The bfloat16 rounding (to nearest, ties to even) of float32 ``g`` as int32 bits in
    the high half, the low half 0; a NaN the quiet NaN."""
    bits = torch.where(g != g, NAN_BITS, g.view(torch.int32))
    return (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
