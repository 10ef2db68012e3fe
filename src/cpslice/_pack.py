"""The input side of the same layout: packing per-sample tensors into a rank's
local tensor, the shifted targets, and the rows that hold the response.

All three are readings of ``_plan``'s selections, so they cannot disagree with
extraction.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks as checks
from ._cache import cached
from ._layout import Layout
from ._plan import default_length, packed_offsets, resolve_length, rows_on, selection
from ._types import AnyShare, AnyValues, IntArg, RealArg, Rows, Targets


@cached(maxsize=8)
def _index_on(layout: Layout, length: int, shift: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The rows a packing writes and, for each, the element of the concatenated samples
    it reads (``shift`` 1: the next token), on ``device``: copied once per layout."""
    sel = selection(layout, length, "targets" if shift else "sample")
    src = sel.sources(packed_offsets(layout)) + shift
    return rows_on(layout, length, "targets" if shift else "sample", device), src.to(device)


def _lay_out(
    items: list[Tensor], layout: Layout, fill: object, shift: int, rest: tuple[int, ...],
    dtype: torch.dtype, device: torch.device,
) -> Tensor:
    length = default_length(layout)
    out = torch.full((length, *rest), checks.fill_value(fill, dtype), dtype=dtype, device=device)
    if not items:
        return out
    rows, src = _index_on(layout, length, shift, device)
    flat = torch.cat(items)
    return out.index_copy(0, rows, flat.index_select(0, src).to(dtype))


def pack(
    per_sample: Sequence[AnyShare], layout: Layout, *, fill: RealArg = 0
) -> AnyValues:
    """Lay each sample's whole tensor into this rank's local tensor, as docs/layouts.md says.

    ``per_sample[i]`` is ``[L_i, *rest]`` (tokens, loss masks, position ids; any dtype,
    the same for every sample). The result is ``[T, *rest]`` with ``T`` the layout's
    ``local_length`` when set, else the least length the layout needs (for allgather,
    ``ceil(sum(L) / cp_size)``); every position no sample holds (zigzag and bshd
    padding, a left-padded row's columns before its sample, the tail) is ``fill``.
    Differentiable for floating-point inputs.

    Raises:
        TypeError: ``per_sample`` is not a list of tensors of at least 1 dim; ``fill``
            is not a number.
        LayoutError: the number of samples, a sample's length, or a sample's dtype
            or trailing shape disagrees; a ``fill`` the dtype cannot hold exactly (0.5
            or NaN into integer tokens, 300 into uint8).
    """
    items = checks.per_sample(
        "per_sample", per_sample, layout.total_lengths, "total_length", uniform=True
    )
    if not items:
        return torch.full((default_length(layout),), checks.fill_value(fill, torch.float32))
    first = items[0]
    return _lay_out(items, layout, fill, 0, tuple(first.shape[1:]), first.dtype, first.device)


def shifted_targets(
    tokens: Sequence[AnyShare], layout: Layout, *, fill: IntArg = 0
) -> Targets:
    """The int64 ``[T]`` target of every local position: the next token of the same sample.

    ``tokens[i]`` is sample ``i``'s whole token tensor ``[L_i]`` (prompt + response),
    the same on every rank. A local position holding within-sample position ``p`` gets
    ``tokens[i][p + 1]``; padding and each sample's last position get ``fill``. Under
    allgather the last position of rank ``r`` takes its target from the next piece, read
    from ``tokens``: no communication. ``T`` as in ``pack``.

    Raises:
        TypeError: ``tokens`` is not a list of integer tensors.
        LayoutError: as ``pack``, or a sample's tokens are not 1-D.
    """
    items = checks.per_sample(
        "tokens", tokens, layout.total_lengths, "total_length", uniform=True
    )
    for i, x in enumerate(items):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"sample {i}: tokens[{i}] must be a 1-D integer tensor, got "
                            f"{x.dtype} {tuple(x.shape)}")
    device = items[0].device if items else torch.device("cpu")
    return _lay_out(items, layout, fill, 1, (), torch.int64, device)


def row_temperatures(temperature: object, layout: Layout) -> float | Tensor:
    """A per-sample function's ``temperature`` for every local row: a real as it is, or
    (``n`` reals, an ``[n]`` tensor) each sample's at every row holding one of its tokens
    and 1 at padding rows, ``[T]`` (the layout's ``local_length``, else the least).

    Raises:
        TypeError, LayoutError: as ``_checks.temperatures`` (named by sample).
    """
    tau = checks.temperatures(temperature, layout.num_samples, "sample")
    if isinstance(tau, float):
        return tau
    if not layout.num_samples:
        return torch.ones(default_length(layout), dtype=tau.dtype, device=tau.device)
    return pack([t.expand(n) for t, n in zip(tau, layout.total_lengths)], layout, fill=1.0)


class ResponseRows(NamedTuple):
    """This rank's response rows: ``rows`` in extraction order, ``counts[i]`` of sample i."""

    rows: Rows
    counts: list[int]


def response_rows(layout: Layout, device: torch.device | str | None = None) -> ResponseRows:
    """The local row indices of this rank's response positions, in extraction order.

    ``rows`` lists, sample after sample, exactly the rows ``extract_responses`` returns;
    ``counts[i]`` of them belong to sample ``i``. Run the LM head on just those rows of
    the hidden states (``R x V`` instead of ``T x V``) and feed the result, with
    ``shifted_targets(...)[rows]``, to ``log_probs_and_entropy``; then
    ``torch.split(log_probs, counts)`` gives the per-sample shares.

    Raises:
        LayoutError: an allgather layout without ``local_length`` (there is no local
            tensor to read ``T`` from).
    """
    sel = selection(layout, resolve_length(layout), "response")
    # a copy: the cached selection must not be mutable through the result
    return ResponseRows(sel.rows.to(device or "cpu", copy=True), list(sel.counts))
