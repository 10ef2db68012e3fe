"""The Triton backend: hand-written Triton kernels for CUDA tensors, and for CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``, the tests' way to run them without
a GPU). This package is the backend's module (``interface.KernelBackend``: ``takes`` and
the kernels below, its block kernels the interface's shared default); it imports ``triton`` only
when a kernel runs, in its kernel modules.

Nothing of Triton is imported unless the Triton backend computes: ``triton`` comes with
the CUDA builds of torch and is no dependency of cpslice. ``default`` holds the default
reduction's kernels (online statistics forward, one read; the gradient backward, one read
and one write), ``divergence`` a divergence's (the default reduction only: invariant
mode's divergence declines here and runs the eager spec), ``invariant`` invariant
mode's (the spec of docs/invariance.md: 128-column tiles, the spec's ``exp``,
pairwise-halving sums, no contraction, correctly rounded divisions). Every launch is a
``launch`` event of ``cpslice._probe`` (backend ``triton``), so that a test (and a
benchmark) can see that a Triton kernel ran: a silent fallback to another backend shows
as no launch.
"""

import torch
from torch import Tensor

from ...gradient import RowGrad
from ...pairs import Mix, PairGrad, PairOut, PairStats, Sides, Weights
from ...softmax import Softmax, Tau, reciprocals, taus
from ...stats import RowStats, TileStats, write
from .. import interface, selection
from ..chunks import Chunks, Workspace
from ..interface import Merged, Task
from .interpreter import interpreted

block_stats, block_grad = interface.block_stats, interface.block_grad  # the shared default block kernels
NAME = "triton"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes of the default reduction's kernels (float32 arithmetic): float64 logits go
on to the next backend (a GPU's float64 rate makes no Triton kernel worth having)."""
INVARIANT_DTYPES = (torch.float32, torch.bfloat16)
"""Invariant mode's kernels' dtypes: its spec's (float16 and float64 go on)."""


def takes(task: Task) -> bool:
    """Whether the Triton kernels compute on the task: with ``triton`` selected for every
    tensor of a dtype they take (a CUDA tensor, or a CPU tensor under the interpreter),
    with ``auto`` for a CUDA one of such a dtype when Triton imports.

    Raises:
        RuntimeError: ``triton`` selected for a tensor it cannot run on (a CPU tensor
            without ``TRITON_INTERPRET=1``, another device, Triton missing).
    """
    state = selection.selected
    if state.name in ("eager", "compiled") or task.dtype not in (INVARIANT_DTYPES if task.invariant else DTYPES):
        return False
    if state.name == "auto":
        return task.device.type == "cuda" and state.has_triton()
    where = task.device.type
    if not state.has_triton():
        raise RuntimeError("CPSLICE_BACKEND=triton but triton does not import; install it (CUDA builds of "
                           "torch bring it) or choose another backend (auto, eager, compiled)")
    if where == "cuda" or (where == "cpu" and interpreted()):
        return True
    raise RuntimeError(
        f"CPSLICE_BACKEND=triton runs on CUDA tensors (and on CPU tensors only under Triton's "
        f"interpreter, TRITON_INTERPRET=1), but the logits are on {where}; choose another backend "
        "(auto, eager, compiled) for them"
    )


def stats(
    x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunks: Chunks, work: Workspace
) -> bool:
    """``default.row_stats``: one program per row (``chunks`` and ``work`` are the other
    backends')."""
    from .default import row_stats

    row_stats(x, softmax, out, rows)
    return True


def grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, rows: Tensor | None,
    chunks: Chunks, work: Workspace,
) -> bool:
    """``default.row_grad``, then the picked ids' entries."""
    from .default import row_grad

    row_grad(x, big_m, log_s, softmax, row, out, rows)
    return True


def tile_stats(
    x: Tensor, softmax: Softmax, valid: int, out: TileStats, rows: Tensor | None, chunk: int, first: int
) -> bool:
    """``invariant.tile_stats``: the per-tile statistics (``chunk`` is the eager loop's)."""
    from . import invariant as tri

    r = reciprocals(softmax.tau, x.shape[0], out.sum.dtype, x.device)
    tri.tile_stats(x, rows, r, softmax.cap, valid, out.max, out.sum, out.ent, first)
    return True


def merged_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> bool:
    """``invariant.merged_stats``: each row's tiles merged (``chunk`` is the eager loop's)."""
    from . import invariant as tri

    cdt = out.sum.dtype
    tau = taus(softmax.tau, x.shape[0], cdt, x.device)
    r = reciprocals(tau, x.shape[0], cdt, x.device)
    big, total, ent = tri.merged_stats(x, rows, r, tau, softmax.cap, x.shape[1], out.ent is not None)
    write(out, slice(None) if rows is None else rows, big, total, ent)
    return True


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged | None:
    """``invariant.merge`` of ``[n, R]`` tiles (the kernel takes them ``[R, n]``) with a
    ``[R]`` temperature; None (the next backend merges, the same bits) with a number."""
    if not isinstance(tau, Tensor):
        return None
    from . import invariant as tri

    return tri.merge(m.t(), s.t(), None if a is None else a.t(), tau)


def invariant_grad(
    x: Tensor, rows: Tensor | None, r: Tensor, big_m: Tensor, log_s: Tensor, a: Tensor, b: Tensor,
    cap: float | None, chunks: Chunks, out: Tensor,
) -> bool:
    """``invariant.grad``: the dense gradient, every column (``chunks`` is the others')."""
    from . import invariant as tri

    tri.grad(x, rows, r, big_m, log_s, a, b, cap, out)
    return True


def pair_stats(
    xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, rows: Tensor | None, chunks: Chunks, first: int
) -> bool:
    """``divergence.stats``: one program per row; False in invariant mode (its divergence
    runs the eager spec, ``backends.divergence``)."""
    if softmax.invariant:
        return False
    from .divergence import stats

    assert isinstance(out, PairStats), "per-tile statistics out of invariant mode"
    return stats(xw, xo, softmax, out, rows)


def pair_mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, sides: Sides, weights: Weights, out: Mix, rows: Tensor | None,
    chunks: Chunks, first: int,
) -> bool:
    """``divergence.mix``; False in invariant mode."""
    from .divergence import mix

    return not softmax.invariant and mix(xw, xo, softmax, sides, weights, out, rows)


def pair_grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None,
    rows: Tensor | None, chunks: Chunks,
) -> bool:
    """``divergence.grad``; False in invariant mode."""
    from .divergence import grad

    return not softmax.invariant and grad(xw, xo, softmax, terms, out_w, out_o, rows)
