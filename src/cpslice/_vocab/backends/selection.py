"""Which kernels compute the vocabulary engine's row statistics and gradients: the backend.

Three backends, each one module implementing the one interface
(``interface.KernelBackend``: the logits path's row kernels of both reductions and the
hidden path's block kernels):

- ``eager``: torch operations, chunk by chunk (any device, any float dtype;
  ``backends.eager``);
- ``compiled``: the same arithmetic compiled by ``torch.compile`` (inductor) into one
  fused loop per chunk: the CPU's fast path (``backends.compiled``);
- ``triton``: hand-written Triton kernels (``_vocab/backends/triton``) for CUDA tensors, and for
  CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, for tests). They
  take float32, bfloat16 and float16 logits; float64 logits fall back to ``compiled``
  / ``eager`` (the interpreter and a GPU's float64 rate make no sense for them).

They sit in ``REGISTRY`` in order, one line each (a name and its module, imported by
name when first reached, so that no backend is imported before it is asked). For each
call ``chain`` walks the registry from the selected backend down and yields those whose
``takes`` accepts the task (device, dtype, size, mode); the first computes, and one that
declines at run time (a kernel returning False) hands the task to the next.

``CPSLICE_BACKEND`` chooses, read once at import: ``auto`` (unset or empty too) starts at
the top, so ``triton`` for CUDA tensors when Triton imports, else ``compiled`` where it
pays (the work is large enough and the compiler works) and ``eager`` otherwise;
``eager``, ``compiled`` and ``triton`` start at their own line (``compiled``: a compile
failure is an error; ``triton``: a tensor it cannot run on, a CPU tensor without the
interpreter, is an error, and float64 logits go on to ``compiled`` / ``eager``). Any
other value (one with spaces around it too) is refused where a backend is first needed
(``current``: a one-line ``ValueError``), not at import, so that what needs no backend (a
``Layout``, ``cpslice plan``) still works. The selection's state lives in one object,
``selected``; ``using`` changes it for a block (tests and benchmarks). No other module
names a backend to choose it."""

import contextlib
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from ..._cache import boundary
from .interface import KernelBackend, Task

Name = Literal["eager", "compiled", "triton"]
"""A backend's name."""
REGISTRY: tuple[tuple[Name, str], ...] = (
    ("triton", "cpslice._vocab.backends.triton"),
    ("compiled", "cpslice._vocab.backends.compiled"),
    ("eager", "cpslice._vocab.backends.eager"),
)
"""The backends, in the order ``auto`` tries them: each a name and the module that
implements ``interface.KernelBackend``. Adding a backend is a module and a line here."""
NAMES = ("auto", *(name for name, _ in REGISTRY))
R = TypeVar("R")


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
class BackendState:
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


def _at_import() -> BackendState:
    """The selection ``CPSLICE_BACKEND`` makes at import: a value ``setting`` refuses is kept
    as ``refused``, for ``current`` to raise where a backend is first needed."""
    try:
        return BackendState(setting())
    except ValueError as bad:
        return BackendState("auto", refused=str(bad))


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
) -> Iterator[BackendState]:
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
        for f in dataclasses.fields(BackendState):
            setattr(selected, f.name, getattr(before, f.name))


def compile_mode() -> str:
    """The compiled kernels' mode the selection implies: ``1`` (always, failures are
    errors) for ``compiled``, ``0`` (never) for ``eager``, else ``auto``.

    Raises:
        ValueError: ``CPSLICE_BACKEND`` was refused (``current``).
    """
    return {"compiled": "1", "eager": "0"}.get(current(), "auto")


_LOADED: dict[str, KernelBackend] = {}
"""The registry's modules imported so far, by name."""


def backend(name: Name) -> KernelBackend:
    """The backend module of ``name``: imported on first use (``_load``)."""
    found = _LOADED.get(name)
    return _load(name) if found is None else found


@boundary  # a compiled caller's first call imports eagerly (dynamo does not trace an import)
def _load(name: Name) -> KernelBackend:
    """Import the backend module of ``name`` (``REGISTRY``) and keep it in ``_LOADED``."""
    module = cast(KernelBackend, importlib.import_module(dict(REGISTRY)[name]))
    _LOADED[name] = module
    return module


def chain(task: Task) -> list[KernelBackend]:
    """The backends that take ``task``, in the registry's order from the selected one down
    (``auto``: from the top).

    Raises:
        RuntimeError: the selected backend cannot run on the task's tensors (its ``takes``).
        ValueError: ``CPSLICE_BACKEND`` was refused (``current``).
    """
    names = [name for name, _ in REGISTRY]
    name = current()
    start = 0 if name == "auto" else names.index(cast(Name, name))
    return [found for found in map(backend, names[start:]) if found.takes(task)]


def run(task: Task, kernel: Callable[[KernelBackend], bool]) -> None:
    """``kernel`` of the first backend of ``chain(task)`` that computes (returns True)."""
    for found in chain(task):
        if kernel(found):
            return
    raise AssertionError(f"no backend computed {task} (the eager backend takes every task)")


def first(task: Task, kernel: Callable[[KernelBackend], R | None]) -> R:
    """The result of ``kernel`` of the first backend of ``chain(task)`` that computes
    (returns something other than None)."""
    for found in chain(task):
        got = kernel(found)
        if got is not None:
            return got
    raise AssertionError(f"no backend computed {task} (the eager backend takes every task)")


def block(task: Task, kernel: Callable[[KernelBackend, Sequence[KernelBackend]], R]) -> R:
    """``kernel`` (a block kernel) of the first backend of ``chain(task)``, given the chain
    (that backend first)."""
    backends = chain(task)
    return kernel(backends[0], backends)
