"""The local inverse of the CP split: every CP rank's local tensor, gathered by the
caller in rank order, put back into the packed stream of the layout without CP.

verl's ``postprocess_packed_seqs`` and AReaL's packed-CP postprocessing all-gather the
ranks' outputs themselves, then reassemble them; this is that reassembly for any layout,
one gather over an index that ``plan.py`` reads from the layout's placement (the inverse of
``Layout.order``). No communication.
"""

import torch

from .._checks import kind
from .._errors import LayoutError
from .._types import Gathered, Stream
from .layout import Layout
from .plan import resolve, stream_rows


def _pieces_length(gathered: object, layout: Layout) -> tuple[torch.Tensor, int]:
    """``gathered`` checked, and ``T``, each rank's rows in it (``gathered.shape[0] /
    cp_size``, the layout's ``local_length`` when it declares one)."""
    if not isinstance(gathered, torch.Tensor):
        raise TypeError(f"gathered must be a torch.Tensor [cp_size * T, ...], got {kind(gathered)}")
    if gathered.dim() == 0:
        raise TypeError("gathered is 0-d; it needs a leading dimension of cp_size * T rows [cp_size * T, ...]")
    rows, size, declared = int(gathered.shape[0]), layout.cp_size, layout.local_length
    if declared is not None and rows != size * declared:
        raise LayoutError(
            f"gathered has {rows} rows but cp_size * local_length = {size} * {declared} = {size * declared} "
            "(every CP rank's local tensor of local_length rows, concatenated in rank order)"
        )
    if rows % size:
        raise LayoutError(
            f"gathered has {rows} rows, which cp_size {size} does not divide (every CP rank's local "
            "tensor of T rows, concatenated in rank order: cp_size * T rows)"
        )
    return gathered, rows // size


def unshard(gathered: Gathered, layout: Layout) -> Stream:
    """Put every CP rank's local tensor back into the packed stream without CP.

    For frameworks that all-gather the ranks' outputs themselves (verl's
    ``postprocess_packed_seqs``, AReaL's packed context parallelism): the inverse of the
    CP split, computed locally from any rank's layout.

    Args:
        gathered: ``[cp_size * T, *rest]``, any dtype: every CP rank's local tensor of
            ``T`` rows (its logits, log-probs, hidden states, tokens), concatenated in rank
            order (``torch.cat`` of an all-gather's list). ``T`` is the layout's
            ``local_length`` when it declares one, else ``gathered.shape[0] / cp_size``,
            at least what the layout needs.
        layout: any rank's layout of the CP group (its ``cp_rank`` is not read).

    Returns:
        ``[N, *rest]``, ``N = sum(layout.padded_lengths)``: the samples' extents back to
        back, as the layout without CP lays them out. Sample ``i`` (with
        ``shared_prefix``, star ``j``) holds rows ``[W_0 + ... + W_{i-1}, ... + W_i)``,
        its tokens ``o_i`` rows into them (``layout.row_offsets``: a left-padded bshd
        row's), padding rows where its extent has padding (a zigzag or ``align`` pad; a
        bshd row is ``W`` columns, ``max_seq_len`` rounded up to a multiple of
        ``2 * cp_size`` under zigzag). So if rank ``r``'s rows are ``pack(per_sample,
        layout.for_rank(r))``, the result is ``pack(per_sample, no_cp)``, ``no_cp`` the
        same samples with ``cp_mode="none"`` and the same extents (thd:
        ``padded_lengths=layout.padded_lengths``; bshd: ``max_seq_len=W`` and the same
        ``row_offsets``); row ``q`` is the row ``layout.order()`` places at stream
        position ``q``. Rows of ``gathered`` that hold no position (an allgather's tail,
        rows past what the layout needs) are left out. One gather (``index_select``):
        differentiable, the gradient flows back to ``gathered``'s rows; ``gathered`` is
        never modified. No communication.

    Raises:
        TypeError: ``gathered`` is not a tensor of at least 1 dim.
        LayoutError: ``gathered.shape[0]`` is not ``cp_size * local_length`` (a layout
            that declares it) or not a multiple of ``cp_size``; ``T`` is shorter than the
            layout needs.
    """
    x, length = _pieces_length(gathered, layout)
    local = resolve(layout, length, "each CP rank's piece of gathered (gathered.shape[0] / cp_size)",
                    device=x.device)
    return x.index_select(0, stream_rows(local))
