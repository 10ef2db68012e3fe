"""What the softmax reads of a logit: the soft cap and the temperature, each written once,
forward and derivative (the reference every kernel calls).

A row's softmax reads ``y / tau``, ``y`` the logit ``x`` soft-capped (``cap * tanh(x /
cap)``, Gemma's ``final_logit_softcapping``) or ``x`` itself, ``tau`` its temperature
(``Tau``: one for every row, or one per row). ``Softmax`` holds a call's ``tau``, ``cap``
and mode. The cap has three forms, each of fixed bits, each written here once with its
derivative:

- torch's ``tanh`` (the default mode's eager kernels and the picked ids' logits):
  ``t = tanh(x / cap)`` (``tanh_``), ``y = t * cap`` (``times_cap``, ``capped_``), ``dy /
  dx = 1 - t^2`` (``slope_``; from ``y`` alone, ``slope_of_capped``);
- one ``exp`` (the default mode's compiled kernels, and the Triton kernels' inline twin):
  ``y = cap - 2 cap / (exp(2 x / cap) + 1)`` (``exp_capped``), or through ``s = 1 - t =
  2 / (exp(2 x / cap) + 1)`` (``exp_complement``): ``y = (1 - s) cap``
  (``from_complement``), ``dy / dx = s (2 - s)`` (``complement_slope``), exact where
  ``t`` is near 1; a vectorized ``tanh`` costs three times one ``exp`` on the CPU;
- invariant mode's (``spec.softcap``, ``spec.softcap_slope``: the spec's ``tanh``).

The temperature: ``d = (y - m) / tau`` a true division per element in the eager default
kernels (``divide_``) and per row (``scaled``); a multiplication by ``1 / tau`` in the
compiled and Triton kernels (``reciprocal``) and invariant mode's (``reciprocals``, one
IEEE division per row of the compute dtype). Its derivative is the gradient's ``1 /
tau`` (``gradient.row_grad``).

The functions the compiled kernels call are plain torch code that dynamo inlines
(``typing.no_type_check``: no debug-mode wrapper).
"""

from typing import NamedTuple, no_type_check

import torch
from torch import Tensor

from .spec import softcap

Tau = float | Tensor
"""A temperature: one for every row, or a ``[T]`` tensor of one per row."""


def per_row(tau: Tau) -> Tau:
    """``tau`` against a row's columns: ``[T, 1]`` for one per row."""
    return tau if isinstance(tau, float) else tau[:, None]


def rows_of(tau: Tau, index: Tensor | slice) -> Tau:
    """``tau`` of some rows (a slice, or a row index per element)."""
    return tau if isinstance(tau, float) else tau[index]


def scaled(y: Tensor, m: Tensor, tau: Tau) -> Tensor:
    """``(y - m) / tau`` of ``[T, k]`` values against each row's ``m`` ``[T]``: a true
    division."""
    return (y - m[:, None]) / per_row(tau)


def divide_(d: Tensor, tau: Tau, at: Tensor | slice) -> None:
    """``d /= tau`` of the rows ``at`` (in place; nothing for a temperature of 1)."""
    if isinstance(tau, float):
        if tau != 1.0:
            d.div_(tau)
    else:
        d.div_(tau[at][:, None])


def reciprocal(tau: Tau, dtype: torch.dtype) -> float | Tensor:
    """``1 / tau``: a number (computed in double), or ``[T]`` of ``dtype`` (one division
    per row): the compiled and Triton kernels multiply by it."""
    return 1.0 / tau if isinstance(tau, float) else 1.0 / tau.to(dtype)


def taus(tau: Tau, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tau`` as a ``[rows]`` tensor (the arguments make it one in invariant mode; a float
    divides the same)."""
    return torch.full((rows,), tau, dtype=dtype, device=device) if isinstance(tau, float) else tau


def reciprocals(tau: Tau, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Invariant mode's ``r = 1 / tau`` ``[rows]``, one IEEE division per row of the compute
    dtype: the spec's per-element temperature is a multiplication by it (a vector
    division costs as much as the exp)."""
    return 1.0 / taus(tau, rows, dtype, device)


def tanh_(y: Tensor, cap: float) -> Tensor:
    """``t = tanh(y / cap)`` by torch's ``tanh``, in place on ``y`` (the compute dtype:
    widen first, a division in bfloat16 is 2e-2 off)."""
    return y.div_(cap).tanh_()


def times_cap(t: Tensor, cap: float, out: Tensor | None = None) -> Tensor:
    """``y = t * cap``, into ``out`` (``t`` itself allowed) or a new tensor."""
    return torch.mul(t, cap) if out is None else torch.mul(t, cap, out=out)


def capped_(y: Tensor, cap: float) -> Tensor:
    """``y = cap * tanh(y / cap)`` by torch's ``tanh``, in place (``tanh_``, ``times_cap``)."""
    return times_cap(tanh_(y, cap), cap, out=y)


def slope_(t: Tensor) -> Tensor:
    """The cap's derivative ``1 - t^2`` from ``tanh_``'s ``t``, in place on ``t``."""
    return t.mul_(t).neg_().add_(1.0)


def slope_of_capped(y: Tensor, cap: float) -> Tensor:
    """The cap's derivative ``1 - (y / cap)^2`` from the capped logits ``y`` alone."""
    return 1 - torch.square(y / cap)


def exp_constants(cap: float) -> tuple[float, float]:
    """``(cap, 2 / cap)``: the one-``exp`` form's constants (the kernels' inputs)."""
    return cap, 2.0 / cap


@no_type_check  # traced inside the compiled kernels
def exp_capped(x, cap, two_over_cap):
    """``cap - 2 cap / (exp(x * 2 / cap) + 1)``: ``cap * tanh(x / cap)`` by one ``exp``,
    within ``cap * eps`` of it (``cap`` and ``two_over_cap`` numbers or 0-d tensors)."""
    return cap - 2 * cap / (torch.exp(x * two_over_cap) + 1)


@no_type_check  # traced inside the compiled kernels
def exp_complement(x, two_over_cap):
    """``s = 1 - tanh(x / cap) = 2 / (exp(x * 2 / cap) + 1)``, by one ``exp``."""
    return 2 / (torch.exp(x * two_over_cap) + 1)


@no_type_check  # traced inside the compiled kernels
def from_complement(s, cap):
    """The capped logit ``(1 - s) * cap`` from ``exp_complement``'s ``s``."""
    return (1 - s) * cap


@no_type_check  # traced inside the compiled kernels
def complement_slope(s):
    """The cap's derivative ``1 - tanh^2 = s (2 - s)`` from ``exp_complement``'s ``s``,
    exact where ``tanh`` is near 1."""
    return s * (2 - s)


class Softmax(NamedTuple):
    """What the softmax reads of a logit ``x``: ``cap * tanh(x / cap) / tau`` (soft-capping,
    Gemma's ``final_logit_softcapping``), or ``x / tau`` without a ``cap``; ``invariant``:
    the cap is invariant mode's (``spec.softcap``: the spec's ``tanh``), not torch's."""

    tau: Tau
    cap: float | None = None
    invariant: bool = False

    def logits(self, x: Tensor) -> Tensor:
        """The (capped) logits ``x`` (the compute dtype), before the temperature; a new
        tensor where capped."""
        if self.cap is None:
            return x
        return softcap(x, self.cap)[0] if self.invariant else capped_(x.clone(), self.cap)

    def rows(self, index: Tensor | slice) -> "Softmax":
        return Softmax(rows_of(self.tau, index), self.cap, self.invariant)
