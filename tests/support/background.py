"""Subprocesses that tests wait for, started in the background when the session's tests
are collected (``tests/conftest.py``), at a lower CPU priority.

A few tests run commands that take many seconds of CPU and need nothing from the
session: the planted ``cpslice verify`` runs (``planted.py``), the error tests rerun
with run-time checking off (``checked.py``), the compiled steps (``compile_job.py``),
and fresh interpreters that import cpslice, run its command line or build its
packages (registered by their test modules); each group is ``register``-ed by the
module that defines it. Started at once and niced, they use the cores the
session's own tests leave idle (a single-process test keeps one of the two busy; the
session waits on a subprocess) instead of running in line; a test that needs one's
result waits for it (``result``), which starts it if the session did not (a test run
alone).
"""

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple

NICENESS = 19
"""How much lower the background jobs run (they and their children): the lowest, so
that a dozen of their processes take next to nothing from a busy foreground. None
starves: a test that waits for one leaves the cores to it."""


class Job(NamedTuple):
    """A command to run in the background: its argv, environment and folder."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path


class Done(NamedTuple):
    """A background job's exit status, stdout and stderr."""

    code: int
    out: str
    err: str


_GROUPS: dict[str, tuple[str | tuple[str, ...], Callable[[], dict[str, Job]]]] = {}


def register(group: str, waits: str | tuple[str, ...], jobs: Callable[[], dict[str, Job]]) -> None:
    """Name a group of jobs: the tests that wait for it (a node id prefix, or several),
    and the function that makes its jobs (called once, when the group starts). A
    helper module registers when conftest.py imports it, a test module when pytest
    collects it: either way before the session orders and starts anything."""
    _GROUPS[group] = (waits, jobs)


_JOBS: dict[str, dict[str, Job]] = {}
_RUNS: dict[str, tuple[subprocess.Popen[str], IO[str], IO[str]]] = {}
_DONE: dict[str, Done] = {}
_FOLDER: list[Path] = []


def start(group: str) -> None:
    """Start a group's jobs, all at once, unless started."""
    if group in _JOBS:
        return
    jobs = _JOBS[group] = _GROUPS[group][1]()
    for name, job in jobs.items():
        out, err = (tempfile.TemporaryFile("w+", dir=folder()) for _ in "oe")
        proc = subprocess.Popen(job.argv, env=job.env, cwd=job.cwd, stdout=out, stderr=err,
                                text=True)
        # set from here (no preexec_fn, unsafe in a threaded parent): the interpreter is
        # still starting, seconds before it spawns the children that inherit it
        os.setpriority(os.PRIO_PROCESS, proc.pid, NICENESS)
        # and SCHED_IDLE: a waking foreground process (a gloo rank answering a
        # collective) preempts them at once instead of waiting out their time slice
        os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        _RUNS[name] = (proc, out, err)


def waits(nodeid: str) -> bool:
    """Whether this test (a node id) waits for a group's jobs."""
    return any(nodeid.startswith(prefix) for prefix, _ in _GROUPS.values())


def start_for(nodeids: list[str]) -> None:
    """Start every group that one of these tests (node ids) waits for."""
    for group, (prefix, _) in _GROUPS.items():
        if any(nodeid.startswith(prefix) for nodeid in nodeids):
            start(group)


def result(group: str, timeout: float) -> dict[str, Done]:
    """Each of a group's jobs' ``Done``, once all have ended (started here if not yet).
    A job still running ``timeout`` seconds from now is killed: its ``Done`` has the
    kill's exit status and says so on its stderr."""
    start(group)
    deadline = time.monotonic() + timeout
    names = list(_JOBS[group])
    for name in names:
        if name in _DONE:
            continue
        proc, out, err = _RUNS.pop(name)
        late = ""
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = f"\n[killed: still running {timeout:g} s after its result was asked for]"
        _end(proc)
        out.seek(0)
        err.seek(0)
        _DONE[name] = Done(proc.returncode, out.read(), err.read() + late)
        out.close()
        err.close()
    return {name: _DONE[name] for name in names}


def folder() -> Path:
    """A folder for the jobs' files, removed when the session ends."""
    if not _FOLDER:
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="cpslice-background-")))
        atexit.register(_stop)
    return _FOLDER[0]


def _end(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs, and wait for it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stop() -> None:
    for proc, out, err in _RUNS.values():
        _end(proc)
        out.close()
        err.close()
    _RUNS.clear()
    shutil.rmtree(_FOLDER[0], ignore_errors=True)
