"""Real torch.distributed gloo worlds for the tests, one per size, shared by the session.

Starting a world is the slow part of a distributed test here (a rank needs torch,
megatron-core and cpslice in debug mode: seconds of CPU each on 2 cores), so each size has
one persistent world, started on first use: processes that meet at a store the parent
serves on a port it holds (port 0: no race for a free port). Their imports are done once:
multiprocessing's fork server, started with the ranks' environment, imports them
(``_PRELOAD``) and forks every rank, a fresh process that never ran a task (its RNGs
reseeded, as a spawned one's are), in a fraction of a second. ``run_distributed``
runs one task on every rank of it, with a timeout so that a hang fails the test instead
of blocking CI. After each task every rank puts back what a task may have changed for
the whole process (``_Baseline``), so the next task sees what a fresh world would show
it; a world in doubt (a hang, a dead rank, an interrupt) is killed, and the next task
starts a new one. The worlds stop when the session's interpreter exits.

What is not put back is shared on purpose: caches (cpslice's plans and compiled
kernels, the subgroups of ``tp_groups``), and the GPTModel CPU shims of
examples/gpt_cpu.py, installed once per process, which replace code paths that only
run on CUDA. No test here needs a process no other test used; one that does would
need a world of its own.
"""

import atexit
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported untyped

Worker = Callable[..., Any]

GRACE = 10.0
"""Seconds the other ranks get to finish a task once a rank raised in it (they may be
waiting in a collective it skipped; then the world is killed)."""

POLL = 0.1
"""Seconds between looks at the ranks while a task runs: how soon a dead one is noticed."""

_CTX = mp.get_context("forkserver")
_PRELOAD = ["tests.support._dist", "cpslice", "hypothesis", "megatron.core.parallel_state"]
"""What the fork server imports once, before it forks any rank (with the ranks'
environment: cpslice in debug mode), instead of every rank importing it: torch and
torch.distributed (this module), cpslice, and what most tasks' modules import. It runs
nothing else: a fork of it is single-threaded, with no OpenMP pool or process group."""
_CTX.set_forkserver_preload(_PRELOAD)
_MISSING = object()


_RANK_ENV = {
    "CPSLICE_DEBUG": "1",
    # every new_group ends in a barrier: without it a rank leaves new_group while its
    # peer is still connecting, and a group destroyed at once (a task that leaves
    # megatron-core initialized) breaks the peer's connection, so that the two ranks
    # no longer agree on the next group's name
    "TORCH_DIST_INIT_BARRIER": "1",
}


@contextmanager
def _rank_environment() -> Iterator[None]:
    """``_RANK_ENV`` in the environment the ranks start with: cpslice's run-time
    checks on there from their first import of it, and a barrier after each new
    process group."""
    old = {name: os.environ.get(name) for name in _RANK_ENV}
    os.environ.update(_RANK_ENV)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class _Baseline:
    """A rank's process-wide state between tasks, put back after each one: the global
    RNG state, thread count, default dtype, grad mode and environment of the fresh
    process, and the globals of ``torch.distributed`` and of cpslice's modules as they
    were when the task started (a task that fails inside a block of cpslice's
    instrumentation hook leaves nothing open for the next one).
    megatron-core's parallel_state is the task's to destroy (``destroy_megatron``):
    one left initialized is destroyed here and fails the task."""

    def __init__(self) -> None:
        self.rng = torch.get_rng_state()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.environ = dict(os.environ)
        self.globals: dict[ModuleType, dict[str, Any]] = {}

    def snapshot(self) -> None:
        """Record the watched modules' globals (once the task's modules are imported)."""
        loaded: dict[str, object] = dict(sys.modules)  # a blocked import's entry is None
        watched = [m for name, m in loaded.items()
                   if isinstance(m, ModuleType) and (name == "torch.distributed" or name.split(".")[0] == "cpslice")]
        self.globals = {m: dict(vars(m)) for m in watched}

    def restore(self) -> str | None:
        """Put everything back; what the task left that fails it, if anything."""
        torch.set_rng_state(self.rng)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        for module, before in self.globals.items():
            now = vars(module)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(module, name, value)
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            destroy_megatron()
            return "the task left megatron-core's parallel_state initialized (call destroy_megatron)"
        _destroy_megatron_groups()  # a task that left through parallel_state itself
        return None


def start_fork_server() -> None:
    """Start the fork server now, in the ranks' environment: its imports take seconds of
    CPU, which the session's first world would otherwise wait for (conftest.py calls it
    once the tests are collected, where one of them runs on a world). Its output, and
    every rank's, goes nowhere: outside a test, the session's own would show it (started
    by a world, it goes where that test's went, captured)."""
    from multiprocessing import forkserver

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (1, 2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        with _rank_environment():
            forkserver.ensure_running()
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def _reseed() -> None:
    """Seed torch's and numpy's global RNGs at random, as a spawned process finds them: a
    fork has the fork server's, the same in every rank (Python's ``random`` reseeds itself
    at a fork)."""
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _serve(rank: int, size: int, port: int, inbox: Any, outbox: Any) -> None:
    """One rank of a world: join it, then run tasks until told to stop (``None``) or
    the session's process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the parent's to handle: it kills us
    _reseed()
    # one intra-op thread: a world's ranks outnumber the machine's cores, and idle
    # OpenMP workers spinning between a rank's small ops would take them from the others
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    baseline = _Baseline()
    parent = os.getppid()  # the fork server, which exits when the session does
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the session was killed without stopping us
            continue
        if message is None:
            break
        task, blob = message
        try:
            fn, args = ForkingPickler.loads(blob)
            baseline.snapshot()
            # pickled here: a result that cannot be pickled fails the task with its
            # traceback instead of vanishing in the queue's feeder thread
            report: tuple[bool, Any] = (True, bytes(ForkingPickler.dumps(fn(rank, size, *args))))
        except BaseException:  # every failure goes to the parent, which re-raises it
            report = (False, traceback.format_exc())
        left = baseline.restore()
        if left is not None and report[0]:
            report = (False, left)
        # the ranks' count of process groups made, which names the next one: ranks
        # that disagree would meet in different groups' keys of the store
        outbox.put((task, rank, *report, _c10d._world.group_count))
    dist.destroy_process_group()


class _World:
    """``size`` gloo ranks, each serving the tasks of its own inbox."""

    def __init__(self, size: int) -> None:
        self.size = size
        # served from here for the world's life: new_group meets there too
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.inboxes = [_CTX.Queue() for _ in range(size)]
        self.outbox = _CTX.Queue()
        self.tasks = 0
        # the fork server starts at the session's first rank, in this environment, and
        # forks every rank of every world from it
        with _rank_environment():
            self.procs = [
                _CTX.Process(target=_serve, args=(r, size, self.store.port, self.inboxes[r], self.outbox),
                             daemon=True, name=f"rank {r} of the test world of {size}")
                for r in range(size)
            ]
            for p in self.procs:
                p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Worker, args: tuple[Any, ...], timeout: float) -> dict[int, tuple[bool, Any]]:
        """Each rank's ``(True, result)`` or ``(False, traceback)``. Raises, leaving the
        world unusable, when some rank does not finish: a hang, a death, a rank still
        waiting ``GRACE`` seconds after another one failed."""
        self.tasks += 1
        for inbox in self.inboxes:  # pickled per rank: a tensor's shared handle is taken once
            inbox.put((self.tasks, bytes(ForkingPickler.dumps((fn, args)))))
        reports: dict[int, tuple[bool, Any]] = {}
        groups: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _unfinished(self.size - len(reports), self.size, timeout, reports)
            try:
                task, rank, ok, value, groups[rank] = self.outbox.get(timeout=min(left, POLL))
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{dead[0].name} died with exit code {dead[0].exitcode}") from None
                continue
            assert task == self.tasks, "a world that left a task unfinished is never reused"
            reports[rank] = (ok, ForkingPickler.loads(value) if ok else value)
            if not ok:
                deadline = min(deadline, time.monotonic() + GRACE)
        if len(set(groups.values())) > 1:
            raise RuntimeError(f"the ranks made different numbers of process groups ({dict(sorted(groups.items()))}): "
                               "the world's next group would not meet; it is discarded")
        return reports

    def leave(self) -> None:
        """Tell every rank to leave (``join`` waits for them)."""
        for inbox in self.inboxes:
            inbox.put(None)

    def join(self, end: float) -> None:
        """Wait for the ranks until ``end`` (``time.monotonic()``), then kill those left."""
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for q in (*self.inboxes, self.outbox):
            q.cancel_join_thread()
            q.close()


def _unfinished(missing: int, size: int, timeout: float, reports: dict[int, tuple[bool, Any]]) -> Exception:
    failed = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(reports.items()) if not ok]
    if failed:
        return AssertionError("\n".join(failed) + f"\n{missing} of {size} ranks did not finish "
                              f"within {GRACE}s of that (waiting in a collective it skipped?)")
    return TimeoutError(f"{missing} of {size} ranks did not finish within {timeout}s "
                        f"(a hang: some rank skipped a collective?)")


_WORLDS: dict[int, _World] = {}


def run_distributed(fn: Worker, world: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on every rank of the session's gloo world of
    ``world`` ranks; return each rank's result.

    ``fn`` must be a module-level function (the ranks import it), its arguments and
    results picklable. The world starts on first use (that time counts towards
    ``timeout``), its ranks with ``CPSLICE_DEBUG=1``, so cpslice's run-time checks are
    on there too. A rank that raises re-raises here with its traceback; the world
    serves the next task if every rank finished this one. Ranks still running after
    ``timeout`` seconds (a hang: a rank skipped a collective), or a rank that died,
    fail the test and the world is killed: the next task starts a new one.
    """
    current = _WORLDS.get(world)
    if current is None or not current.alive():
        if current is not None:
            current.kill()
        current = _WORLDS[world] = _World(world)
    try:
        reports = current.run(fn, args, timeout)
    except BaseException:  # a hang, a dead rank, an interrupt: this world is in doubt
        del _WORLDS[world]
        current.kill()
        raise
    errors = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(reports.items()) if not ok]
    if errors:
        raise AssertionError("\n".join(errors))
    return [reports[r][1] for r in range(world)]


def shutdown() -> None:
    """Stop every world, all at once: at exit, so that pytest leaves no process behind
    (the ranks' own exit runs it too, with no world to stop)."""
    worlds = list(_WORLDS.values())
    _WORLDS.clear()
    for w in worlds:
        w.leave()
    end = time.monotonic() + 10
    for w in worlds:
        w.join(end)


atexit.register(shutdown)


_MEGATRON_GROUPS: list[Any] = []
"""The process groups the last ``init_megatron`` made on this rank. megatron-core's
``destroy_model_parallel`` forgets its groups without destroying them, and a live gloo
group costs its rank CPU while it idles (its transport's threads wake): a world that
initializes megatron-core a dozen times, as the session's do, spent most of a core
idling. ``destroy_megatron`` destroys them."""


def init_megatron(tp: int, cp: int) -> None:
    """megatron-core's parallel_state over the current gloo world (order tp-cp-...)."""
    from megatron.core import parallel_state

    real = dist.new_group  # megatron-core makes every group through it

    def recorded(*args: Any, **kwargs: Any) -> Any:
        group = real(*args, **kwargs)
        _MEGATRON_GROUPS.append(group)
        return group

    dist.new_group = recorded
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp
        )
    finally:
        dist.new_group = real


def destroy_megatron() -> None:
    """Leave megatron-core's parallel_state, and destroy the groups it made."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _destroy_megatron_groups()


def _destroy_megatron_groups() -> None:
    while _MEGATRON_GROUPS:
        try:  # a non-member's is a no-op
            dist.destroy_process_group(_MEGATRON_GROUPS.pop())
        except ValueError:  # "Invalid process group": one megatron-core destroyed itself
            pass


_TP_GROUPS: list[tuple[Any, int, int]] = []


def tp_groups(rank: int, world: int) -> list[tuple[Any, int, int]]:
    """``(group, size, rank in it)`` for the vocabulary-parallel and sample-statistics
    workers: the whole world, then, in a world of 4, the two subgroups ``[0, 1]`` and
    ``[2, 3]`` (the rank offset comes from the group rank). Made once per rank process,
    and shared by every task it runs (``new_group`` is collective and must be entered by
    all ranks, and every live group costs its rank CPU while it idles)."""
    if not _TP_GROUPS:
        _TP_GROUPS.append((dist.group.WORLD, world, rank))
        if world == 4:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            _TP_GROUPS.append((pairs[rank // 2], 2, rank % 2))
    return list(_TP_GROUPS)
