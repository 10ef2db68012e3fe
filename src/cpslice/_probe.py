"""The instrumentation hook: what tests and benchmarks that must see inside the library use.

A stable private seam (docs/dev/instrumentation.md), not part of the public API. While a
``watch()`` block is open, the library records named events into what it yields:

- ``call``: a call of the dense kernels (``stats`` or ``grad``, default or invariant
  mode), with the rows it computes (``rows``; ``index``: the ascending index it was
  given, None for every row of the block);
- ``launch``: one kernel launch, by backend (``eager``: one chunk of the eager loop;
  ``compiled``: one call of a compiled chunk kernel; ``triton``: one Triton launch),
  with its kernel's ``name``, invariant mode or the default, and its rows;
- ``collective``: one collective the library enters, by name (``all_gather``,
  ``all_reduce``, ``reduce_scatter``, ``all_to_all_single``), with the elements this
  rank sends (``elements``);
- ``host_read``: one read of a result the library computed back to the host (``tolist``,
  ``item``, ``cpu``): a device-to-host synchronization on an accelerator;
- ``save``: one forward that kept state for its backward (an autograd Function's saved
  tensors and ``Saved`` record), by the Function's name, with the tensors it saved
  (``elements``): a call where no gradient can flow keeps none.

While a ``substitute(step, fn)`` block is open, the library runs ``fn`` where it would
run the named step (``STEPS``): a planted bug, or a state that a test needs (a compiled
kernel that differs from the eager one). The substitute is called as the step is; it
may call the real one, which stays reachable where it lives.

Inactive (no block open), a watched site costs one module-level ``None`` check,
``if _probe.active is not None: ...``, and a step's site one call of ``step(name, real)``,
which makes the same check and returns ``real``. Blocks nest; each watch sees the events of its
own block. One process, one thread: the library's calls are not concurrent.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from torch import Tensor

Kind = Literal["call", "launch", "collective", "host_read", "save"]
"""The events a watch counts."""
Backend = Literal["eager", "compiled", "triton"]
"""Who ran a launch."""
BACKENDS: tuple[Backend, ...] = ("eager", "compiled", "triton")
Step = Literal["merge_tiles", "row_kernel", "host_checks", "rank_main", "triton_exp", "triton_tree", "triton_pad",
               "triton_scratch_rows", "block_sizes", "block_gemm"]
"""The steps a test may substitute:

- ``merge_tiles``: invariant mode's merge of a row's tiles in global order
  (``spec.merge_tiles``, called as it is by ``backends.eager.merge_step``, wherever
  invariant mode merges with torch: without TP, and the tiles gathered under TP);
- ``row_kernel``: invariant mode's compiled forward kernel
  (``backends.compiled.row_kernel``, called as it is: the function compiled, whose first
  result per shape is checked bit for bit against the eager one);
- ``host_checks``: whether the ids of a tensor (targets, ids, a support's sets) are
  checked against the vocabulary on the host, ``(Tensor) -> bool``: on the CPU only
  (``support.on_host``), where it costs no device sync; ``lambda t: False`` takes a
  device's path on the CPU;
- ``rank_main``: the entry ``cpslice verify`` spawns each rank with
  (``_verify.rank.rank_main``, ``(rank, store port, config, outbox)``, a module-level
  function: spawned processes import it), chosen in the parent: a rank that raises,
  never starts or stalls, for the verifier's own failure reports;
- ``triton_exp``, ``triton_tree``, ``triton_pad``: invariant mode's Triton kernels'
  ``@triton.jit`` helpers (``invariant._exp``, ``invariant._tree``, ``invariant._pad`` of
  ``_vocab.backends.triton``, called as they are inside the kernels, which take them as
  ``constexpr`` arguments): the substitute is a ``@triton.jit`` function, compiled into
  the kernels launched within the block;
- ``triton_scratch_rows``: the rows of each chunk of those kernels' merged statistics,
  ``(tiles) -> rows`` (``backends.triton.invariant.scratch_rows``);
- ``block_sizes``: the hidden-state path's blocks of a call, forward and backward alike,
  ``(device, dtype, rows, vocab, chunk, invariant) -> Blocks`` (``blocks.sizes``, called
  with the hidden states' device type): ``lambda device, *rest: sizes("cuda", *rest,
  budget=...)`` walks CPU tensors in the blocks a GPU's budget gives;
- ``block_gemm``: the GEMM of a hidden-state block's logits, forward and the backward's
  recomputation, ``(a, b) -> a @ b`` (``torch.mm``, in ``backends.interface.logits``): a
  substitute sees the settings it runs under (invariant mode's, ``gemm_settings.exact``) and
  counts the GEMMs."""
STEPS: tuple[Step, ...] = get_args(Step)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Event:
    """One recorded event: its ``kind`` and ``name``; a launch's ``backend``; a call's or a
    launch's mode (``invariant``) and ``rows``; a call's row ``index`` (None: every row);
    a collective's ``elements`` sent (a save's: the tensors kept)."""

    kind: Kind
    name: str
    backend: Backend | None = None
    invariant: bool = False
    rows: int = 0
    index: Tensor | None = None
    elements: int = 0


@dataclass(eq=False)
class Seen:
    """The events of one ``watch()`` block, in order."""

    events: list[Event] = field(default_factory=list)

    def of(
        self, kind: Kind, *, name: str | None = None, backend: Backend | None = None, invariant: bool | None = None
    ) -> list[Event]:
        """The events of ``kind`` that match every criterion given (None: any)."""
        return [
            e for e in self.events
            if e.kind == kind and name in (None, e.name) and backend in (None, e.backend)
            and invariant in (None, e.invariant)
        ]

    def count(
        self, kind: Kind, *, name: str | None = None, backend: Backend | None = None, invariant: bool | None = None
    ) -> int:
        """How many events of ``kind`` match (``of``)."""
        return len(self.of(kind, name=name, backend=backend, invariant=invariant))

    def rows(
        self, kind: Kind, *, name: str | None = None, backend: Backend | None = None, invariant: bool | None = None
    ) -> int:
        """The rows of the matching events, summed (a launch's rows: the rows it computed,
        a compiled tail chunk's overlap included)."""
        return sum(e.rows for e in self.of(kind, name=name, backend=backend, invariant=invariant))


@dataclass
class Active:
    """The hook's state while a block is open: the open watches and the substituted steps."""

    watches: list[Seen] = field(default_factory=list)
    steps: dict[Step, Callable[..., Any]] = field(default_factory=dict)

    def record(self, event: Event) -> None:
        for seen in self.watches:
            seen.events.append(event)

    def call(self, name: str, rows: int, index: Tensor | None, invariant: bool = False) -> None:
        """Record a call of the dense kernels ``name`` on ``rows`` rows (``index``: which)."""
        self.record(Event("call", name, invariant=invariant, rows=rows, index=index))

    def launch(self, backend: Backend, name: str, rows: int, invariant: bool = False) -> None:
        """Record one launch of the kernel ``name`` by ``backend`` on ``rows`` rows."""
        self.record(Event("launch", name, backend, invariant, rows))

    def collective(self, name: str, elements: int) -> None:
        """Record one collective ``name`` that sends ``elements`` elements from this rank."""
        self.record(Event("collective", name, elements=elements))

    def host_read(self, name: str) -> None:
        """Record one host read ``name`` (``tolist``, ``item``, ``cpu``)."""
        self.record(Event("host_read", name))

    def save(self, name: str, tensors: int) -> None:
        """Record one forward ``name`` that kept ``tensors`` tensors for its backward."""
        self.record(Event("save", name, elements=tensors))

    def step(self, name: Step, real: F) -> F:
        """The function to run for the step ``name``: its substitute, else ``real``."""
        found = self.steps.get(name)
        return real if found is None else found  # type: ignore[return-value]


active: Active | None = None
"""The hook's state; None while no block is open (each site's one check)."""


def step(name: Step, real: F) -> F:
    """The function to run for the step ``name`` (one of ``STEPS``): its substitute while a
    ``substitute`` block is open, else ``real``. Every step's site calls this."""
    return real if active is None else active.step(name, real)


def _open() -> Active:
    global active
    if active is None:
        active = Active()
    return active


def _close() -> None:
    global active
    if active is not None and not active.watches and not active.steps:
        active = None


@contextmanager
def watch() -> Iterator[Seen]:
    """Record the library's events within the block into the ``Seen`` it yields."""
    state = _open()
    seen = Seen()
    state.watches.append(seen)
    try:
        yield seen
    finally:
        state.watches.remove(seen)
        _close()


@contextmanager
def substitute(name: Step, fn: Callable[..., Any]) -> Iterator[None]:
    """Run ``fn`` wherever the library runs the step ``name`` (one of ``STEPS``) within the
    block; the step as it was (the real one, or an outer block's substitute) after it.

    Raises:
        ValueError: ``name`` is not one of ``STEPS``.
    """
    if name not in STEPS:
        raise ValueError(f"no step {name!r} to substitute; the steps are {', '.join(STEPS)}")
    state = _open()
    before = state.steps.get(name)
    state.steps[name] = fn
    try:
        yield
    finally:
        if before is None:
            del state.steps[name]
        else:
            state.steps[name] = before
        _close()
