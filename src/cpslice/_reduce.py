"""Loss reducers under CP, with no communication: each rank's partial result sums
over the CP group to exactly the no-CP result."""

from collections.abc import Sequence

import torch
from torch import Tensor

from ._cache import cached
from ._checks import per_sample
from ._extract import shard_responses
from ._layout import Layout
from ._plan import resolve_length, selection
from ._types import Mask, Share1D


def _masked(
    values: Sequence[Share1D], loss_masks: Sequence[Mask], layout: Layout
) -> tuple[Tensor, Tensor]:
    """Per sample: the sum of value * mask over this rank's share, and the whole mask sum."""
    counts = selection(layout, resolve_length(layout, what="the layout"), "response").counts
    per_sample("values", values, counts, "this rank's share", one_dim=True, floating=True)
    per_sample("loss_masks", loss_masks, layout.response_lengths, "response_length", one_dim=True)
    mask_shares = shard_responses(loss_masks, layout)
    n = layout.num_samples
    flat = torch.cat(list(values)) if n else torch.zeros(0)
    device, dtype = flat.device, flat.dtype
    mask = torch.cat(mask_shares).to(device=device, dtype=dtype) if n else flat
    # where, not a bare product: a masked -inf or NaN must not poison the sum
    masked = torch.where(mask != 0, flat * mask, torch.zeros_like(flat))
    whole = torch.cat(list(loss_masks)).to(device=device, dtype=dtype) if n else flat
    return _per_sample(masked, counts), _per_sample(whole, list(layout.response_lengths))


@cached(maxsize=8)
def _sample_of(counts: tuple[int, ...], device: torch.device) -> Tensor:
    """The sample of each element of ``counts``' consecutive runs, on ``device``, once."""
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
    return index.to(device)


def _per_sample(x: Tensor, counts: list[int]) -> Tensor:
    """Sums of consecutive runs of ``counts[i]`` elements of ``x``: one per sample."""
    sample = _sample_of(tuple(counts), x.device)
    return torch.zeros(len(counts), dtype=x.dtype, device=x.device).index_add(0, sample, x)


def sum_of_sample_means(
    values: Sequence[Share1D], loss_masks: Sequence[Mask], layout: Layout
) -> Tensor:
    """This rank's part of ``sum_i mean_i``, the masked mean of each sample's response.

    ``values[i]`` is this rank's share ``[r_i]`` (from ``extract_responses``);
    ``loss_masks[i]`` is sample ``i``'s *whole* mask ``[R_i]`` (bool or float, the same
    on every rank). Each sample's masked sum over the share is divided by the whole
    mask's sum, so the parts sum over the CP group to exactly the no-CP result; a fully
    masked sample contributes zero, without dividing by zero. No communication; the
    result is a scalar connected to every share, so every rank's backward reaches the
    same collectives. Divide by the number of samples for a sequence-mean loss.

    Raises:
        LayoutError: a list or share length disagrees with the layout.
    """
    per_sample, whole = _masked(values, loss_masks, layout)
    return (per_sample / torch.where(whole == 0, torch.ones_like(whole), whole)).sum()


def sum_of_tokens(
    values: Sequence[Share1D], loss_masks: Sequence[Mask], layout: Layout
) -> Tensor:
    """This rank's part of ``sum`` of ``value * mask`` over every response token.

    Arguments as ``sum_of_sample_means``. The parts sum over the CP group to the no-CP
    token sum; divide by the global mask sum (every rank can compute it from the whole
    masks) for a token-mean loss. No communication.
    """
    per_sample, _ = _masked(values, loss_masks, layout)
    return per_sample.sum()
