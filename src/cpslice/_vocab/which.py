"""Which backend a call would compute with (``backend_for``): the selection's answer for
a call's blocks, so that a user can see whether the Triton kernels run."""

from typing import cast

from torch import Tensor

from . import args
from .backends import selection
from .backends.interface import Task
from .blocks import default_hidden_chunk, sizes


def backend_for(x: Tensor, weight: Tensor | None = None, *, invariant: bool = False) -> selection.Name:
    """The backend whose kernels a call would run on ``x`` under ``CPSLICE_BACKEND``:
    ``"triton"`` (the Triton kernels), ``"compiled"`` (``torch.compile``'s) or ``"eager"``
    (torch operations); docs/dev/backends.md.

    Args:
        x: a call's ``[T, V_local]`` logits (``log_probs_and_entropy`` and its family), or,
            with ``weight``, its ``[T, H]`` hidden states (the ``*_from_hidden``
            functions, whose ``[rows, V_block]`` blocks of ``hidden @ weight.T`` are what
            the kernels see). Its device, dtype and size decide, as they decide for the
            call (a DTensor: its local tensor).
        weight: the call's ``[V_local, H]`` LM-head shard; None for logits.
        invariant: the call's ``invariant``.

    Returns:
        The first backend, from the one ``CPSLICE_BACKEND`` names down (``auto``: the
        Triton kernels for CUDA tensors of float32, bfloat16 or float16, then the compiled
        ones where a block is large enough, then eager), that takes the call's blocks.
        A backend may still decline at run time and hand a block to the next one (a
        compile failure in ``auto`` warns once; invariant mode's compiled kernels take
        no soft cap); the instrumentation hook's launch events say what ran.

    Raises:
        TypeError, LayoutError: as the vocabulary functions for ``x`` and ``weight``.
        RuntimeError: ``CPSLICE_BACKEND=triton`` and ``x`` is a tensor it cannot run on
            (a CPU tensor outside Triton's interpreter), as the call would raise.
    """
    mode = args.flag("invariant", invariant)
    if weight is None:
        logits, _ = args.logits(x)
        return _first(Task.of(logits, None, mode))
    hidden, shard, _ = args.head(x, weight)
    rows, vocab = int(hidden.shape[0]), int(shard.shape[0])
    grid = sizes(hidden.device.type, hidden.dtype, rows, vocab, default_hidden_chunk(hidden, vocab), mode)
    return _first(Task(hidden.device, hidden.dtype, min(rows, grid.rows), min(vocab, grid.columns), True, mode))


def _first(task: Task) -> selection.Name:
    return cast(selection.Name, selection.chain(task)[0].NAME)
