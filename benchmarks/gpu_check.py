"""The one prepared GPU command: every CUDA test and the GPU benchmarks, in one command,
within a budget (default 450 s: under 8 minutes on an H200, compiles included), its
output ready to paste into docs/numbers.md.

Run: ``make gpu-check``, or ``PYTHONPATH=src:. python3 -m benchmarks.gpu_check`` from the
repository's root (torch with CUDA and Triton, jaxtyping, pytest; no megatron-core, no
process groups, nothing to install: cpslice runs from ``src``). Stages, in order:

1. **The machine**: the device, torch, Triton, CUDA, the settings read
   (``CPSLICE_BACKEND``, ``CPSLICE_BLOCK_MIB``).
2. **Every CUDA test** (``CUDA_TESTS``), natively: pytest in a child process with
   ``TRITON_INTERPRET=0`` (the suite's conftest.py would otherwise set the interpreter,
   and the CUDA modules skip under it), at most ``--tests-limit`` seconds. A skip is a
   miss: on a GPU every one of them must run.
3. **The hidden-state path's benchmark** (``gpu_hidden``): cpslice in the default and
   invariant modes, log-prob only, with entropy and forward-only, against the peers that
   import (Liger's fused-linear cross-entropy, cut-cross-entropy, torch's materialized
   recipe, verl's chunked recipe), at T = 16384, H = 4096, V = 151936, bfloat16: time
   against the four-GEMM floor at the matmul rate measured first, peak memory beyond
   the inputs and their gradients, error against float64, the Triton kernels launched.
4. **The logits path's checks** (``gpu_logits``, ``gpu_triton_invariant.check``,
   ``gpu_bench.table``), while the budget allows (at least ``LOGITS_MIN`` seconds left).
5. **The summary**: the issue's goals, each PASS or MISS (a goal's time scaled by the
   matmul rate measured against the 800 TFLOP/s the goals were set at, on a device
   other than an H200), the tests, the correctness checks, and the elapsed time.

A stage or a method past its share of the budget stops, saying so on its line (never
silently past the deadline); a figure not measured says "unmeasured". ``--only``
reruns some stages. Exit status 1: a CUDA test failed or did not run, or cpslice
computed a wrong value or ran no Triton kernel; the goals' MISS is a measurement, not a
failure.

``--smoke`` runs every stage on the CPU at tiny sizes (with ``TRITON_INTERPRET=1``, the
Triton kernels through the interpreter), so that the command cannot rot on a machine
without a GPU (``tests/project/test_gpu_check.py`` runs it): its figures mean nothing.
"""

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from cpslice._vocab.backends.triton.interpreter import interpreted

from . import gpu_bench, gpu_hidden, gpu_logits, gpu_triton_invariant
from .gpu_device import Deadline, Device, OverBudget
from .gpu_peers import DEFAULT, FORWARD, INVARIANT

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = (
    "tests/vocabulary/test_hidden_cuda.py",
    "tests/vocabulary/test_triton_cuda.py",
    "tests/layout/test_padded.py::test_from_cu_seqlens_reads_a_device_tensor_once[cuda]",
    "tests/layout/test_row_offsets.py::test_from_attention_mask_reads_a_device_tensor_once[cuda]",
)
"""Every test that runs on CUDA alone (``tests/project/test_gpu_check.py`` keeps the list
whole): the modules skipped without a GPU, and the CUDA cases of the host-read tests."""
STAGES = ("tests", "hidden", "logits")
BUDGET = 450.0
"""Seconds the command may take by default: 7.5 minutes, under the 8 an H200's run has."""
LOGITS_MIN = 60.0
"""Seconds the logits path's stage needs left to start."""
RESERVE = 10.0
"""Seconds kept for the summary."""
REFERENCE_RATE = 800e12
"""The matmul rate the goals' times were set at (an H200's bfloat16, measured)."""
GRAD_TOLERANCE = 3e-2
"""A bfloat16 gradient's error, relative to its largest entry (the tests' ``TOLERANCE``)."""


class Goal(NamedTuple):
    """One line of the summary."""

    what: str
    measured: str
    target: str
    verdict: str


@dataclass
class Tests:
    """The CUDA tests' outcome."""

    ran: bool = False
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""
    reasons: list[str] = field(default_factory=list)


@dataclass
class Report:
    """What the stages found, for the summary and the exit status."""

    smoke: bool
    tests: Tests = field(default_factory=Tests)
    hidden: dict[str, gpu_hidden.Row] = field(default_factory=dict)
    rate: float | None = None
    tolerance: float = 0.0
    """What cpslice's values may be off by (``Reference.value_tolerance``)."""
    logits_ok: bool | None = None
    logits_note: str = "unmeasured: not run"
    broken: list[str] = field(default_factory=list)
    """The stages that failed as a whole."""


def say(line: str) -> None:
    print(line, flush=True)


def machine(device: Device, args: argparse.Namespace) -> None:
    """Stage 1: what the run ran on."""
    triton = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton as tr

        triton = tr.__version__
    say(f"### gpu_check on {device.name()}{' (smoke: tiny sizes on the CPU)' if args.smoke else ''}")
    say(f"torch {torch.__version__} (CUDA {torch.version.cuda}), Triton {triton}, Python {platform.python_version()}; "
        f"memory {device.total_bytes() / 2**30:.0f} GiB")
    setting = {name: os.environ.get(name, "") for name in ("CPSLICE_BACKEND", "CPSLICE_BLOCK_MIB", "TRITON_INTERPRET")}
    say("settings: " + ", ".join(f"{k}={v!r}" for k, v in setting.items()) + f"; budget {args.budget:.0f} s; "
        f"stages {','.join(args.only)}")


def _pytest_argv(xml: Path) -> list[str]:
    """pytest on ``CUDA_TESTS`` with the project's options less its jaxtyping hook where
    beartype (the hook's checker) does not import (a GPU machine's image may lack it)."""
    argv = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rfEs",
            "--tb=short", f"--junitxml={xml}"]
    if importlib.util.find_spec("beartype") is not None:
        argv.append("--jaxtyping-packages=cpslice,beartype.beartype")
    return [*argv, *CUDA_TESTS]


def _outcome(xml: Path) -> Tests:
    """Counts and skip reasons of a junit XML report."""
    tests = Tests(ran=True)
    root = ElementTree.parse(xml).getroot()
    for case in root.iter("testcase"):
        outcome = {child.tag for child in case}
        tests.seconds += float(case.get("time", "0"))
        if outcome & {"failure", "error"}:
            tests.failed += 1
        elif "skipped" in outcome:
            tests.skipped += 1
            reason = next(c.get("message", "") for c in case if c.tag == "skipped")
            if reason not in tests.reasons:
                tests.reasons.append(reason)
        else:
            tests.passed += 1
    return tests


def cuda_tests(deadline: Deadline, limit: float) -> Tests:
    """Stage 2: ``CUDA_TESTS`` in a child pytest, Triton compiled (``TRITON_INTERPRET=0``)."""
    seconds = min(limit, deadline.left() - RESERVE)
    say(f"\n### CUDA tests (pytest, TRITON_INTERPRET=0, at most {seconds:.0f} s)")
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    began = deadline.elapsed()
    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "cuda-tests.xml"
        try:
            done = subprocess.run(_pytest_argv(xml), cwd=ROOT, env=env, timeout=max(seconds, 1.0), check=False)
        except subprocess.TimeoutExpired:
            return Tests(ran=False, note=f"unfinished: stopped past its {seconds:.0f} s (the output above)")
        if not xml.exists():
            return Tests(ran=False, note=f"pytest exited {done.returncode} before reporting (the output above)")
        tests = _outcome(xml)
    tests.note = f"pytest exit status {done.returncode}"
    say(f"CUDA tests: {tests.passed} passed, {tests.failed} failed, {tests.skipped} skipped in "
        f"{deadline.elapsed() - began:.0f} s (the tests themselves {tests.seconds:.0f} s)")
    for reason in tests.reasons:
        say(f"  skipped: {reason}")
    return tests


def tests_stage(deadline: Deadline, limit: float, report: Report) -> None:
    report.tests = cuda_tests(deadline, limit)


def hidden_stage(device: Device, sizes: gpu_hidden.Sizes, deadline: Deadline, report: Report) -> None:
    """Stage 3: the hidden-state path's table, a line per method as it is measured (the
    stage may use the budget up to the summary's reserve: the logits path runs only in
    what it leaves)."""
    say(f"\n### The hidden-state path: T = {sizes.t}, H = {sizes.h}, V = {sizes.v}, bfloat16")
    say("forward + backward unless forward-only; x floor: against four GEMMs (8 T H V) forward + backward, one "
        "(2 T H V) forward-only, at the matmul rate measured here; errors against float64 (values: absolute; "
        "gradients: relative to their largest entry)")
    bench = gpu_hidden.setup(device, sizes, say)
    report.rate, report.tolerance = bench.floor.rate(), bench.ref.value_tolerance()
    say(gpu_hidden.HEADER)
    for row in gpu_hidden.rows(bench, device, sizes, deadline, deadline.end - RESERVE):
        say(gpu_hidden.line(row))
        report.hidden[row.method.name] = row
    del bench
    device.release()


def _timed(deadline: Deadline, what: str, check: Callable[[], bool]) -> bool | None:
    """``check()`` within what is left of the budget (less the summary's reserve): its
    verdict; False (and a line saying so) when it failed; None when it ran past the
    budget."""
    try:
        with deadline.limit(deadline.left() - RESERVE):
            return check()
    except OverBudget as late:
        say(f"{what}: stopped, {late} (the budget's end)")
    except Exception as error:  # a check that breaks is a failed check, and the command goes on
        say(f"{what}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
        return False
    return None


def logits_checks(device: Device, smoke: bool) -> list[tuple[str, Callable[[], bool]]]:
    """The logits path's checks, in order, at the device's sizes or the smoke run's."""
    where = device.where.type
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    caps: tuple[float | None, ...]
    quick: tuple[str, ...]
    if smoke:
        shape, dtypes, caps, (t, v, repeat) = (10, 300, 290), (torch.bfloat16,), (30.0,), (8, 300, 1)
        quick = ("triton default", "triton invariant", "naive")
    else:
        shape, dtypes, caps = gpu_triton_invariant.SHAPE, (torch.float32, torch.bfloat16), (None, 30.0, 5.0)
        t, v, repeat, quick = gpu_bench.T, gpu_bench.VOCABS[0], 5, gpu_bench.QUICK

    def bench() -> bool:
        bw = gpu_bench.bandwidth(device)
        say(f"logits path against the bandwidth floor: copy bandwidth {bw / 1e12:.3g} TB/s")
        gpu_bench.table(device, t, v, torch.bfloat16, bw, repeat, gpu_bench.methods(quick))
        return True

    return [
        ("layouts", lambda: gpu_logits.layouts(device, 8 if smoke else 64)),
        ("log_probs_at", lambda: gpu_logits.log_probs_at(device)),
        ("response rows", lambda: gpu_logits.response_rows(device, *((64, 300, 1) if smoke else (4096, 32768, 5)))),
        ("memory", lambda: gpu_logits.memory(device, *((16, 300, 1) if smoke else (4096, 32768, 5)))),
        ("invariant kernels' bits", lambda: gpu_triton_invariant.check(where, shape, dtypes, caps)),
        ("logits-path timing", bench),
    ]


def logits_stage(device: Device, smoke: bool, deadline: Deadline, report: Report) -> None:
    """Stage 4: the logits path's checks while the budget allows, each stopped at its end."""
    if deadline.left() < LOGITS_MIN + RESERVE:
        report.logits_note = f"unmeasured: {deadline.left():.0f} s left, under the {LOGITS_MIN:.0f} s it needs"
        say(f"\n### The logits path: {report.logits_note}")
        return
    say("\n### The logits path")
    ok, done = True, []
    checks = logits_checks(device, smoke)
    for what, check in checks:
        if deadline.left() < RESERVE + 5:
            say(f"{what}: unmeasured: the budget was spent")
            continue
        verdict = _timed(deadline, what, check)
        device.release()
        if verdict is not None:
            ok &= verdict
            done.append(what)
    report.logits_ok = ok
    report.logits_note = f"{len(done)} of {len(checks)} checks ran" + ("" if ok else ", one FAILED (above)")


def _row_ms(report: Report, name: str) -> float | None:
    row = report.hidden.get(name)
    return None if row is None else row.ms


def _verdict(ok: bool | None, smoke: bool) -> str:
    if ok is None:
        return "unmeasured"
    word = "PASS" if ok else "MISS"
    return f"{word} (smoke: not the goal's device or size)" if smoke else word


def _time_goal(report: Report, what: str, name: str, goal_ms: float, scale: float) -> Goal:
    ms = _row_ms(report, name)
    here = "" if scale == 1.0 else f"; {goal_ms * scale:.1f} ms at this matmul rate (x{scale:.3g})"
    target = f"<= {goal_ms:g} ms on an H200{here}"
    return Goal(what, "unmeasured" if ms is None else f"{ms:.1f} ms", target,
                _verdict(None if ms is None else ms <= goal_ms * scale, report.smoke))


def _tests_goal(report: Report) -> Goal:
    """Every CUDA test passed, none skipped (the smoke run: skipped without CUDA, the
    CPU-only ones passed)."""
    t = report.tests
    if not t.ran:
        return Goal("every CUDA test, natively", t.note or "unmeasured: not run", "all pass, none skipped",
                    "MISS" if t.note else "unmeasured")
    ok = t.failed == 0 and t.passed > 0 and (t.skipped == 0 or report.smoke)
    verdict = ("PASS" if ok else "MISS") + (" (smoke: skipped without CUDA)" if report.smoke else "")
    return Goal("every CUDA test, natively", f"{t.passed} passed, {t.failed} failed, {t.skipped} skipped",
                "all pass, none skipped", verdict)


def _cpslice_rows(report: Report) -> list[gpu_hidden.Row]:
    return [row for row in report.hidden.values() if row.method.cpslice and row.ms is not None]


def _correct(row: gpu_hidden.Row, tolerance: float) -> bool:
    e = row.errors
    if e is None:
        return False
    values = [v for v in (e.lp, e.ent) if v is not None]
    grads = [v for v in (e.d_hidden, e.d_weight) if v is not None]
    return all(v <= tolerance for v in values) and all(g <= GRAD_TOLERANCE for g in grads)


def _kernels_ran(row: gpu_hidden.Row) -> bool:
    prefix = "invariant_" if row.method.invariant else "default."
    want = {prefix + ("tiles" if row.method.invariant else "stats")}
    if row.method.grad:
        want.add(prefix + "grad")
    return all(name in row.kernels for name in want)


def goals(report: Report, device: Device) -> list[Goal]:
    """The issue's goals and the checks, each measured or "unmeasured"."""
    h200 = "H200" in device.name()
    scale = 1.0 if h200 or report.smoke or report.rate is None else REFERENCE_RATE / report.rate
    found = [
        _time_goal(report, "log-prob + entropy, forward + backward", DEFAULT, 115.0, scale),
        _time_goal(report, "forward-only (log-prob + entropy)", FORWARD, 30.0, scale),
    ]
    ours = _cpslice_rows(report)
    peaks = [(row.peak, row.method.name) for row in ours if row.peak is not None]
    peak, peak_row = max(peaks) if peaks else (None, "")
    found.append(Goal("peak beyond the inputs and their gradients", "unmeasured" if peak is None else
                      f"{peak / 2**30:.3f} GiB ({peak_row})", "<= 1 GiB",
                      _verdict(None if peak is None else peak <= 2**30, report.smoke)))
    default, inv = _row_ms(report, DEFAULT), _row_ms(report, INVARIANT)
    ratio = None if default is None or inv is None else inv / default
    found.append(Goal("invariant mode against the default", "unmeasured" if ratio is None else f"{ratio:.2f}x",
                      "<= 1.3x", _verdict(None if ratio is None else ratio <= 1.3, report.smoke)))
    found.append(_tests_goal(report))
    tolerance = report.tolerance
    wrong = [row.method.name for row in ours if not _correct(row, tolerance)]
    wrong += [f"{row.method.name} failed" for row in report.hidden.values()
              if row.method.cpslice and row.note.startswith("failed")]
    found.append(Goal("cpslice's values and gradients against float64", "unmeasured" if not ours and not wrong else
                      f"{len(ours) - len(wrong)} of {len(ours)} rows within" + (f" (not: {'; '.join(wrong)})"
                                                                               if wrong else ""),
                      f"values <= {tolerance:.1e}, gradients <= {GRAD_TOLERANCE:g} relative",
                      "unmeasured" if not ours and not wrong else "PASS" if not wrong else "FAIL"))
    missing = [row.method.name for row in ours if not _kernels_ran(row)]
    found.append(Goal("cpslice's Triton kernels ran", "unmeasured" if not ours else "in every row" if not missing
                      else f"not in: {'; '.join(missing)}",
                      "stats and grad kernels, default and invariant", "unmeasured" if not ours else
                      "PASS" if not missing else "FAIL"))
    found.append(Goal("the logits path's checks", report.logits_note, "every check passes",
                      "unmeasured" if report.logits_ok is None else "PASS" if report.logits_ok else "FAIL"))
    return found


def summary(report: Report, device: Device, deadline: Deadline) -> int:
    """Stage 5: the goals' table and the elapsed time; the exit status."""
    found = goals(report, device)
    say("\n### Summary (issue 50's goals: H200, bf16, T = 16384, H = 4096, V = 151936)")
    say("| goal | measured | target | verdict |\n|---|---|---|---|")
    for goal in found:
        say(f"| {goal.what} | {goal.measured} | {goal.target} | {goal.verdict} |")
    failed = [g.what for g in found if g.verdict == "FAIL" or g.what.startswith("every CUDA")
              and g.verdict.startswith("MISS")] + [f"the {name} stage broke" for name in report.broken]
    unmeasured = sum(g.verdict == "unmeasured" for g in found)
    say(f"gpu_check: elapsed {deadline.elapsed():.0f} s of a {deadline.seconds:.0f} s budget; "
        + ("no check failed" if not failed else "FAILED: " + "; ".join(failed))
        + (f" ({unmeasured} of {len(found)} lines unmeasured)" if unmeasured else ""))
    return 1 if failed else 0


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every stage on the CPU at tiny sizes (no GPU needed)")
    parser.add_argument("--budget", type=float, default=BUDGET, help=f"seconds in all (default {BUDGET:.0f})")
    parser.add_argument("--tests-limit", type=float, default=210.0, help="seconds for the CUDA tests (default 210)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"the stages to run, of {','.join(STAGES)}")
    args = parser.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(STAGES))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a stage (the stages: {','.join(STAGES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    deadline = Deadline(args.budget)
    if not args.smoke and not torch.cuda.is_available():
        say("gpu_check: no CUDA device here, nothing measured (--smoke runs every stage on the CPU at tiny sizes)")
        return 2
    if not args.smoke and interpreted():
        say("gpu_check: TRITON_INTERPRET=1 would run the Triton kernels in the interpreter, a program at a time: "
            "unset it (or set it to 0) to measure the GPU")
        return 2
    if args.smoke:  # numpy inside Triton's interpreter, on the -inf lanes the kernels mask
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
    device = Device("cpu" if args.smoke else "cuda")
    sizes = gpu_hidden.SMOKE if args.smoke else gpu_hidden.GPU
    report = Report(args.smoke)
    machine(device, args)
    if args.smoke and not interpreted():
        say("smoke: TRITON_INTERPRET is not 1, so the cpslice rows run the CPU's kernels, not Triton's")
    stages: dict[str, Callable[[], None]] = {
        "tests": lambda: tests_stage(deadline, args.tests_limit, report),
        "hidden": lambda: hidden_stage(device, sizes, deadline, report),
        "logits": lambda: logits_stage(device, args.smoke, deadline, report),
    }
    for name in STAGES:
        if name in args.only:
            _stage(name, stages[name], device, report)
    return summary(report, device, deadline)


def _stage(name: str, run: Callable[[], None], device: Device, report: Report) -> None:
    """Run a stage; one that breaks says how on a line, counts as a failure, and the
    command goes on to the next (its figures stay unmeasured)."""
    try:
        run()
    except OverBudget as late:
        say(f"stage {name}: stopped, {late}")
    except Exception as error:  # the summary and the other stages still run
        say(f"stage {name}: failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
        report.broken.append(name)
    device.release()


if __name__ == "__main__":
    sys.exit(main())
