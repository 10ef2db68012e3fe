"""A Hugging Face attention mask read as bshd rows: each row's token count and first
column (``Layout.from_attention_mask``)."""

import torch
from torch import Tensor

from .._checks import kind
from .._errors import LayoutError


def mask_rows(attention_mask: object) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(L, o, S)`` of a ``[B, S]`` mask: per row its ones ``L_i`` and first one ``o_i``.

    Computed on the mask's device; one host copy of ``[B, 4]`` numbers.

    Raises:
        TypeError: not a bool or integer tensor.
        LayoutError: not 2-D; a value other than 0 and 1; a row without a 1, or with a
            0 between its ones (the message names the row).
    """
    name = "attention_mask"
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"{name} must be a bool or integer torch.Tensor [B, S], got "
                        f"{kind(attention_mask)}")
    mask = attention_mask
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} must hold bools or integers (0 and 1), got a tensor of "
                        f"dtype {mask.dtype}")
    if mask.dim() != 2:
        raise LayoutError(f"{name} must be 2-D [B, S] (one row per sample), got shape "
                          f"{tuple(mask.shape)}")
    rows, seq = mask.shape
    if rows and not seq:
        raise LayoutError(f"{name} row 0 (sample 0) has no 1: a row holds at least one token")
    if not rows:  # a batch of no samples (amin over [0, S] has nothing to reduce)
        return (), (), seq
    ones = mask != 0
    other = ones & (mask != 1)  # any value but 0 and 1, negative ones too
    column = torch.arange(seq, device=mask.device)
    first_other = torch.where(other, column, seq).amin(1)
    stats: list[list[int]] = torch.stack([
        ones.sum(1),
        torch.where(ones, column, seq).amin(1),
        torch.where(ones, column, -1).amax(1),
        other.sum(1),
        first_other,
        mask.gather(1, first_other.clamp(max=max(seq - 1, 0))[:, None])[:, 0].long(),
    ], 1).tolist()  # the one host copy
    for i, (count, first, last, others, at, value) in enumerate(stats):
        if others:
            raise LayoutError(
                f"{name} row {i} (sample {i}) holds {others} values other than 0 and 1 "
                f"(the first: {value} at column {at}; 1 marks a column that holds a token, "
                "0 padding)"
            )
        if not count:
            raise LayoutError(
                f"{name} row {i} (sample {i}) has no 1: a row holds at least one token"
            )
        if last + 1 - first != count:
            raise LayoutError(
                f"{name} row {i} (sample {i}) has a hole: its ones span columns "
                f"[{first}, {last + 1}) but {last + 1 - first - count} of those are 0 (a "
                "row holds its sample's tokens contiguously: the left-padded prompt, then "
                "the response)"
            )
    return tuple(s[0] for s in stats), tuple(s[1] for s in stats), seq
