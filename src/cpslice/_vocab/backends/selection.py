"""Which kernels compute the vocabulary engine's row statistics and gradients: the backend.

Three backends, each with the default reduction and invariant mode's:

- ``eager``: torch operations, chunk by chunk (any device, any float dtype;
  ``backends.eager``);
- ``compiled``: the same arithmetic compiled by ``torch.compile`` (inductor) into one
  fused loop per chunk: the CPU's fast path (``backends.compiled``);
- ``triton``: hand-written Triton kernels (``_vocab/backends/triton``) for CUDA tensors, and for
  CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, for tests). They
  take float32, bfloat16 and float16 logits; float64 logits fall back to ``compiled``
  / ``eager`` (the interpreter and a GPU's float64 rate make no sense for them).

``CPSLICE_BACKEND`` chooses, read once at import: ``auto`` (unset or empty too) takes
``triton`` for CUDA tensors when Triton imports, else ``compiled`` where it pays (the
work is large enough and the compiler works) and ``eager`` otherwise; ``eager``,
``compiled`` and ``triton`` force one (``compiled``: a compile failure is an error;
``triton``: a tensor it cannot run on, a CPU tensor without the interpreter, is an
error). Any other value (one with spaces around it too) is refused where a backend is
first needed (``current``: a one-line ``ValueError``), not at import, so that what needs
no backend (a ``Layout``, ``cpslice plan``) still works. The selection lives in one
object, ``selected``; ``using`` changes it for a block (tests and benchmarks)."""

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

NAMES = ("auto", "eager", "compiled", "triton")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INVARIANT_DTYPES = (torch.float32, torch.bfloat16)


def setting(value: str | None = None) -> str:
    """``CPSLICE_BACKEND`` (or ``value``): one of ``NAMES``, empty or unset meaning ``auto``.

    Raises:
        ValueError: any other value; the message names the setting and lists the valid ones.
    """
    raw = os.environ.get("CPSLICE_BACKEND", "") if value is None else value
    name = raw or "auto"
    if name not in NAMES:
        raise ValueError(
            f"CPSLICE_BACKEND={raw!r} is not valid; use one of: unset or '' or 'auto' (Triton kernels "
            "for CUDA tensors, compiled kernels on the CPU where they pay, else eager), 'eager' (torch "
            "operations), 'compiled' (torch.compile; an error if it fails), 'triton' (Triton kernels; "
            "an error for a tensor they cannot run on)"
        )
    return name


@dataclass
class Selection:
    """The chosen backend (``name``, one of ``NAMES``; ``refused``: why ``CPSLICE_BACKEND``
    was refused at import, raised by ``current``) and all that the backends learn at
    run time, in one place: whether Triton imports (None: not asked yet); the compiled
    backend's ``torch.compile`` backend (``compiler``: inductor; tests of the chunk
    plumbing use ``aot_eager``), its compiled functions and the keys whose first call
    succeeded, the first compile failure of ``auto`` (then eager for the process); and
    invariant mode's compiled kernels' keys checked bit for bit against the eager ones,
    and why they were turned off (a disagreement), if they were."""

    name: str
    refused: str | None = None
    triton_imports: bool | None = None
    compiler: str | Callable[..., Any] = "inductor"
    compiled: dict[tuple[object, ...], Callable[..., Any]] = field(default_factory=dict)
    ready: set[tuple[object, ...]] = field(default_factory=set)
    broken: str | None = None
    verified: set[tuple[object, ...]] = field(default_factory=set)
    disagree: str | None = None

    def has_triton(self) -> bool:
        if self.triton_imports is None:
            self.triton_imports = importlib.util.find_spec("triton") is not None
        return self.triton_imports


def _at_import() -> Selection:
    """The selection ``CPSLICE_BACKEND`` makes at import: a value ``setting`` refuses is kept
    as ``refused``, for ``current`` to raise where a backend is first needed."""
    try:
        return Selection(setting())
    except ValueError as bad:
        return Selection("auto", refused=str(bad))


selected = _at_import()
"""The process's selection, from ``CPSLICE_BACKEND`` at import."""


def current() -> str:
    """The selected backend's name (one of ``NAMES``): what every kernel's choice reads.

    Raises:
        ValueError: ``CPSLICE_BACKEND`` held a value ``setting`` refuses (its message: one
            line naming the setting and the valid values).
    """
    if selected.refused is not None:
        raise ValueError(selected.refused)
    return selected.name


@contextlib.contextmanager
def using(
    name: str, *, compiler: str | Callable[..., Any] | None = None, fresh: bool = False
) -> Iterator[Selection]:
    """Select the backend ``name`` (one of ``NAMES``) inside the block, then restore the
    selection as it was. ``compiler``: the compiled backend's ``torch.compile`` backend
    for the block; ``fresh``: start the block with no compiled kernel run yet (its first
    call checked again), verified or broken (the compiled functions, a cache, are kept;
    what the block learns is dropped after it)."""
    before = dataclasses.replace(selected)
    selected.name, selected.refused = setting(name), None
    if compiler is not None:
        selected.compiler = compiler
    if fresh:
        selected.ready, selected.verified = set(), set()
        selected.broken = selected.disagree = None
    try:
        yield selected
    finally:
        for f in dataclasses.fields(Selection):
            setattr(selected, f.name, getattr(before, f.name))


def triton_for(x: Tensor, invariant: bool = False) -> bool:
    """Whether the Triton kernels compute on the block ``x``: with ``triton`` selected for
    every tensor of a dtype they take (a CUDA tensor, or a CPU tensor under the
    interpreter), with ``auto`` for a CUDA one of such a dtype when Triton imports.
    Invariant mode's kernels take float32 and bfloat16 (``INVARIANT_DTYPES``): float16
    and float64 logits fall back there.

    Raises:
        RuntimeError: ``triton`` selected for a tensor it cannot run on (a CPU tensor
            without ``TRITON_INTERPRET=1``, another device, Triton missing).
        ValueError: ``CPSLICE_BACKEND`` was refused (``current``).
    """
    name = current()
    if name in ("eager", "compiled") or x.dtype not in (INVARIANT_DTYPES if invariant else TRITON_DTYPES):
        return False
    if name == "auto":
        return x.device.type == "cuda" and selected.has_triton()
    where = x.device.type
    if not selected.has_triton():
        raise RuntimeError("CPSLICE_BACKEND=triton but triton does not import; install it (CUDA builds of "
                           "torch bring it) or choose another backend (auto, eager, compiled)")
    from .triton import interpreted  # the package only: Triton itself is not imported

    if where == "cuda" or (where == "cpu" and interpreted()):
        return True
    raise RuntimeError(
        f"CPSLICE_BACKEND=triton runs on CUDA tensors (and on CPU tensors only under Triton's "
        f"interpreter, TRITON_INTERPRET=1), but the logits are on {where}; choose another backend "
        "(auto, eager, compiled) for them"
    )


def compile_mode() -> str:
    """The compiled kernels' mode the selection implies: ``1`` (always, failures are
    errors) for ``compiled``, ``0`` (never) for ``eager``, else ``auto``.

    Raises:
        ValueError: ``CPSLICE_BACKEND`` was refused (``current``).
    """
    return {"compiled": "1", "eager": "0"}.get(current(), "auto")
