"""The dense kernels over a block of logits: statistics forward, gradient backward.

A block ``x`` is ``[n, V]`` logits of any float dtype (a row chunk of the logits, a
``[rows, V_block]`` matmul block); the arithmetic runs in ``compute_dtype``. ``stats``
writes each row's ``m``, ``S`` and ``A`` into a ``stats.RowStats`` (the driver picks the
logits at the picked ids, one gather);
``grad`` writes each row's gradient ``p * (a log p + b)`` plus the one-hot terms of its
picked ids (``gradient.RowGrad``) into ``out``, rounded once to ``out``'s dtype. Both take
the rows to compute as an index (``rows``, see ``_vocab.rows``; None: every row) and
never read or write another row. Both always do their job, by the first backend of
the selection's chain (``backends.selection.run``: from the one ``CPSLICE_BACKEND``
chooses down, the first that takes the block and computes): the Triton kernels
(``backends.triton``), the compiled kernels (``backends.compiled``) where the selection
and the block allow, the eager loop (``backends.eager``), chunk by chunk
(``backends.chunks.Chunks``), a piece of rows that are not consecutive gathered into its
work buffers. This module is the default reduction's interface, the one the drivers
call; the backends' code is theirs.
"""

from torch import Tensor

from .. import _probe
from .backends import selection
from .backends.chunks import Chunks, Workspace
from .backends.interface import Task
from .gradient import RowGrad
from .rows import count
from .softmax import Softmax
from .stats import RowStats


def stats(
    x: Tensor, softmax: Softmax, out: RowStats, *, chunks: Chunks, rows: Tensor | None = None,
    work: Workspace | None = None,
) -> None:
    """Write ``m``, ``S`` and, where ``out.ent`` is not None, ``A`` of the ``rows`` of the
    block ``x`` (an ascending int64 index on its device, ``_vocab.rows``; None: every
    row) into ``out`` (``[n]`` fields of the compute dtype; the other rows are neither
    read nor written, e.g. ``stats.placeholders``), of the logits as ``softmax`` reads
    them (capped, then tempered; the max is the capped logits'). A block of no columns
    (a shard of padded ids only) has ``m = -inf`` and ``S = A = 0``. The compiled
    kernels run on full chunks of the selected rows, whatever their runs."""
    if _probe.active is not None:
        _probe.active.call("stats", count(rows, x.shape[0]), rows)
    buffers = work or Workspace()
    selection.run(Task.of(x, rows), lambda b: b.stats(x, softmax, out, rows, chunks, buffers))


def grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, *, chunks: Chunks,
    rows: Tensor | None = None, work: Workspace | None = None,
) -> None:
    """Write the gradient w.r.t. the raw logits of the ``rows`` of the block ``x`` (as
    ``stats`` takes them; None: every row) into ``out`` (``[n, V]`` with contiguous
    rows, its dtype; the other rows are neither read nor written): ``p * (a log p +
    b)`` with ``M``, ``log S`` the rows' totals, plus the one-hot terms of ``row``,
    through the cap's ``tanh``."""
    if _probe.active is not None:
        _probe.active.call("grad", count(rows, x.shape[0]), rows)
    buffers = work or Workspace()
    selection.run(Task.of(x, rows), lambda b: b.grad(x, big_m, log_s, softmax, row, out, rows, chunks, buffers))
