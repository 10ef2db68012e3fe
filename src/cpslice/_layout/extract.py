"""Extraction: each sample's share of the response from one rank's local tensor.

No communication. One gather and one split per tensor, whatever the number of
samples; the row index comes from the layout's cached selection (``plan.py``).
"""

from collections.abc import Sequence
from typing import overload

import torch
from torch import Tensor

from .._checks import depth as check_depth
from .._checks import per_position, per_sample
from .._errors import LayoutError
from .._types import AnyShare, IntArg, Share, Strategy, Values
from .layout import Layout
from .plan import Local, Read, resolve, strategy


def extraction_strategy(layout: Layout) -> Strategy:
    """Which strategy ``extract_responses`` runs for ``layout``, without running it.

    The decision table (docs/layouts.md gives the arithmetic of each):

    ============  ==========  =============  ==========================================
    cp_mode       qkv_format  strategy       a sample's rows on this rank
    ============  ==========  =============  ==========================================
    ``none``      thd         ``none-thd``   one run at the sample's packed offset
    ``none``      bshd        ``none-bshd``  one run at ``i * max_seq_len + o_i``
                                             (``o_i``: ``row_offsets``, 0 unless given)
    ``zigzag``    thd / bshd  ``zigzag``     two runs: chunks ``r`` and ``2c-1-r`` of
                                             the sample padded to a multiple of ``2c``
    ``allgather`` thd         ``allgather``  the packed stream cut into ``cp_size``
                                             pieces of ``T``: at most one run, which
                                             may be empty or straddle ranks
    ``order``     thd / bshd  ``order``      ``Layout.from_order``: as many runs as the
                                             order's pieces of the sample on this rank
    ============  ==========  =============  ==========================================

    Every strategy then runs the same engine: intersect its runs with the response
    span ``[P_i - 1, L_i - 1)``, gather the rows once and split once, so the
    strategies differ only in where a sample's positions sit. Samples that carry
    their own padding (thd ``padded_lengths`` / ``align``) take the same strategy:
    the packed offsets, the zigzag chunks and the stream read the padded extents
    ``layout.padded_lengths`` instead of the defaults; so do left-padded bshd rows
    (``row_offsets``), whose runs start at their rows' first tokens.
    """
    return strategy(layout)


def gather_split(values: Tensor, rows: Tensor, counts: list[int]) -> list[Tensor]:
    """``values[rows]`` split into per-sample pieces; each empty piece is ``values[:0]``.

    ``values[:0]`` is a zero-length view of the input itself: same dtype, device,
    trailing shape and autograd graph, never a fresh tensor.
    """
    # Views cost microseconds each: split only the non-empty shares (under allgather
    # most samples are empty on most ranks).
    parts = iter(torch.split(values.index_select(0, rows), [c for c in counts if c]))
    empty = values[:0]
    return [next(parts) if count else empty for count in counts]


def picked_ids(read: Read, ids: Tensor, rows: int | None = None) -> Tensor:
    """The vocabulary engine's ids for the elements of a response ``read`` that pick
    ``ids`` (``[E]``, or ``[E, k]`` each): over the ``rows`` local rows (``[T]`` or
    ``[T, m * k]``), or with ``rows`` None over the read's distinct rows (``Picks.rows``).
    ``m = Picks.k`` picks per row (1 unless rows are shared: then a row's slots hold its
    elements' ids in turn, its first element's in the slots it does not use)."""
    p = read.picks
    at = read.rows if rows is not None else p.element
    count = int(p.rows.numel()) if rows is None else rows
    k = 1 if ids.dim() == 1 else int(ids.shape[1])
    flat = ids.reshape(-1, k)
    out = torch.zeros((count, k), dtype=ids.dtype, device=ids.device)
    if p.k == 1:  # every element its own row: no mask (a mask's nonzero would sync a device)
        out = out.index_copy(0, at, flat)
        return out[:, 0] if ids.dim() == 1 else out
    first = (p.host_slot == 0).nonzero()[:, 0].to(ids.device)
    out = out.index_copy(0, at.index_select(0, first), flat.index_select(0, first))
    return out.repeat(1, p.k).view(count, p.k, k).index_put((at, p.slot), flat).view(count, p.k * k)


def picked_values(read: Read, values: Tensor, k: int | None = None, local: bool = True) -> Tensor:
    """Each element's result from the engine's output over the rows of ``picked_ids``
    (``local``: the local rows; else the distinct rows): ``[E]`` from ``[rows]`` or
    ``[rows, m]``; ``[E, k]`` from ``[rows, m * k]`` (``k`` ids per element)."""
    p = read.picks
    at = read.rows if local else p.element
    if p.k == 1:
        return values.index_select(0, at)
    if k is None:
        return values[at, p.slot]
    return values.view(values.shape[0], p.k, k)[at, p.slot]


def split_elements(read: Read, values: Tensor) -> list[Tensor]:
    """Per-element ``values`` (``[E, *rest]``, extraction order) split per sample."""
    return list(torch.split(values, read.selection.counts))


def split(local: Local, values: Tensor, entropy: Tensor | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
    """``extract_responses`` of checked ``values`` (and ``entropy``) in a layout resolved
    with the ``"response"`` span on their device."""
    read = local.reads["response"]
    out = gather_split(values, read.rows, read.selection.counts)
    return out, None if entropy is None else gather_split(entropy, read.rows, read.selection.counts)


@overload
def extract_responses(
    values: Values, layout: Layout, entropy: None = None, *, depth: IntArg = 0
) -> tuple[list[Share], None]: ...
@overload
def extract_responses(
    values: Values, layout: Layout, entropy: Values, *, depth: IntArg = 0
) -> tuple[list[Share], list[Share]]: ...
@overload
def extract_responses(
    values: Values, layout: Layout, entropy: Values | None, *, depth: IntArg = 0
) -> tuple[list[Share], list[Share] | None]: ...
def extract_responses(
    values: Values, layout: Layout, entropy: Values | None = None, *, depth: IntArg = 0
) -> tuple[list[Share], list[Share] | None]:
    """Cut each sample's share of the response out of this rank's per-position tensor.

    Args:
        values: ``[T, *rest]`` floating point, this rank's local tensor (log-probs
            ``[T]``, value-head outputs ``[T]`` or ``[T, 1]``, top-k ``[T, k]``),
            laid out as ``layout`` says; position ``p`` predicts token ``p + 1``.
        layout: this rank's layout.
        entropy: a tensor of the same shape, or None.
        depth: keyword-only, ``d >= 0``: ``values`` come from a head that predicts token
            ``p + 1 + d`` at position ``p`` (multi-token prediction); the shares are the
            positions ``[P_i - 1 - d, L_i - 1 - d)`` from 0, so a sample whose prompt is
            shorter than ``d + 1`` loses its first ``d + 1 - P_i`` response tokens.

    Returns:
        ``(per_sample_values, per_sample_entropy)``: one ``[r_i, *rest]`` tensor per
        sample, ``r_i`` being this rank's share of sample ``i``'s response, in
        ascending position order; the entropy list is aligned with the first, or
        None when no entropy was given. An empty share is a zero-length view of the
        input (graph kept), never None. With a shared prefix, a group's prompt rows
        that predict response tokens are in the share of every branch (their
        gradient the sum over the branches).

    Raises:
        TypeError: values or entropy is not a floating-point tensor of at least 1 dim;
            ``depth`` not an int.
        LayoutError: the local length differs from the layout's: its ``local_length``
            (which may declare trailing padding), else exactly the least length it
            needs (a longer tensor is no padding); entropy's shape differs from
            values'; a negative ``depth``.
    """
    x = per_position("values", values)
    if entropy is not None:
        per_position("entropy", entropy)
        if entropy.shape != x.shape:
            raise LayoutError(
                f"entropy has shape {tuple(entropy.shape)} but values has "
                f"{tuple(x.shape)} (they must be aligned position by position)"
            )
    d = check_depth(depth)
    local = resolve(layout, int(x.shape[0]), "values", ("response",), x.device, depth=d)
    return split(local, x, entropy)


def shard_responses(full: Sequence[AnyShare], layout: Layout, *, depth: IntArg = 0) -> list[AnyShare]:
    """This rank's share of each sample's whole response-aligned tensor; no communication.

    The inverse reading of ``extract_responses``: ``full[i]`` is ``[R_i, *rest]``
    (rollout log-probs, advantages, loss masks; any dtype), and the result holds, for
    each sample, exactly the response positions ``extract_responses`` returns on this
    rank, in the same order (at ``depth``, those of ``extract_responses(..., depth=d)``).
    A share that is one contiguous piece (always, except a zigzag sample whose
    response touches both chunks of this rank, or a branch of a shared prefix whose
    share begins on the prompt) is a view.

    Raises:
        TypeError: ``full`` is not a sequence of tensors of at least 1 dim; ``depth``
            not an int.
        LayoutError: the number of samples, or a sample's length, disagrees with
            the layout; an allgather layout without ``local_length``; a negative depth.
    """
    items = per_sample("full", full, layout.response_lengths, "response_length")
    return shard(items, resolve(layout, spans=("response",), depth=check_depth(depth)))


def shard(full: Sequence[Tensor], local: Local) -> list[Tensor]:
    """``shard_responses`` of checked whole responses in a layout resolved with the
    ``"response"`` span."""
    out: list[Tensor] = []
    for f, runs in zip(full, local.reads["response"].whole_runs, strict=True):
        pieces = [f.narrow(0, start, size) for start, size in runs]
        if not pieces:
            out.append(f[:0])
        elif len(pieces) == 1:
            out.append(pieces[0])
        else:
            out.append(torch.cat(pieces))
    return out
