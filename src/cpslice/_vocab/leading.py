"""N-dimensional logits: ``[..., V_local]``, whose leading dimensions index the rows.

The engine computes on ``[T, V_local]`` rows. A public function that takes ``[...,
V_local]`` logits (a Hugging Face model's ``[B, S, V]``, or any number of leading
dimensions) flattens them at its entry, ``T`` the product of the leading shape, every
per-row tensor with them, and gives its results that leading shape back:

    lead = Leading.of("logits", x)                  # x checked: floating point, >= 2-D
    rows = lead.flat(x)                             # [T, V_local]
    targets = lead.per_row("targets", targets)      # [...] -> [T]
    ids = lead.per_row("ids", ids, last="k")        # [..., k] -> [T, k], k >= 1
    tau = lead.temperature(temperature)             # a [...] tensor -> [T]
    ...                                             # the engine, on [T, V_local] rows
    return lead.restore(log_probs)                  # [T, *rest] -> [..., *rest]

A 2-D call is untouched: ``flat``, ``per_row`` (after its check), ``temperature`` and
``restore`` hand back the very tensor they were given, so ``[T, V]`` inputs take exactly
the path they always took (no view in the graph, every bit the same). Otherwise
``flat`` is ``reshape``: a view wherever the leading dimensions merge (a contiguous
tensor; any tensor whose rows are evenly spaced, e.g. a slice of the vocabulary), else
one copy of the logits, which the engine holds until backward (e.g. ``x[:, :-1]`` of a
``[B, S, V]`` tensor, a transposed ``[S, B, V]``). The caller's tensor is never
modified; gradients reach it in its own shape through the view or the copy. Row-indexed
arguments that are not tensors of the leading shape (a ``Support``, the rows of
``Options.rows``) are over the flattened rows, row ``t`` the ``t``-th in C order.
"""

import math
from dataclasses import dataclass
from typing import overload

from torch import Tensor

from .._errors import LayoutError
from .._types import TemperatureArg
from .dtensor import replicated


@dataclass(frozen=True)
class Leading:
    """The shape ``full`` (``[..., V_local]``) of one call's logits, named ``name`` in
    messages: its leading shape ``shape`` (``[...]``), its ``rows`` (``T``, their product)
    and whether it is more than 2-D (``nd``)."""

    name: str
    full: tuple[int, ...]

    @classmethod
    def of(cls, name: str, x: Tensor) -> "Leading":
        """The leading shape of ``x``, a tensor already checked to be at least 2-D."""
        assert x.dim() >= 2, x.shape
        return cls(name, tuple(x.shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading shape ``[...]``: the shape of one value per row."""
        return self.full[:-1]

    @property
    def rows(self) -> int:
        """``T``, the flattened rows."""
        return math.prod(self.shape)

    @property
    def nd(self) -> bool:
        """Whether the logits have more than one leading dimension."""
        return len(self.full) > 2

    def flat(self, x: Tensor) -> Tensor:
        """``x`` (``[..., n]`` of this leading shape) as ``[T, n]``: ``x`` itself when 2-D,
        else ``reshape`` (a view where one suffices, else a copy)."""
        return x.reshape(self.rows, x.shape[-1]) if self.nd else x

    def per_row(self, name: str, x: Tensor, last: str | None = None) -> Tensor:
        """A tensor of one value per row (``last`` None: ``[...]``) or of ``n >= 1`` per row
        (``[..., n]``, ``last`` the name of ``n``), checked against the leading shape and
        flattened to ``[T]`` or ``[T, n]`` (``x`` itself when 2-D).

        Raises:
            LayoutError: another shape; the message names both shapes.
        """
        lead = len(self.shape)
        want = lead + (last is not None)
        if x.dim() != want or tuple(x.shape[:lead]) != self.shape or (last is not None and x.shape[-1] < 1):
            dims = ", ".join(map(str, self.shape))
            rule = (f"[...] = [{dims}], one per row" if last is None else
                    f"[..., {last}] = [{dims}, {last}], {last} >= 1 per row")
            raise LayoutError(
                f"{name} has shape {tuple(x.shape)} but {self.name} has shape {self.full}; {name} must be "
                f"{rule} (the leading shape of {self.name}, {self.name}.shape[:-1])"
            )
        return x.reshape(self.rows, *x.shape[lead:]) if self.nd else x

    def temperature(self, value: TemperatureArg) -> TemperatureArg:
        """A per-row temperature of the leading shape flattened to ``[T]``; a flattened
        ``[T]`` one, a number, or anything the temperature's own checks refuse as given
        (``value`` itself when 2-D).

        Raises:
            LayoutError: under N-d logits, a floating-point tensor of another shape.
        """
        if not self.nd:
            return value
        tau = replicated("temperature", value)
        if not isinstance(tau, Tensor) or not tau.is_floating_point() or tuple(tau.shape) == (self.rows,):
            return value
        if tuple(tau.shape) == self.shape:
            return tau.reshape(self.rows)
        raise LayoutError(
            f"temperature has shape {tuple(tau.shape)} but {self.name} has shape {self.full}; one "
            f"temperature per row is [...] = [{', '.join(map(str, self.shape))}] ({self.name}.shape[:-1]) "
            f"or flattened [T] = [{self.rows}] (or pass one real number for all)"
        )

    @overload
    def restore(self, result: Tensor) -> Tensor: ...
    @overload
    def restore(self, result: None) -> None: ...
    def restore(self, result: Tensor | None) -> Tensor | None:
        """A result ``[T, *rest]`` as ``[..., *rest]`` (a view; the result itself when 2-D,
        None as None)."""
        if result is None or not self.nd:
            return result
        return result.reshape(*self.shape, *result.shape[1:])
