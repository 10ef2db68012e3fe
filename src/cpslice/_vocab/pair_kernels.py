"""A divergence's kernels over a block of both sides' logits, the interface its driver
calls (``divergence``): ``stats`` and ``mix`` forward, ``grad`` backward, default
reduction and invariant mode alike (``softmax.invariant``).

A block is the weight side's and the other side's ``[n, v]`` logits over the same
columns (``pairs``: ``xw``, ``xo``), of any float dtypes; the arithmetic runs in the
pair's compute dtype. Each takes the rows to compute as an index (``rows``, see
``_vocab.rows``; None: every row) and never reads or writes another row. Each always
does its job, by the first backend of the selection's chain that takes the block and
computes (``backends.selection.run``): the Triton kernels (default reduction; they
decline invariant mode), the compiled bodies (default reduction, where they pay) and
the eager ones (``backends.divergence``: the default bodies chunk by chunk, or invariant
mode's spec per tile).
"""

import torch
from torch import Tensor

from .. import _probe
from .backends import selection
from .backends.chunks import Chunks
from .backends.interface import Task
from .pairs import Mix, PairGrad, PairOut, Sides, Weights
from .rows import count
from .softmax import Softmax


def task(xw: Tensor, xo: Tensor, rows: Tensor | None, invariant: bool) -> Task:
    """The task of a block of a pair: its device, the sides' common dtype (float64 if either
    is), the rows and columns, whether both sides' columns are contiguous."""
    contiguous = xw.stride(-1) == 1 and xo.stride(-1) == 1
    dtype = xw.dtype if xw.dtype == xo.dtype else torch.promote_types(xw.dtype, xo.dtype)
    return Task(xw.device, dtype, count(rows, xw.shape[0]), int(xw.shape[1]), contiguous, invariant)


def _call(name: str, xw: Tensor, rows: Tensor | None, invariant: bool) -> None:
    if _probe.active is not None:
        _probe.active.call(name, count(rows, xw.shape[0]), rows, invariant=invariant)


def stats(
    xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, *, chunks: Chunks, rows: Tensor | None = None,
    first: int = 0,
) -> None:
    """Write each side's max and sum, and ``C`` where ``out.cross`` is not None, of the
    ``rows`` of the block into ``out`` (``[n]`` fields of the compute dtype; in invariant
    mode per tile from local tile ``first`` where ``out`` is ``PairTiles``). A block of
    no columns has ``m = -inf`` and ``S = C = 0``."""
    _call("pair_stats", xw, rows, softmax.invariant)
    if xw.shape[1] == 0:
        every = slice(None) if rows is None else rows
        out.wmax[every], out.omax[every], out.wsum[every], out.osum[every] = -torch.inf, -torch.inf, 0.0, 0.0
        if out.cross is not None:
            out.cross[every] = 0.0
        return
    selection.run(task(xw, xo, rows, softmax.invariant),
                  lambda b: b.pair_stats(xw, xo, softmax, out, rows, chunks, first))


def mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, sides: Sides, weights: Weights, out: Mix, *, chunks: Chunks,
    rows: Tensor | None = None, first: int = 0,
) -> None:
    """Write ``"jsd"``'s ``Q`` and ``P`` of the ``rows`` of the block into ``out``, both sides
    normalized by ``sides`` (the whole vocabulary's)."""
    _call("pair_mix", xw, rows, softmax.invariant)
    if xw.shape[1] == 0:
        every = slice(None) if rows is None else rows
        out.wsum[every], out.osum[every] = 0.0, 0.0
        return
    selection.run(task(xw, xo, rows, softmax.invariant),
                  lambda b: b.pair_mix(xw, xo, softmax, sides, weights, out, rows, chunks, first))


def grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None, *,
    chunks: Chunks, rows: Tensor | None = None,
) -> None:
    """Write each wanted side's gradient w.r.t. its raw logits, of the ``rows`` of the
    block, into ``out_w`` / ``out_o`` (``[n, v]`` with contiguous columns, each its dtype;
    None: not wanted); the other rows are neither read nor written."""
    _call("pair_grad", xw, rows, softmax.invariant)
    if xw.shape[1] == 0 or (out_w is None and out_o is None):
        return
    selection.run(task(xw, xo, rows, softmax.invariant),
                  lambda b: b.pair_grad(xw, xo, softmax, terms, out_w, out_o, rows, chunks))
