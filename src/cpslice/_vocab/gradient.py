"""The gradient's per-row terms, from the upstream gradients to what the kernels apply.

The gradient of ``sum_j g_j log p_j + g_H H`` w.r.t. a logit ``x_c`` of a row (``stats``'
module docstring has ``log p`` and ``H``) is

    p_c * (a log p_c + b) + sum of g_j / tau over the picked ids j at column c,
    a = -g_H / tau,   b = -(sum_j g_j + g_H H) / tau,

times the cap's derivative with a cap: ``RowGrad`` holds ``a``, ``b`` and the one-hot
terms (``row_grad``: the temperature's derivative, the ``1 / tau``, is there);
``pick_grad`` computes the whole entry at each picked id, for the kernels that leave the
one-hot terms out of their loop.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from .softmax import Softmax, Tau, per_row, scaled, slope_of_capped
from .spec import FLOOR


class RowGrad(NamedTuple):
    """The per-row terms of the logits' gradient on one shard (module docstring): the
    coefficients ``a`` (None without an entropy gradient) and ``b``, and ``hot`` ``[T, k]``,
    ``g_j / tau`` at each picked id's ``column`` ``[T, k]`` where this shard holds it
    (else 0; None without a log-prob gradient)."""

    a: Tensor | None
    b: Tensor
    hot: Tensor | None
    column: Tensor

    def rows(self, index: Tensor | slice) -> "RowGrad":
        """The terms of some rows (a slice, or an index)."""
        return RowGrad(None if self.a is None else self.a[index], self.b[index],
                       None if self.hot is None else self.hot[index], self.column[index])


def row_grad(
    g_lp: Tensor,
    g_entropy: Tensor | None,
    entropy: Tensor | None,
    tau: Tau,
    column: Tensor,
    held: Tensor,
    *,
    with_hot: bool,
) -> RowGrad:
    """``RowGrad`` from the upstream gradients ``g_lp`` ``[T, k]`` and ``g_entropy`` ``[T]``
    (None: none) and the saved entropy.

    A row's ``g_H H`` term is kept where ``g_H`` is 0 and ``H`` is not finite (NaN then):
    no kernel reads it there. A row whose token set took its entropy (``entropy_over=
    "support"``: its ``H`` the set's, whatever its dense statistics) is no row of the dense
    backward (the logits path's index and the hidden path's blocks hold the rows its dense
    forward read); and where the dense backward computes a row whose dense ``H`` is not
    finite, that row's own logits (``+inf``, NaN, all ``-inf``) already make every entry of
    its gradient NaN. tests/vocabulary/test_support.py's
    ``test_a_set_row_whose_statistics_are_not_finite_touches_nothing_outside_its_set``."""
    g_sum = g_lp.sum(1)
    hot = torch.where(held, g_lp / per_row(tau), 0.0) if with_hot else None
    if g_entropy is None:
        return RowGrad(None, -g_sum / tau, hot, column)
    assert entropy is not None
    g_h = g_entropy.to(g_lp.dtype)
    return RowGrad(-g_h / tau, -(g_sum + g_h * entropy) / tau, hot, column)


def pick_grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, grad: RowGrad, vocab: int
) -> Tensor:
    """``[T, k]``: the whole gradient w.r.t. the raw logit at each picked id's column of a
    ``[T, vocab]`` block (``x`` ``[T, k]`` the logits there), the one-hot terms of every
    picked id at that column included, through the cap's ``tanh``, in the compute dtype:
    the entries a kernel that leaves the one-hot terms out must overwrite."""
    b = grad.b[:, None]
    y = softmax.logits(x.to(b.dtype))
    d = (scaled(y, big_m, softmax.tau) - log_s[:, None]).clamp(min=FLOOR)
    factor = b if grad.a is None else grad.a[:, None] * d + b
    value = torch.exp(d) * factor
    if grad.hot is not None and grad.hot.shape[1] == 1:
        value = value + grad.hot
    elif grad.hot is not None:
        # ids repeated in a row: every copy's entry holds the one-hot terms of all copies
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        _, copy = torch.unique(rows * vocab + grad.column, return_inverse=True)
        hot = grad.hot.new_zeros(x.numel()).index_add_(0, copy.view(-1), grad.hot.reshape(-1))
        value = value + hot[copy]
    if softmax.cap is None:
        return value
    return value * slope_of_capped(y, softmax.cap)
