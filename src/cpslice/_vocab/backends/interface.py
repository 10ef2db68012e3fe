"""The one interface every backend implements (``KernelBackend``), for both heads, and
what a backend is asked to take (``Task``).

A backend is one module (``backends.eager``, ``backends.compiled``, ``backends.triton``)
whose module-level names are this protocol's members (mypy checks each module against
it: tests/project/test_typing_backends.py). The selection (``backends.selection``) holds
the ordered registry of backend modules and picks, for each call, the first one from
the selected backend down whose ``takes`` accepts the task; a kernel that returns False
(or None) declines at run time (a compile failure in ``auto``, a soft cap the compiled
invariant kernels do not take) and the next backend that takes the task runs it.

Four kinds of kernels:

- the logits path's row kernels of the default reduction: ``stats`` (each row's ``m``,
  ``S``, ``A``) and ``grad`` (``p * (a log p + b)`` plus the picked ids' one-hot terms,
  rounded once);
- invariant mode's row kernels (the spec of docs/invariance.md, the eager bits on every
  backend): ``tile_stats`` (per tile, under TP), ``merged_stats`` (each row's tiles
  merged), ``merge_tiles`` (the spec's merge of tiles in global order) and
  ``invariant_grad`` (the dense gradient; the picked ids' entries are the caller's,
  ``invariant.picks``);
- a divergence's pair kernels (``vocab_divergence``: ``pairs``), each over a block of
  both sides' logits: ``pair_stats`` (each side's max and sum, the cross term; per tile
  in invariant mode), ``pair_mix`` (``"jsd"``'s second pass) and ``pair_grad`` (each
  wanted side's gradient, rounded once); their default and invariant bodies are
  ``backends.divergence``'s;
- the hidden path's block kernels: ``block_stats`` (a block's logits by a GEMM, then
  their statistics) and ``block_grad`` (the block's logits recomputed, then its logit
  gradient ``G`` in the input dtype). Their shared default is here, below the protocol
  (``block_stats``, ``block_grad``): a torch GEMM in the input dtype (``logits``:
  cuBLAS or the CPU's BLAS, float32 accumulation; in invariant mode of one fixed
  ``Shape``, the block's rows and columns zero-padded to it), then the row kernels of
  the backends of the chain, the first that computes. Each backend takes it in one line
  (``block_stats, block_grad = interface.block_stats, interface.block_grad``); a fused
  GEMM + softmax backend would define its own.

Every row kernel takes ``rows``, the ascending int64 index of the rows to compute on
the block's device (``_vocab.rows``; None: every row), and never reads or writes any
other row. This module imports only the engine's arithmetic and types, so a backend
module is one import above them.
"""

from collections.abc import Iterable
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from ... import _probe
from ..gradient import RowGrad
from ..pairs import Mix, PairGrad, PairOut, Sides, Weights
from ..rows import count
from ..softmax import Softmax, Tau, reciprocals
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

    def pair_stats(
        self, xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, rows: Tensor | None, chunks: Chunks,
        first: int,
    ) -> bool:
        """A divergence's statistics (``pairs``) of the ``rows`` of a block of both sides'
        logits (``xw`` the weight side, ``xo`` the other, ``[n, v]`` over the same
        columns) into ``out``: each side's max and sum, and ``C`` where ``out.cross`` is not
        None; in invariant mode (``softmax.invariant``) per tile from local tile ``first``
        (``PairTiles``) or merged (``PairStats``)."""
        ...

    def pair_mix(
        self, xw: Tensor, xo: Tensor, softmax: Softmax, sides: Sides, weights: Weights, out: Mix,
        rows: Tensor | None, chunks: Chunks, first: int,
    ) -> bool:
        """``"jsd"``'s second pass: ``Q`` and ``P`` of the ``rows`` into ``out`` (``[n]``, or in
        invariant mode under TP per tile from ``first``), both sides normalized by
        ``sides``."""
        ...

    def pair_grad(
        self, xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None,
        out_o: Tensor | None, rows: Tensor | None, chunks: Chunks,
    ) -> bool:
        """A divergence's gradient w.r.t. each wanted side's raw logits (``out_w``, ``out_o``:
        None where not wanted; ``[n, v]``, contiguous columns, each its dtype), of the
        ``rows``, rounded once."""
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


# --- the block kernels' shared default: a torch GEMM, then the chain's row kernels


ALIGN = 256
"""On CUDA, the bytes a fixed-shape GEMM's operand is aligned to (else copied first):
cuBLASLt's heuristics read each pointer's alignment, up to 256 bytes, and may pick
another kernel for another one."""


def _pad(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows``: ``t`` itself when it has them (on CUDA:
    and its data is ``ALIGN``-byte aligned), else a new tensor."""
    if t.shape[0] >= rows and (t.device.type != "cuda" or t.data_ptr() % ALIGN == 0):
        return t
    return torch.cat([t, t.new_zeros((max(0, rows - t.shape[0]), t.shape[1]))])


def logits(h: Tensor, w: Tensor, shape: Shape) -> Tensor:
    """``h @ w.T`` (``[n, H]`` rows, ``[v, H]`` columns), ``[n, v]``, by the ``block_gemm``
    step (``torch.mm``); with ``shape``, by a GEMM of exactly that shape, zero rows padding
    both (a BLAS picks its kernel, and a row's bits with it, by shape)."""
    mm = _probe.step("block_gemm", torch.mm)
    if shape is None:
        return mm(h, w.t())
    n, v = h.shape[0], w.shape[0]
    return mm(_pad(h, shape[0]), _pad(w, shape[1]).t())[:n, :v]


def product(g: Tensor, w: Tensor, shape: Shape) -> Tensor:
    """``g @ w`` (``[n, v]`` logit gradients, ``[v, H]`` columns), ``[n, H]``; with
    ``shape``, by a GEMM of that shape, as ``logits``."""
    if shape is None:
        return torch.mm(g, w)
    n, v = g.shape
    padded = g.new_zeros(shape)
    padded[:n, :v] = g
    return torch.mm(padded, _pad(w, shape[1]))[:n]


def block_stats(
    chain: Iterable[KernelBackend], h: Tensor, w: Tensor, softmax: Softmax, out: Stats, shape: Shape, first: int,
    chunks: Chunks, work: Workspace,
) -> Tensor:
    """``KernelBackend.block_stats`` by one GEMM, then the first backend of ``chain`` whose
    row kernel computes on the block's logits (their statistics: the default reduction's,
    or invariant mode's per tile or merged). Returns the logits."""
    x = logits(h, w, shape)
    for backend in chain:
        if not softmax.invariant:
            assert not isinstance(out, TileStats), "per-tile statistics out of invariant mode"
            done = backend.stats(x, softmax, out, None, chunks, work)
        elif isinstance(out, TileStats):
            done = backend.tile_stats(x, softmax, x.shape[1], out, None, x.shape[0], first)
        else:
            done = backend.merged_stats(x, softmax, out, None, x.shape[0])
        if done:
            return x
    raise AssertionError("no backend computed the block (the eager backend takes every block)")


def block_grad(
    chain: Iterable[KernelBackend], h: Tensor, w: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax,
    row: RowGrad, out: Tensor, shape: Shape, chunks: Chunks, work: Workspace,
) -> Tensor:
    """``KernelBackend.block_grad`` by the forward's GEMM, then the first backend of
    ``chain`` whose gradient kernel computes on the recomputed logits (invariant mode:
    the dense part, ``r = 1 / tau`` and ``a`` 0 without entropy). Returns the logits."""
    x = logits(h, w, shape)
    if softmax.invariant:
        r = reciprocals(softmax.tau, x.shape[0], row.b.dtype, x.device)
        a = torch.zeros_like(row.b) if row.a is None else row.a
    for backend in chain:
        if softmax.invariant:
            done = backend.invariant_grad(x, None, r, big_m, log_s, a, row.b, softmax.cap, chunks, out)
        else:
            done = backend.grad(x, big_m, log_s, softmax, row, out, None, chunks, work)
        if done:
            return x
    raise AssertionError("no backend computed the block (the eager backend takes every block)")
