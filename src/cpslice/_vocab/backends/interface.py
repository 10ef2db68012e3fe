"""The one interface every backend implements (``KernelBackend``), for both heads, and
what a backend is asked to take (``Task``).

A backend is one module (``backends.eager``, ``backends.compiled``, ``backends.triton``)
whose module-level names are this protocol's members (mypy checks each module against
it: tests/project/test_typing_backends.py). The selection (``backends.selection``) holds
the ordered registry of backend modules and picks, for each call, the first one from
the selected backend down whose ``takes`` accepts the task; a kernel that returns False
(or None) declines at run time (a compile failure in ``auto``, a soft cap the compiled
invariant kernels do not take) and the next backend that takes the task runs it.

Three kinds of kernels:

- the logits path's row kernels of the default reduction: ``stats`` (each row's ``m``,
  ``S``, ``A``) and ``grad`` (``p * (a log p + b)`` plus the picked ids' one-hot terms,
  rounded once);
- invariant mode's row kernels (the spec of docs/invariance.md, the eager bits on every
  backend): ``tile_stats`` (per tile, under TP), ``merged_stats`` (each row's tiles
  merged), ``merge_tiles`` (the spec's merge of tiles in global order) and
  ``invariant_grad`` (the dense gradient; the picked ids' entries are the caller's,
  ``invariant.picks``);
- the hidden path's block kernels: ``block_stats`` (a block's logits by a GEMM, then
  their statistics) and ``block_grad`` (the block's logits recomputed, then its logit
  gradient ``G`` in the input dtype). ``backends.gemm`` holds their shared default, a
  torch GEMM then the row kernels of the backends of the chain, which each backend
  takes in one line (``from .gemm import block_grad, block_stats``); a fused GEMM +
  softmax backend would define its own.

Every row kernel takes ``rows``, the ascending int64 index of the rows to compute on
the block's device (``_vocab.rows``; None: every row), and never reads or writes any
other row.
"""

from collections.abc import Iterable
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..gradient import RowGrad
from ..rows import count
from ..softmax import Softmax, Tau
from ..stats import RowStats, Stats, TileStats
from .chunks import Chunks, Workspace

Merged = tuple[Tensor, Tensor, Tensor | None]
"""``(M, S, A)`` of rows whose tiles were merged (``A`` None without entropy)."""
Shape = tuple[int, int] | None
"""A block GEMM's fixed shape ``(rows, columns)``, zero rows padding the block's (invariant
mode: a GEMM of one shape gives a row the same bits whatever the others); None: the
block's own shape."""


class Task(NamedTuple):
    """What a backend is asked to take: a block of logits of ``dtype`` on ``device``, the
    ``rows`` of it to compute of its ``columns``, whether its columns are contiguous (a
    row stride of 1), and the mode (``invariant``). A backend's ``takes`` reads only this;
    a hidden-path block is a task before its GEMM has run."""

    device: torch.device
    dtype: torch.dtype
    rows: int
    columns: int
    contiguous: bool
    invariant: bool

    @classmethod
    def of(cls, x: Tensor, rows: Tensor | None = None, invariant: bool = False) -> "Task":
        """The task of the ``rows`` (None: all) of the block ``x``."""
        return cls(x.device, x.dtype, count(rows, x.shape[0]), int(x.shape[1]), x.stride(-1) == 1, invariant)


@runtime_checkable
class KernelBackend(Protocol):
    """A backend module: its ``NAME`` in ``CPSLICE_BACKEND``, what it takes, and its
    kernels. Every kernel but the block kernels returns whether it computed (False: it
    declined at run time, nothing it wrote is to be read, and the next backend runs)."""

    NAME: str

    def takes(self, task: Task) -> bool:
        """Whether this backend may compute ``task`` (its device, dtype, size and mode).

        Raises:
            RuntimeError: the backend is the one ``CPSLICE_BACKEND`` names and cannot
                run on the task's tensors (``triton``: a CPU tensor outside the
                interpreter).
        """
        ...

    def stats(
        self, x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunks: Chunks, work: Workspace
    ) -> bool:
        """``m``, ``S`` and (``out.ent`` not None) ``A`` of the ``rows`` of ``x`` ``[n, V]``
        into ``out``'s ``[n]`` fields (``kernels.stats``)."""
        ...

    def grad(
        self, x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor,
        rows: Tensor | None, chunks: Chunks, work: Workspace,
    ) -> bool:
        """The gradient w.r.t. the raw logits of the ``rows`` of ``x``, the one-hot terms of
        ``row`` included, rounded once into ``out`` (``kernels.grad``)."""
        ...

    def tile_stats(
        self, x: Tensor, softmax: Softmax, valid: int, out: TileStats, rows: Tensor | None, chunk: int, first: int
    ) -> bool:
        """Invariant mode's per-tile ``(m_j, s_j, a_j)`` of the ``rows`` of ``x`` (``[n, w]``,
        columns ``>= valid`` -inf) into tiles ``first`` on of ``out``; ``chunk`` rows at a
        time where the backend works in chunks."""
        ...

    def merged_stats(self, x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> bool:
        """Invariant mode's ``(M, S, A)`` of the ``rows`` of ``x`` (every column the
        distribution's), its tiles merged in the spec's order, into ``out``'s fields."""
        ...

    def merge_tiles(self, m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged | None:
        """``spec.merge_tiles`` of ``[n, R]`` tiles in global order (None: declined)."""
        ...

    def invariant_grad(
        self, x: Tensor, rows: Tensor | None, r: Tensor, big_m: Tensor, log_s: Tensor, a: Tensor, b: Tensor,
        cap: float | None, chunks: Chunks, out: Tensor,
    ) -> bool:
        """Invariant mode's dense gradient of the ``rows`` of ``x`` (``eager.values``' bits,
        every column) into ``out``; ``r = 1 / tau`` and the row terms ``[n]``."""
        ...

    def block_stats(
        self, chain: Iterable["KernelBackend"], h: Tensor, w: Tensor, softmax: Softmax, out: Stats, shape: Shape,
        first: int, chunks: Chunks, work: Workspace,
    ) -> Tensor:
        """A hidden-path block's statistics: its logits ``h @ w.T`` (``h`` ``[n, H]`` rows,
        ``w`` ``[v, H]`` a vocabulary split; by a GEMM of ``shape``) reduced into ``out``:
        ``RowStats`` by the default reduction, or invariant mode's (``softmax.invariant``)
        per tile from local tile ``first`` (``TileStats``) or merged (``RowStats``).
        ``chain``: the backends that take the block, this one first. Returns the block's
        logits (the caller reads the picked ids' and the top-k from them)."""
        ...

    def block_grad(
        self, chain: Iterable["KernelBackend"], h: Tensor, w: Tensor, big_m: Tensor, log_s: Tensor,
        softmax: Softmax, row: RowGrad, out: Tensor, shape: Shape, chunks: Chunks, work: Workspace,
    ) -> Tensor:
        """A hidden-path block's logit gradient ``G`` into ``out`` (``[n, v]``, the input
        dtype): its logits recomputed by the forward's GEMM (the same bits), then the
        gradient (invariant mode: the dense part; the caller adds the picked ids'). Returns
        the recomputed logits."""
        ...
