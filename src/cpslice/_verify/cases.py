"""Which layouts ``cpslice verify`` checks, and the rest of what one run is given.

``select_cases`` turns ``--mode``, ``--format`` and ``--align`` into ``Case``s (or a
``VerifyArgumentError`` that says what to pass); ``check_sizes`` refuses a process
count this machine should not spawn; a ``Config`` is one run: sizes, cases, samples,
seed, timeouts and tolerance.
"""

from dataclasses import dataclass
from typing import Literal, NamedTuple

from .._types import CpMode, LayoutMode, QkvFormat

TOLERANCE = 1e-5
"""Largest absolute error allowed for log-probs, entropy and gradient. The float32
log-probs reach about -20 here (float32 spacing ~2e-6 there); a misplaced row or a
wrong target is off by ~1 or more."""
MAX_PROCESSES = 32
DEFAULT_TIMEOUT = 180.0

DEFAULT_STARTUP_TIMEOUT = 120.0
"""Seconds for every rank to spawn, import torch and megatron-core and join the group
(15-30 s on a loaded machine)."""


class VerifyArgumentError(ValueError):
    """A combination of verify's options that names no runnable check."""


OrderKind = Literal["random", "block", "per-document head-tail"]
"""An order layout's token order: a random permutation, shuffled blocks of
``batches.BLOCK`` positions, or torch's per-document head-tail balancer's."""


class Case(NamedTuple):
    """One layout to check: its CP mode, its qkv format, and (thd) the ``align`` its
    samples are padded to, or None for the default packing; ``padded``: thd samples
    given their own random widths ``W_i >= L_i`` through ``Layout.from_cu_seqlens``;
    ``left_padded``: bshd rows as Hugging Face trainers hold them, every prompt
    left-padded to the longest, the response after it (``row_offsets``); ``order``
    (mode ``"order"``): ``Layout.from_order`` of that kind of token order; ``shared``:
    thd groups of samples sharing one prompt (``shared_prefix``), each packed as a star.

    Mode ``"none"`` in a run with ``cp_size > 1`` is the layout without context
    parallelism on every CP rank: each holds the whole batch (TP as in every case).
    """

    mode: LayoutMode
    fmt: QkvFormat
    align: int | None = None
    padded: bool = False
    left_padded: bool = False
    order: OrderKind | None = None
    shared: bool = False

    @property
    def name(self) -> str:
        if self.order is not None:
            return f"order {self.order} {self.fmt}"
        extra = f" align {self.align}" if self.align else (" padded" if self.padded else "")
        extra += " shared-prefix" if self.shared else ""
        return f"{self.mode} {self.fmt}{extra}{' left-padded' if self.left_padded else ''}"


ORDER_CASES = (Case("order", "thd", order="random"), Case("order", "thd", order="block"),
               Case("order", "bshd", order="random"),
               Case("order", "thd", order="per-document head-tail"))
"""The order layouts, torch's last: where its private balancer moved, that layout fails
with the reason and the run stops there."""


def select_cases(
    cp_size: int, mode: str, fmt: str | None, align: int | None = None
) -> tuple[Case, ...]:
    """The layouts ``--mode``, ``--format`` and ``--align`` ask for at ``cp_size``.

    ``mode`` is ``"zigzag"``, ``"allgather"``, ``"none"`` or ``"all"``; ``fmt`` is
    ``"thd"``, ``"bshd"`` or None for every format the mode has; ``"order"`` the order
    layouts (``ORDER_CASES``), which ``"all"`` holds too, torch's last. ``"all"`` means
    zigzag (thd, bshd) and allgather (thd) when ``cp_size > 1``, and none (thd, bshd)
    and allgather (thd) when ``cp_size == 1``: megatron-core's ``parallel_state``
    yields zigzag only with context parallelism, and none only without it. With
    ``align``, every thd layout is checked a second time with its samples padded to
    a multiple of ``align``; without it, ``"all"`` with thd adds one such layout:
    allgather, ``align = 4 * cp_size`` (verl's ``tp * cp * 2`` at tp 2), whose padding
    crosses pieces and is redistributed to zigzag. ``"all"`` also checks (thd) the
    first mode with shared prefixes (``Case.shared``), the
    first mode and allgather with explicit padded widths (``Case.padded``), (bshd) the
    first mode with left-padded rows (``Case.left_padded``) and, when ``cp_size > 1``,
    none bshd on every CP rank (its rows of odd length: no CP, no rounding of the row).

    Raises:
        VerifyArgumentError: ``none`` with ``cp_size > 1``, ``zigzag`` with
            ``cp_size == 1``, ``allgather`` with bshd, ``align`` with bshd only, with
            ``order`` or, under zigzag, not a multiple of ``2 * cp_size``; the message
            says what to pass.
    """
    modes = _modes(cp_size, mode, fmt)
    if mode == "order" and align is not None:
        raise VerifyArgumentError(
            f"--align {align} pads the closed forms' samples, and --mode order has none: its "
            "layouts pad their samples as their orders need; drop --align, or pass --mode all")
    cases = []
    for m in modes:
        formats: tuple[QkvFormat, ...] = ("thd",) if m == "allgather" else ("thd", "bshd")
        cases += [Case(m, f) for f in formats if fmt is None or f == fmt]
    if align is None:
        if mode == "all" and fmt in (None, "thd"):
            cases.append(Case("allgather", "thd", 4 * cp_size))
        return tuple(cases) + _also_in_all(cp_size, mode, fmt)
    _check_align(align, cp_size, fmt, modes)
    aligned = tuple(Case(c.mode, c.fmt, align) for c in cases if c.fmt == "thd")
    return tuple(cases) + aligned + _also_in_all(cp_size, mode, fmt)


def _modes(cp_size: int, mode: str, fmt: str | None) -> tuple[CpMode, ...]:
    """The closed modes ``--mode`` names at ``cp_size`` (none for ``"order"``), checked
    with ``--format`` (``select_cases``)."""
    if mode == "none" and cp_size > 1:
        raise VerifyArgumentError(
            f"--mode none is the layout without context parallelism, but --cp-size is "
            f"{cp_size}; pass --cp-size 1, or --mode zigzag, allgather or all"
        )
    if mode == "zigzag" and cp_size == 1:
        raise VerifyArgumentError(
            "--mode zigzag needs --cp-size 2 or more (at cp size 1 megatron-core runs "
            "without context parallelism: --mode none)"
        )
    if mode == "allgather" and fmt == "bshd":
        raise VerifyArgumentError(
            "--mode allgather splits the packed stream, so it has no bshd layout; pass "
            "--format thd, or --mode zigzag for bshd rows"
        )
    choices: dict[str, tuple[CpMode, ...]] = {
        "all": ("zigzag", "allgather") if cp_size > 1 else ("none", "allgather"),
        "zigzag": ("zigzag",),
        "allgather": ("allgather",),
        "none": ("none",),
        "order": (),
    }
    if mode not in choices:
        raise VerifyArgumentError(f"--mode {mode!r} is not one of {', '.join(choices)}")
    if fmt not in (None, "thd", "bshd"):
        raise VerifyArgumentError(f"--format {fmt!r} is not one of thd, bshd")
    return choices[mode]


def _check_align(align: int, cp_size: int, fmt: str | None, modes: tuple[CpMode, ...]) -> None:
    """``--align``: thd only, >= 1, under zigzag a multiple of ``2 * cp_size``."""
    if fmt == "bshd":
        raise VerifyArgumentError(
            f"--align {align} pads packed thd samples, but --format is bshd, whose rows are "
            "already padded; pass --format thd, or drop --align"
        )
    if align < 1:
        raise VerifyArgumentError(f"--align {align} < 1")
    if "zigzag" in modes and align % (2 * cp_size):
        raise VerifyArgumentError(
            f"--align {align} is not a multiple of 2 * --cp-size = {2 * cp_size} (zigzag cuts "
            "each padded sample into 2 * cp equal chunks); pass a multiple, e.g. "
            f"{4 * cp_size} (verl: tp * cp * 2)"
        )


def _also_in_all(cp_size: int, mode: str, fmt: str | None) -> tuple[Case, ...]:
    """What ``--mode all`` checks beyond each mode's formats: shared prefixes, padded
    widths, left-padded rows, the order layouts, none bshd inside a CP world, then torch's order (last:
    ``ORDER_CASES``) (``select_cases``); what ``--mode order`` checks."""
    orders = [c for c in ORDER_CASES if fmt is None or c.fmt == fmt]
    if mode == "order":
        return tuple(orders)
    if mode != "all":
        return ()
    first: CpMode = "zigzag" if cp_size > 1 else "none"
    extra = []
    if fmt in (None, "thd"):
        extra += [Case(first, "thd", shared=True), Case(first, "thd", padded=True),
                  Case("allgather", "thd", padded=True)]
    if fmt in (None, "bshd"):
        extra.append(Case(first, "bshd", left_padded=True))
    extra += orders[:-1] if orders and orders[-1] == ORDER_CASES[-1] else orders
    if fmt in (None, "bshd") and cp_size > 1:
        extra.append(Case("none", "bshd"))
    return tuple(extra) + ((ORDER_CASES[-1],) if ORDER_CASES[-1] in orders else ())


def check_sizes(cp_size: int, tp_size: int) -> None:
    """Refuse a process count this machine should not be asked to spawn.

    Raises:
        VerifyArgumentError: a size below 1, or more than ``MAX_PROCESSES`` processes.
    """
    for name, value in (("--cp-size", cp_size), ("--tp-size", tp_size)):
        if value < 1:
            raise VerifyArgumentError(f"{name} {value} < 1")
    if cp_size * tp_size > MAX_PROCESSES:
        raise VerifyArgumentError(
            f"--cp-size {cp_size} x --tp-size {tp_size} = {cp_size * tp_size} processes; "
            f"verify spawns them all on this machine, at most {MAX_PROCESSES}"
        )


@dataclass(frozen=True)
class Config:
    """What one ``cpslice verify`` run checks (see ``select_cases``, ``check_sizes``)."""

    cp_size: int
    tp_size: int
    cases: tuple[Case, ...]
    samples: int = 16
    seed: int = 0
    timeout: float = DEFAULT_TIMEOUT
    """Seconds the started ranks may go without progress (a finished layout) before
    the run fails as a hang."""
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    tolerance: float = TOLERANCE
    compile: bool = False
    """Run the log-prob kernels compiled by torch.compile on every rank
    (``CPSLICE_BACKEND=compiled``): a compile failure fails the run."""

    @property
    def world(self) -> int:
        return self.cp_size * self.tp_size
