"""float64 whole-response references for the per-sample reducers (``sample_means``,
``sample_max``, ``sample_min``): one sample at a time, on whole responses ``[R_i]`` or
``[R_i, *m]``, the masks' nonzero positions only (a masked -inf or NaN never enters)."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def masked_means(
    values: Sequence[Tensor], masks: Sequence[Tensor], denominators: Sequence[float] | Tensor | None = None
) -> Tensor:
    """``[n]`` or ``[n, *m]``: each sample's sum of value * mask over its unmasked tokens,
    divided by its mask's sum (or ``denominators[i]``), 0 where that is 0;
    differentiable in ``values``."""
    means = []
    for i, (v, m) in enumerate(zip(values, masks)):
        on = m != 0
        weight = m[on].double().view(-1, *[1] * (v.dim() - 1))
        total = (v[on].double() * weight).sum(0)
        d = float(m.double().sum()) if denominators is None else float(denominators[i])
        means.append(total / d if d else total * 0)
    return torch.stack(means) if means else torch.zeros(0, dtype=torch.float64)


def masked_extreme(values: Sequence[Tensor], masks: Sequence[Tensor], largest: bool) -> Tensor:
    """``[n]`` or ``[n, *m]``: each sample's maximum (``largest``) or minimum over its
    unmasked tokens, -inf (+inf) where none is."""
    out = []
    for v, m in zip(values, masks):
        on = v.detach().double()[m != 0]
        if len(on):
            out.append(on.amax(0) if largest else on.amin(0))
        else:
            out.append(torch.full(v.shape[1:], -math.inf if largest else math.inf, dtype=torch.float64))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)
