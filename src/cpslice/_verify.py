"""``cpslice verify``: every layout end to end on real gloo ranks, against float64.

``run`` spawns ``cp_size * tp_size`` processes on this machine. Each joins one gloo
group, initializes megatron-core's ``parallel_state`` with those sizes and, for each
layout asked for, runs the path of a training step through the public API:

    Layout.from_parallel_state -> pack (its rows of its TP vocabulary shard)
      -> response_log_probs(with_entropy=True, tp_group=<megatron's TP group>)
      -> [allgather only] redistribute to the zigzag layout
      -> backward of a weighted sum of log-probs and entropy

and compares the log-probs, the entropy and the logits' gradient with a float64
``torch.log_softmax`` of every sample's whole logits, which each process computes
for itself from the seed. The expected shares, loss weights and gradient rows are
read from ``_verify_oracle``, a position-by-position transcription of the layout
rules that shares no code with the library's layout arithmetic (``_plan``,
``_pack``, ``_extract``), so a bug there fails a row. Each rank sends its
largest errors to the parent through a queue. Only the children import megatron-core.

Every layout runs two batches: ``samples`` random samples that include the edges
(single-token samples, empty responses, samples shorter than ``2 * cp_size``, whole
responses that cross chunk and rank boundaries), and a few short samples placed so
that some context-parallel ranks hold no response at all (they must still enter every
collective). Each rank's local tensor carries one padding row more than the layout
needs, whose gradient must be zero. Each batch then runs once more with every response
token restricted to a random set of kept ids (``Support.from_responses``, entropy over
the set; see ``_verify_support``), its errors folded into the same line.
"""

import contextlib
import importlib.util
import math
import multiprocessing
import multiprocessing.queues
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from . import _verify_oracle as oracle
from ._layout import Layout
from ._pack import pack
from ._redistribute import redistribute
from ._response import response_log_probs
from ._types import CpMode, QkvFormat
from ._verify_support import check_support_batch

VOCAB_PER_RANK = 8
"""Vocabulary columns of each TP rank's shard; the vocabulary is ``8 * tp_size``."""
TEMPERATURE = 0.8
CHUNK_ROWS = 5
"""Rows per chunk of ``log_probs_and_entropy``, small so that every batch takes several."""
LOGIT_SCALE = 3.0
TOLERANCE = 1e-5
"""Largest absolute error allowed for log-probs, entropy and gradient. The float32
log-probs reach about -20 here (float32 spacing ~2e-6 there); a misplaced row or a
wrong target is off by ~1 or more."""
MAX_PROCESSES = 32
DEFAULT_TIMEOUT = 180.0

DEFAULT_STARTUP_TIMEOUT = 120.0
"""Seconds for every rank to spawn, import torch and megatron-core and join the group
(15-30 s on a loaded machine)."""

MEGATRON_MISSING = (
    "megatron-core is not installed, and verify's ranks run megatron-core's "
    "parallel_state: pip install 'cpslice[megatron]'"
)

class VerifyArgumentError(ValueError):
    """A combination of verify's options that names no runnable check."""


class VerifyFailure(RuntimeError):
    """The run itself broke: a rank raised or died, the ranks did not start in time,
    or the started ranks stopped making progress (a hang)."""


class Case(NamedTuple):
    """One layout to check: its CP mode, its qkv format, and (thd) the ``align`` its
    samples are padded to, or None for the default packing."""

    mode: CpMode
    fmt: QkvFormat
    align: int | None = None

    @property
    def name(self) -> str:
        return f"{self.mode} {self.fmt}" + (f" align {self.align}" if self.align else "")


def select_cases(
    cp_size: int, mode: str, fmt: str | None, align: int | None = None
) -> tuple[Case, ...]:
    """The layouts ``--mode``, ``--format`` and ``--align`` ask for at ``cp_size``.

    ``mode`` is ``"zigzag"``, ``"allgather"``, ``"none"`` or ``"all"``; ``fmt`` is
    ``"thd"``, ``"bshd"`` or None for every format the mode has. ``"all"`` means
    zigzag (thd, bshd) and allgather (thd) when ``cp_size > 1``, and none (thd, bshd)
    and allgather (thd) when ``cp_size == 1``: megatron-core's ``parallel_state``
    yields zigzag only with context parallelism, and none only without it. With
    ``align``, every thd layout is checked a second time with its samples padded to
    a multiple of ``align``; without it, ``"all"`` with thd adds one such layout:
    allgather, ``align = 4 * cp_size`` (verl's ``tp * cp * 2`` at tp 2), whose padding
    crosses pieces and is redistributed to zigzag.

    Raises:
        VerifyArgumentError: ``none`` with ``cp_size > 1``, ``zigzag`` with
            ``cp_size == 1``, ``allgather`` with bshd, ``align`` with bshd only or, under
            zigzag, not a multiple of ``2 * cp_size``; the message says what to pass.
    """
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
    }
    if mode not in choices:
        raise VerifyArgumentError(f"--mode {mode!r} is not one of {', '.join(choices)}")
    modes = choices[mode]
    if fmt not in (None, "thd", "bshd"):
        raise VerifyArgumentError(f"--format {fmt!r} is not one of thd, bshd")
    cases = []
    for m in modes:
        formats: tuple[QkvFormat, ...] = ("thd",) if m == "allgather" else ("thd", "bshd")
        cases += [Case(m, f) for f in formats if fmt is None or f == fmt]
    if align is None:
        if mode == "all" and fmt in (None, "thd"):
            cases.append(Case("allgather", "thd", 4 * cp_size))
        return tuple(cases)
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
    return tuple(cases) + tuple(Case(c.mode, c.fmt, align) for c in cases if c.fmt == "thd")


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
    (``CPSLICE_COMPILE=1``): a compile failure fails the run."""

    @property
    def world(self) -> int:
        return self.cp_size * self.tp_size


# ---------------------------------------------------------------------------
# The batches and their float64 reference (the same in every process).


@dataclass(frozen=True)
class Batch:
    """Samples with their whole logits and the float64 reference of the loss.

    ``logits[i]`` is ``[L_i, V]`` float32 over the whole vocabulary; ``w_lp``, ``w_ent``
    are ``[R_i]`` float32 loss weights; ``ref_lp``, ``ref_ent`` are ``[R_i]`` and
    ``ref_grad`` is ``[L_i, V]``, d(sum w_lp * lp + w_ent * ent) / d logits, in float64.
    """

    total: tuple[int, ...]
    response: tuple[int, ...]
    tokens: list[Tensor]
    logits: list[Tensor]
    w_lp: list[Tensor]
    w_ent: list[Tensor]
    ref_lp: list[Tensor]
    ref_ent: list[Tensor]
    ref_grad: list[Tensor]


def edge_lengths(n: int, cp_size: int, seed: int) -> tuple[list[int], list[int]]:
    """``n`` random (total, response) lengths; the first five cover, in order, a
    single-token sample, a sample shorter than ``2 * cp_size``, an empty response, a
    long whole response (crossing every chunk), and a long random one; then shuffled."""
    rng = random.Random(seed)
    long_max = 6 * cp_size + 3
    total, response = [], []
    for i in range(n):
        kind = i if i < 5 else rng.randrange(5)
        if kind == 0:
            t, r = 1, 0
        elif kind == 1:
            t = rng.randint(2, max(2, 2 * cp_size - 1))
            r = rng.randint(0, t - 1)
        elif kind == 2:
            t, r = rng.randint(2, long_max), 0
        elif kind == 3:
            t = rng.randint(max(2, 4 * cp_size), long_max)
            r = t - 1
        else:
            t = rng.randint(2, long_max)
            r = rng.randint(1, t - 1)
        total.append(t)
        response.append(r)
    order = list(range(n))
    rng.shuffle(order)
    return [total[i] for i in order], [response[i] for i in order]


def sparse_lengths(mode: CpMode, cp_size: int) -> tuple[list[int], list[int]]:
    """Samples that leave context-parallel ranks without any response.

    zigzag: samples of at most 2 tokens sit in chunks of one position, so every
    response is position 0, on rank 0. allgather: one sample of ``4 * cp_size``
    tokens with a one-token response at its end, on one late piece.
    """
    if mode == "allgather":
        return [4 * cp_size], [1]
    return [2, 1, 2], [1, 0, 1]


def make_batch(total: Sequence[int], response: Sequence[int], vocab: int, seed: int) -> Batch:
    """Random tokens, logits and loss weights for these lengths, and their reference."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    logits = [LOGIT_SCALE * torch.randn(t, vocab, generator=gen) for t in total]
    w_lp = [torch.randn(r, generator=gen) for r in response]
    w_ent = [torch.randn(r, generator=gen) for r in response]
    ref_lp, ref_ent, ref_grad = [], [], []
    for t, r, tok, lg, a, b in zip(total, response, tokens, logits, w_lp, w_ent):
        x = lg.double().requires_grad_()
        logp = torch.log_softmax(x / TEMPERATURE, -1)[t - r - 1 : t - 1]
        lp = logp.gather(1, tok[t - r :, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        loss = (a.double() * lp).sum() + (b.double() * ent).sum()
        (grad,) = torch.autograd.grad(loss, x)
        ref_lp.append(lp.detach())
        ref_ent.append(ent.detach())
        ref_grad.append(grad)
    return Batch(tuple(total), tuple(response), tokens, logits, w_lp, w_ent, ref_lp,
                 ref_ent, ref_grad)


def batches_for(case: Case, config: Config) -> list[Batch]:
    """The random batch (the same for every layout) and the case's sparse batch."""
    vocab = VOCAB_PER_RANK * config.tp_size
    lengths = [edge_lengths(config.samples, config.cp_size, config.seed)]
    if config.cp_size > 1:
        lengths.append(sparse_lengths(case.mode, config.cp_size))
    return [make_batch(t, r, vocab, config.seed + k) for k, (t, r) in enumerate(lengths)]


def batch_samples(case: Case, config: Config) -> int:
    """How many samples ``batches_for`` checks for this case."""
    extra = len(sparse_lengths(case.mode, config.cp_size)[0]) if config.cp_size > 1 else 0
    return config.samples + extra


# ---------------------------------------------------------------------------
# One rank's check.


class Errors(NamedTuple):
    """Largest absolute errors against the reference (inf for NaN or a wrong shape)."""

    log_prob: float
    entropy: float
    grad: float

    def worst(self, other: "Errors") -> "Errors":
        return Errors(*(max(a, b) for a, b in zip(self, other)))


def _max_error(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for x, y in zip(got, want):
        if x.shape != y.shape:
            return math.inf
        if x.numel():
            diff = (x.detach().double() - y.double()).abs().max()
            worst = max(worst, float(diff) if bool(diff.isfinite()) else math.inf)
    return worst


def _weighted(a: Sequence[Tensor], x: Sequence[Tensor], anchor: Tensor) -> Tensor:
    """``sum(w * v)``; a share of the wrong shape (already a failure: its error is inf)
    counts as ``0 * v``, so that the rank still runs the same backward as the others."""
    return sum(
        ((w * v).sum() if w.shape == v.shape else (v * 0).sum() for w, v in zip(a, x)), anchor
    )


def check_batch(
    case: Case,
    batch: Batch,
    config: Config,
    tp_rank: int,
    tp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
) -> tuple[Errors, bool]:
    """This rank's errors for one batch in one layout, and whether it held no response.

    Collectives: the TP all-gather of ``response_log_probs``; for allgather, the
    all-to-all of ``redistribute`` and its reverse in backward. Every rank enters them.
    """
    seq = max(batch.total) + 1 if case.fmt == "bshd" else None
    layout = Layout.from_parallel_state(
        batch.total, batch.response, qkv_format=case.fmt, max_seq_len=seq,
        allgather_cp=case.mode == "allgather", align=case.align,
    )
    if layout.cp_mode != case.mode:
        raise RuntimeError(f"parallel_state gave cp_mode {layout.cp_mode!r}, not {case.mode!r}")
    # one padding row more than the rules need (from the oracle, not from _plan)
    length = oracle.least_length(
        batch.total, case.mode, case.fmt, seq, layout.cp_size, case.align
    ) + 1
    layout = layout.with_local_length(length)
    view = oracle.RankView(batch.total, batch.response, case.mode, case.fmt, seq,
                           layout.cp_rank, layout.cp_size, length, case.align)
    shard = slice(tp_rank * VOCAB_PER_RANK, (tp_rank + 1) * VOCAB_PER_RANK)
    logits = pack([x[:, shard] for x in batch.logits], layout).requires_grad_()
    lp, ent = response_log_probs(
        logits, batch.tokens, layout, with_entropy=True, temperature=TEMPERATURE,
        tp_group=tp_group, chunk_size=CHUNK_ROWS,
    )
    empty = sum(int(x.numel()) for x in lp) == 0
    err_lp = _max_error(lp, oracle.shares(batch.ref_lp, view))
    err_ent = _max_error(ent, oracle.shares(batch.ref_ent, view))
    where, where_view = layout, view
    if layout.cp_mode == "allgather":
        # what loss code written for ring attention reads: zigzag (none at cp 1)
        where = Layout.from_parallel_state(batch.total, batch.response)
        mode = "zigzag" if layout.cp_size > 1 else "none"
        where_view = oracle.RankView(
            batch.total, batch.response, mode, "thd", None, layout.cp_rank, layout.cp_size,
            oracle.least_length(batch.total, mode, "thd", None, layout.cp_size),
        )
        lp, ent = redistribute((lp, ent), layout, where, group=cp_group)
        err_lp = max(err_lp, _max_error(lp, oracle.shares(batch.ref_lp, where_view)))
        err_ent = max(err_ent, _max_error(ent, oracle.shares(batch.ref_ent, where_view)))
    anchor = logits.sum() * 0  # a rank holding no response still runs backward
    loss = _weighted(oracle.shares(batch.w_lp, where_view), lp, anchor) + _weighted(
        oracle.shares(batch.w_ent, where_view), ent, anchor
    )
    (grad,) = torch.autograd.grad(loss, logits)
    want = oracle.rows([g[:, shard] for g in batch.ref_grad], view)
    return Errors(err_lp, err_ent, _max_error([grad], [want])), empty


class Report(NamedTuple):
    """One rank's message to the parent: ready to start, a case's errors, or its failure."""

    rank: int
    cp_rank: int
    case: int  # index into Config.cases; -1 before the first case
    errors: Errors | None  # None when ready, or with a failure
    empty: tuple[bool, ...]  # per batch: this rank held no response
    failure: str | None  # the rank's traceback


if TYPE_CHECKING:
    Outbox = multiprocessing.queues.Queue[Report]
else:
    Outbox = multiprocessing.queues.Queue


def _rank_main(rank: int, port: int, config: Config, out: Outbox) -> None:
    """A spawned rank: gloo, megatron-core's parallel_state, then every case in order.

    A failure is sent to the parent first and cleaned up after: the parent kills the
    ranks still waiting in a collective for this one.
    """
    # Ctrl-C reaches the whole process group: the parent alone handles it (and kills
    # us). The parent spawned us with SIGINT ignored already, so that a Ctrl-C while
    # we import torch prints nothing either; this keeps it so.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world))
    if config.compile:
        from ._vocab import kernels

        kernels.mode = "1"
    where = {"case": -1, "cp_rank": -1}
    try:
        dist.init_process_group(
            "gloo", store=join_store(port), rank=rank, world_size=config.world
        )
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            tensor_model_parallel_size=config.tp_size, context_parallel_size=config.cp_size
        )
        cp_rank = where["cp_rank"] = ps.get_context_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_group = ps.get_tensor_model_parallel_group()
        cp_group = ps.get_context_parallel_group()
        out.put(Report(rank, cp_rank, -1, None, (), None))
        for case, c in enumerate(config.cases):
            where["case"] = case
            errors = Errors(0.0, 0.0, 0.0)
            empty = []
            for batch in batches_for(c, config):
                e, none_held = check_batch(c, batch, config, tp_rank, tp_group, cp_group)
                errors = errors.worst(e)
                # and again with per-token top-p / top-k sets (Support)
                errors = errors.worst(check_support_batch(c, batch, config, tp_rank, tp_group))
                empty.append(none_held)
            out.put(Report(rank, cp_rank, case, errors, tuple(empty), None))
    except Exception:  # noqa: BLE001 - sent to the parent, which reports it
        out.put(Report(rank, where["cp_rank"], where["case"], None, (), traceback.format_exc()))
    finally:
        _shut_down()


def _shut_down() -> None:
    """Leave megatron-core's parallel_state and the gloo group, whatever was set up."""
    if "megatron.core.parallel_state" in sys.modules:  # never import it just to leave
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The parent: spawn, collect, report.


@dataclass(frozen=True)
class CaseResult:
    """One layout's outcome over every rank."""

    case: Case
    cp_size: int
    tp_size: int
    samples: int
    empty_ranks: int  # (batch, CP rank) pairs in which that rank held no response
    errors: Errors
    tolerance: float
    seconds: float

    @property
    def passed(self) -> bool:
        return all(e <= self.tolerance for e in self.errors)  # NaN-free: inf stands for it


def host_store() -> TCPStore:
    """A torch.distributed store served from this process on a port of 127.0.0.1
    that the operating system picks (port 0) and this process holds until the store
    is dropped, so no other program can take it between choosing and binding
    (``store.port`` says which). Ranks join it with ``join_store``."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_store(port: int) -> TCPStore:
    """A client of the store ``host_store`` serves on ``port``; pass it to
    ``torch.distributed.init_process_group(store=...)``."""
    return TCPStore("127.0.0.1", port, is_master=False)


RankMain = Callable[[int, int, Config, Outbox], None]
"""A spawned rank's entry: ``(rank, store port, config, outbox)``; ``_rank_main``."""


def megatron_available() -> bool:
    """Whether megatron-core can be imported, found without importing it."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # "megatron" itself is missing (or blocked)
        return False


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while children are spawned: they inherit that from their first
    instruction, so a Ctrl-C while they import torch and megatron-core prints no
    tracebacks (the parent, which handles it, kills them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run(
    config: Config,
    progress: Callable[[CaseResult], None] | None = None,
    ready: Callable[[float], None] | None = None,
    *,
    rank_main: RankMain | None = None,
) -> list[CaseResult]:
    """Spawn the ranks, check every case, and return one result per case, in order.

    ``ready`` is called with the seconds the start took once every rank has set up
    gloo and megatron-core; ``progress`` with each case's result as soon as every
    rank has sent it. ``rank_main`` replaces each spawned rank's entry (a
    module-level function, for testing the verifier itself; default ``_rank_main``).

    Raises:
        ImportError: megatron-core is not installed (``pip install 'cpslice[megatron]'``).
        VerifyFailure: a rank raised (the message holds its traceback) or died; not
            every rank started within ``config.startup_timeout`` seconds; or the
            started ranks made no progress for ``config.timeout`` seconds (a hang).
            Every rank still running is killed first.
    """
    if not megatron_available():
        raise ImportError(MEGATRON_MISSING)
    ctx = multiprocessing.get_context("spawn")
    out: Outbox = ctx.Queue()
    store = host_store()
    procs = [
        ctx.Process(target=rank_main or _rank_main, args=(r, store.port, config, out),
                    daemon=True)
        for r in range(config.world)
    ]
    results: list[CaseResult] = []
    pending: dict[int, list[Report]] = {}
    started = 0
    start = last = time.monotonic()
    deadline = start + config.startup_timeout
    try:
        with _sigint_ignored():
            for p in procs:
                p.start()
        while len(results) < len(config.cases):
            left = deadline - time.monotonic()
            if left <= 0:
                if started < config.world:
                    raise VerifyFailure(
                        f"{config.world - started} of {config.world} ranks did not start "
                        f"within --startup-timeout {config.startup_timeout:g} s (spawning "
                        "them and importing torch and megatron-core; on a loaded machine "
                        "pass a larger --startup-timeout); killed them"
                    )
                done = len(pending.get(len(results), []))
                raise VerifyFailure(
                    f"{config.world - done} of {config.world} ranks made no progress on "
                    f"layout {config.cases[len(results)].name} for --timeout "
                    f"{config.timeout:g} s (a hang: a rank skipped a collective?); "
                    "killed them"
                )
            try:
                report = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    rank, code = dead[0]
                    raise VerifyFailure(f"rank {rank} died with exit code {code}") from None
                continue
            if report.failure is not None:
                where = (
                    f"in layout {config.cases[report.case].name}" if report.case >= 0
                    else "while starting"
                )
                raise VerifyFailure(f"rank {report.rank} raised {where}:\n{report.failure}")
            if report.errors is None:
                started += 1
                if started == config.world:
                    last = time.monotonic()
                    deadline = last + config.timeout
                    if ready is not None:
                        ready(last - start)
                continue
            deadline = time.monotonic() + config.timeout  # a rank made progress
            arrived = pending.setdefault(report.case, [])
            arrived.append(report)
            if len(arrived) == config.world and report.case == len(results):
                now = time.monotonic()
                results.append(_combine(config, report.case, arrived, now - last))
                last = now
                if progress is not None:
                    progress(results[-1])
        for p in procs:
            p.join(timeout=10)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
        del store


def _combine(config: Config, index: int, reports: list[Report], seconds: float) -> CaseResult:
    errors = Errors(0.0, 0.0, 0.0)
    empty: set[tuple[int, int]] = set()
    for r in reports:
        assert r.errors is not None
        errors = errors.worst(r.errors)
        empty |= {(k, r.cp_rank) for k, none_held in enumerate(r.empty) if none_held}
    case = config.cases[index]
    return CaseResult(case, config.cp_size, config.tp_size, batch_samples(case, config),
                      len(empty), errors, config.tolerance, seconds)


def header(config: Config) -> str:
    """What the run checks, before it starts."""
    sparse = (
        " + a few short ones that leave some CP ranks without a response"
        if config.cp_size > 1 else ""
    )
    return (
        f"cpslice verify: {_plural(config.world, 'gloo process', 'gloo processes')} "
        f"(cp {config.cp_size} x "
        f"tp {config.tp_size}) with megatron-core parallel_state; vocabulary "
        f"{VOCAB_PER_RANK * config.tp_size} ({VOCAB_PER_RANK} per TP rank), temperature "
        f"{TEMPERATURE}, seed {config.seed}\n"
        f"  each layout: {config.samples} random samples (single tokens, empty responses, "
        f"shorter than 2*cp, responses across chunk and rank boundaries){sparse};\n"
        "  log-probs, entropy and the logits' gradient of a weighted loss against "
        "float64 torch.log_softmax"
        + ("\n  log-prob kernels compiled by torch.compile (CPSLICE_COMPILE=1)" if config.compile else "")
    )


def progress_line(result: CaseResult) -> str:
    """One line per finished layout."""
    verdict = "pass" if result.passed else "FAIL"
    return f"  {result.case.name:<14} {verdict}  ({result.seconds:.2f} s)"


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _fmt(error: float) -> str:
    return f"{error:.1e}"


def table(results: Sequence[CaseResult], tolerance: float) -> str:
    """The result table, its tolerance, and the verdict."""
    width = max([15, *(len(r.case.name) + 1 for r in results)])
    head = (
        f"{'layout':<{width}}{'ranks (cp x tp)':>16}{'samples':>9}{'empty ranks':>13}"
        f"{'log-prob err':>14}{'entropy err':>13}{'grad err':>10}  result"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.case.name:<{width}}{f'{r.cp_size} x {r.tp_size}':>16}{r.samples:>9}"
            f"{r.empty_ranks:>13}{_fmt(r.errors.log_prob):>14}{_fmt(r.errors.entropy):>13}"
            f"{_fmt(r.errors.grad):>10}  {'pass' if r.passed else 'FAIL'}"
        )
    failed = sum(not r.passed for r in results)
    lines.append(
        f"errors: largest absolute difference on any rank; pass when each is <= "
        f"{tolerance:g} (float32 log-probs reach about -20 here)"
    )
    lines.append(
        "empty ranks: (batch, CP rank) pairs where that rank held no response, yet "
        "entered every collective"
    )
    lines.append(
        f"{_plural(len(results), 'layout')}: all pass" if not failed
        else f"{failed} of {_plural(len(results), 'layout')} FAIL"
    )
    return "\n".join(lines)


def verify_main(config: Config, *, rank_main: RankMain | None = None) -> int:
    """Run ``config``: the header and the table on stdout, a line per layout on stderr.

    Returns 0 when every layout passes, 1 when one fails or the run breaks (a rank
    raised, died, did not start or hung: said on stderr, with the rank's traceback).
    ``rank_main``: as ``run``'s.

    Raises:
        ImportError: megatron-core is not installed, before anything is printed.
    """
    if not megatron_available():
        raise ImportError(MEGATRON_MISSING)
    say(header(config))
    note(f"starting {_plural(config.world, 'process', 'processes')} (each imports "
         f"megatron-core: a few seconds, at most --startup-timeout "
         f"{config.startup_timeout:g} s)")

    def show(result: CaseResult) -> None:
        note(progress_line(result))

    def started(seconds: float) -> None:
        note(f"  {_plural(config.world, 'rank')} ready ({seconds:.1f} s)")

    try:
        results = run(config, show, started, rank_main=rank_main)
    except VerifyFailure as failure:
        note(f"cpslice verify: {failure}")
        return 1
    say(table(results, config.tolerance))
    return 0 if all(r.passed for r in results) else 1


def say(line: str) -> None:
    """A line on stdout, flushed (the table)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """A line on stderr, flushed (progress)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
