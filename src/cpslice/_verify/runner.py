"""The parent of a ``cpslice verify`` run: it spawns the ranks, collects their reports
and says how far the run got.

The ranks (``rank.rank_main``) meet at a store this process serves on a port the
system picks and this process holds. ``run`` spawns them with SIGINT ignored,
waits for every rank to start (``startup_timeout``), then for progress (a finished
layout within ``timeout``), and turns a rank that raised or died, a slow start or a
hang into a ``VerifyFailure``, killing the ranks still running. ``verify_main`` prints
the header, a line per layout and the table (``report``), in which a layout the run
broke in is a FAIL with its reason and the layouts after it are not run, and returns
the exit status.
"""

import contextlib
import importlib.util
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from .. import _probe
from .batches import batch_samples
from .cases import Config
from .check import Errors
from .rank import Outbox, RankMain, Report
from .rank import rank_main as spawned_rank_main
from .report import CaseResult, header, note, plural, progress_line, say, table

MEGATRON_MISSING = (
    "megatron-core is not installed, and verify's ranks run megatron-core's "
    "parallel_state: pip install 'cpslice[megatron]'"
)


class VerifyFailure(RuntimeError):
    """The run itself broke: a rank raised or died, the ranks did not start in time,
    or the started ranks stopped making progress (a hang).

    ``case`` is the index of the layout it broke in (-1: before the first one), and
    ``reason`` one line of why (for a rank that raised, its error's last line);
    ``results`` holds the layouts every rank finished before.
    """

    def __init__(
        self, message: str, case: int = -1, reason: str = "",
        results: Sequence[CaseResult] = (),
    ) -> None:
        super().__init__(message)
        self.case = case
        self.reason = reason or message.splitlines()[0]
        self.results = list(results)


DRAIN_SECONDS = 5.0
"""After a rank raised in a layout, how long the parent still collects the reports
of the layouts before it (already sent by ranks that finished them)."""


def host_store() -> TCPStore:
    """A torch.distributed store served from this process on a port of 127.0.0.1
    that the operating system picks (port 0) and this process holds until the store
    is dropped, so no other program can take it between choosing and binding
    (``store.port`` says which). Ranks join it with ``rank.join_store``."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


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
) -> list[CaseResult]:
    """Spawn the ranks, check every case, and return one result per case, in order.

    ``ready`` is called with the seconds the start took once every rank has set up
    gloo and megatron-core; ``progress`` with each case's result as soon as every
    rank has sent it. Each rank runs ``rank.rank_main`` (``_probe``'s step ``rank_main``).

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
    entry: RankMain = _probe.step("rank_main", spawned_rank_main)
    procs = [
        ctx.Process(target=entry, args=(r, store.port, config, out),
                    daemon=True)
        for r in range(config.world)
    ]
    watch = _Watch(config, progress, ready)
    try:
        with _sigint_ignored():
            for p in procs:
                p.start()
        watch.collect(out, procs)
        for p in procs:
            p.join(timeout=10)
        return watch.results
    finally:
        _kill(procs)
        out.close()
        del store


def _kill(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Kill every rank still running (a run that broke, or one that outlived its join)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class _Watch:
    """What ``run`` knows of the ranks while they work: the results so far, the reports
    of the cases not yet complete, how many ranks started, and the deadline of the next
    step (the start, then no progress for ``config.timeout``)."""

    def __init__(self, config: Config, progress: Callable[[CaseResult], None] | None,
                 ready: Callable[[float], None] | None) -> None:
        self.config, self.progress, self.ready = config, progress, ready
        self.results: list[CaseResult] = []
        self.pending: dict[int, list[Report]] = {}
        self.started = 0
        self.start = self.last = time.monotonic()  # last: when the last layout finished
        self.deadline = self.start + config.startup_timeout

    def collect(self, out: Outbox, procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
        """Receive the ranks' reports until every case is a result; between reports, check
        the deadline and that every rank is alive.

        Raises:
            VerifyFailure: as ``run``.
        """
        while len(self.results) < len(self.config.cases):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self.timed_out()
            try:
                report: Report | None = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                report = None
            if report is None:
                self.check_alive(procs)
                continue
            if report.failure is not None:
                raise self.failed(report, out)
            self.receive(report)

    def take(self, report: Report) -> None:
        """File a case's errors; a case every rank has sent is a result."""
        self.pending.setdefault(report.case, []).append(report)
        while len(self.pending.get(len(self.results), [])) == self.config.world:
            now = time.monotonic()
            case = len(self.results)
            self.results.append(_combine(self.config, case, self.pending[case], now - self.last))
            self.last = now
            if self.progress is not None:
                self.progress(self.results[-1])

    def broken(self, message: str, case: int, reason: str) -> VerifyFailure:
        return VerifyFailure(message, case, reason, self.results)

    def timed_out(self) -> VerifyFailure:
        """The failure of a start that took too long, or of a hang."""
        config = self.config
        if self.started < config.world:
            return VerifyFailure(
                f"{config.world - self.started} of {config.world} ranks did not start "
                f"within --startup-timeout {config.startup_timeout:g} s (spawning "
                "them and importing torch and megatron-core; on a loaded machine "
                "pass a larger --startup-timeout); killed them"
            )
        done = len(self.pending.get(len(self.results), []))
        return self.broken(
            f"{config.world - done} of {config.world} ranks made no progress on "
            f"layout {config.cases[len(self.results)].name} for --timeout "
            f"{config.timeout:g} s (a hang: a rank skipped a collective?); "
            "killed them", len(self.results),
            f"hang: no progress for --timeout {config.timeout:g} s",
        )

    def check_alive(self, procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
        """Raise the failure of the first rank that died."""
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            rank, code = dead[0]
            case = len(self.results) if self.started == self.config.world else -1
            raise self.broken(f"rank {rank} died with exit code {code}", case,
                              f"rank {rank} died with exit code {code}")

    def failed(self, report: Report, out: Outbox) -> VerifyFailure:
        """The failure of a rank that raised (the other ranks' reports of the cases
        before it drained first)."""
        assert report.failure is not None
        if report.case < 0:
            return VerifyFailure(f"rank {report.rank} raised while starting:\n{report.failure}")
        _drain(out, self.take, self.results, report.case, min(DRAIN_SECONDS, self.config.timeout))
        last_line = report.failure.strip().splitlines()[-1]
        return self.broken(
            f"rank {report.rank} raised in layout {self.config.cases[report.case].name}:"
            f"\n{report.failure}", report.case, f"rank {report.rank} raised: {last_line}",
        )

    def receive(self, report: Report) -> None:
        """A rank's start, or its errors of one case (progress: a new deadline)."""
        if report.errors is None:
            self.started += 1
            if self.started == self.config.world:
                self.last = time.monotonic()
                self.deadline = self.last + self.config.timeout
                if self.ready is not None:
                    self.ready(self.last - self.start)
            return
        self.deadline = time.monotonic() + self.config.timeout  # a rank made progress
        self.take(report)


def _drain(
    out: Outbox, take: Callable[[Report], None], results: list[CaseResult], case: int,
    seconds: float,
) -> None:
    """Collect the reports of the layouts before ``case`` that are still on their way
    (sent by ranks that finished them), for at most ``seconds``."""
    until = time.monotonic() + seconds
    while len(results) < case and (left := until - time.monotonic()) > 0:
        try:
            report = out.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if report.errors is not None:
            take(report)


def _combine(config: Config, index: int, reports: list[Report], seconds: float) -> CaseResult:
    errors = Errors(0.0, 0.0, 0.0, 0.0, 0.0)
    empty: set[tuple[int, int]] = set()
    for r in reports:
        assert r.errors is not None
        errors = errors.worst(r.errors)
        empty |= {(k, r.cp_rank) for k, none_held in enumerate(r.empty) if none_held}
    case = config.cases[index]
    return CaseResult(case, config.cp_size, config.tp_size, batch_samples(case, config),
                      len(empty), errors, config.tolerance, seconds)


def _unfinished(config: Config, index: int, failure: str | None) -> CaseResult:
    """A layout the run broke in (``failure`` says why), or one it did not reach."""
    case = config.cases[index]
    return CaseResult(case, config.cp_size, config.tp_size, batch_samples(case, config),
                      None, None, config.tolerance, 0.0, failure)


def verify_main(config: Config) -> int:
    """Run ``config``: the header and the table on stdout, a line per layout on stderr.

    Returns 0 when every layout passes, 1 when one fails or the run breaks (a rank
    raised, died, did not start or hung: said on stderr, with the rank's traceback).
    A run that broke in a layout still prints the table: the layouts finished before,
    that layout FAIL with the reason (a rank's error: its last line), the rest not run.

    Raises:
        ImportError: megatron-core is not installed, before anything is printed.
    """
    if not megatron_available():
        raise ImportError(MEGATRON_MISSING)
    say(header(config))
    note(f"starting {plural(config.world, 'process', 'processes')} (each imports "
         f"megatron-core: a few seconds, at most --startup-timeout "
         f"{config.startup_timeout:g} s)")

    width = max((len(case.name) for case in config.cases), default=0)

    def show(result: CaseResult) -> None:
        note(progress_line(result, width))

    def started(seconds: float) -> None:
        note(f"  {plural(config.world, 'rank')} ready ({seconds:.1f} s)")

    try:
        results = run(config, show, started)
    except VerifyFailure as failure:
        note(f"cpslice verify: {failure}")
        if failure.case < 0:  # no layout ran: nothing to tabulate
            return 1
        results = failure.results + [
            _unfinished(config, k, failure.reason if k == failure.case else None)
            for k in range(len(failure.results), len(config.cases))
        ]
    say(table(results, config.tolerance))
    return 0 if all(r.passed for r in results) else 1
