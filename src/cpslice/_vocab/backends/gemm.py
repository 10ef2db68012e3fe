"""The hidden path's block kernels by a torch GEMM, then the row kernels: the default that
every backend takes in one line (``from .gemm import block_grad, block_stats``).

A block is ``[n, v]`` logits ``h @ w.T`` of ``n`` rows of the hidden states and a
vocabulary split ``w`` of the LM head. ``block_stats`` computes them by one GEMM in the
input dtype (``torch.mm``: cuBLAS or the CPU's BLAS, float32 accumulation) and hands
them to the row kernels of the backends of its chain, the first that computes;
``block_grad`` recomputes them by the same GEMM (the forward's bits) and writes the
block's logit gradient ``G``. In invariant mode a block's GEMM has one fixed shape
(``Shape``: the block's rows and columns zero-padded to it), and ``exact`` fixes, for
invariant mode's calls, the settings that would change a GEMM's bits.
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from ... import _probe
from ..gradient import RowGrad
from ..softmax import Softmax, reciprocals
from ..stats import Stats, TileStats
from .chunks import Chunks, Workspace
from .interface import KernelBackend, Shape

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


EXACT: tuple[tuple[str, str, object], ...] = (
    ("cuda.matmul", "fp32_precision", "ieee"),
    ("mkldnn.matmul", "fp32_precision", "ieee"),
    ("cuda.matmul", "allow_bf16_reduced_precision_reduction", False),
    ("cuda.matmul", "allow_fp16_reduced_precision_reduction", False),
    ("cuda.matmul", "allow_fp16_accumulation", False),
)
"""The settings under ``torch.backends`` that ``exact`` fixes, each ``(owner, name,
value)``: float32 GEMMs in IEEE float32 (no TF32 on CUDA, no bfloat16 or TF32 inside
oneDNN on the CPU), bfloat16 and float16 GEMMs without reduced-precision reductions
and without float16 accumulation. One this torch does not have is skipped."""


def _owner(path: str) -> object:
    """``torch.backends.<path>`` (None where this torch has none)."""
    owner: object = torch.backends
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


def _read(owner: object, name: str) -> object:
    """A setting's value as its setter takes it back (a reduction's split-K choice too)."""
    value = getattr(owner, name)
    split = getattr(owner, f"{name}_split_k", None) if name.endswith("reduction") else None
    return value if split is None else (value, split)


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Within the block, GEMMs without the settings that change their bits (``EXACT``, and
    ``torch.set_float32_matmul_precision("highest")``: the legacy ``allow_tf32``), each
    restored after it, the block raising too. A GEMM of one shape then runs one kernel
    with one reduction order. (cuDNN's TF32 setting is a convolution's: no GEMM here
    reads it.)"""
    saved = []
    for path, name, value in EXACT:
        owner = _owner(path)
        try:
            saved.append((owner, name, value, _read(owner, name)))
        except (AttributeError, RuntimeError):  # not in this torch
            continue
    try:  # the process-wide precision, unless the per-backend settings were set apart from it
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    try:
        if legacy is not None:
            torch.set_float32_matmul_precision("highest")
        for owner, name, value, before in saved:  # a reduction's split-K choice kept
            setattr(owner, name, (value, before[1]) if isinstance(before, tuple) else value)
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for owner, name, _, before in saved:
            setattr(owner, name, before)


def exact_if(invariant: bool) -> contextlib.AbstractContextManager[None]:
    """``exact()`` in invariant mode, else nothing."""
    return exact() if invariant else contextlib.nullcontext()


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
