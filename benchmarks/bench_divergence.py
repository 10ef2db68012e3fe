"""Full-vocabulary divergence from logits, forward + backward: ``vocab_divergence``
against the materialized recipe and against ``log_probs_and_entropy`` on the same logits.

GKD-style distillation (TRL's ``generalized_jsd_loss``) takes the KL or JSD of a
student's and a teacher's ``[T, V]`` logits; the teacher is detached. Each step
back-propagates the mean over rows into the student's float32 logits:

- ``cpslice``: ``vocab_divergence(student, teacher, kind=...)`` (the kernels
  ``CPSLICE_BACKEND`` selects: by default the compiled ones on the CPU; the gradient the
  one ``[T, V]`` buffer);
- ``naive``: the recipe written with torch ops, as TRL writes it: ``log_softmax`` of both
  sides in float32, then ``F.kl_div`` (the forward and reverse KL) or the mixture's
  ``logsumexp`` and two ``kl_div`` (the JSD), through autograd;
- ``log-probs``: ``log_probs_and_entropy(student, targets, with_entropy=True)``, both
  results' means back-propagated: the one-tensor pass the time is measured against
  (independent of the kind: measured once per case).

Cases: many rows of a small vocabulary (T = 4096, V = 32000: Llama 2, Mistral) and few
rows of a large one (T = 512, V = 152064: Qwen 2.5's padded LM head), each kind
(``"forward"``, ``"reverse"``, ``"jsd"`` at beta 0.5) at temperature 0.9.

Each method runs in a fresh subprocess (``--threads``: torch's threads there). After one
warm-up step (the compile), the allocator's free heap is returned and the peak RSS reset
(``harness.peak_growth``); peak memory is the growth of the peak RSS during one step
beyond the RSS before it (both logits existing), in units of one float32 ``[T, V]``
buffer, the student's gradient included. Time is the median wall time of a few further
steps, and ``cpu ms`` their median process CPU time (other load on the machine disturbs
it less, with ``--threads 1``). ``cpslice``'s process also times ``log-probs``' step,
the two interleaved step by step (``base ms``, its median CPU time there), so that the
time ratio, of those two, compares steps that ran under the same load; the other ratios
are across processes. Targets: ``cpslice`` within 1.6x the CPU time of ``log-probs``,
0.4x the peak of ``naive`` and 1.15 buffers.

The same divergence from the hidden states (``vocab_divergence_from_hidden``) is
measured by ``benchmarks/bench_divergence_hidden.py``.

Run: ``.venv/bin/python -m benchmarks.bench_divergence [--quick] [--threads N]
[--kinds forward,reverse,jsd] [--methods cpslice,naive,log-probs] [--cases 4096x32000,...]``
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

if TYPE_CHECKING:
    from cpslice._types import Divergence

METHODS = ("cpslice", "naive", "log-probs")
KINDS = ("forward", "reverse", "jsd")
CASES = ((4096, 32000), (512, 152064))
QUICK_CASES = ((1024, 8192),)
TEMPERATURE = 0.9
BETA = 0.5
TIME_TARGET, PEAK_TARGET, BUFFERS_TARGET = 1.6, 0.4, 1.15


@dataclass
class Result:
    method: str
    kind: str  # "-" for log-probs
    t: int
    v: int
    peak_buffers: float  # peak RSS growth of a step in float32 [T, V] buffers
    median_ms: float
    cpu_ms: float
    base_ms: float | None = None  # cpslice's process: log-probs' step, interleaved (median CPU ms)


def naive(student: Tensor, teacher: Tensor, kind: str) -> Tensor:
    """Each row's divergence, materialized: TRL's recipe (``F.kl_div`` with ``log_target``
    of the float32 log-softmaxes; the JSD through the mixture's ``logsumexp``)."""
    s = F.log_softmax(student.float() / TEMPERATURE, -1)
    t = F.log_softmax(teacher.float() / TEMPERATURE, -1)
    if kind == "forward":
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if kind == "reverse":
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    log_beta = torch.log(torch.tensor(BETA))
    log_rest = torch.log(torch.tensor(1.0 - BETA))
    m = torch.logsumexp(torch.stack([s + log_rest, t + log_beta]), dim=0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return BETA * kl_t + (1.0 - BETA) * kl_s


def _step(method: str, kind: str, student: Tensor, teacher: Tensor, targets: Tensor) -> None:
    from cpslice import log_probs_and_entropy, vocab_divergence

    if method == "cpslice":
        divergence = cast("Divergence", kind)
        loss = vocab_divergence(student, teacher, kind=divergence, beta=BETA, temperature=TEMPERATURE).mean()
    elif method == "naive":
        loss = naive(student, teacher, kind).mean()
    else:
        lp, ent = log_probs_and_entropy(student, targets, with_entropy=True, temperature=TEMPERATURE)
        loss = lp.mean() + ent.mean()
    torch.autograd.backward(loss)
    student.grad = None


def _child(method: str, kind: str, t: int, v: int, repeat: int, threads: int) -> Result:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    student = (torch.randn(t, v) * 2).requires_grad_(True)
    teacher = torch.randn(t, v) * 2
    targets = torch.randint(0, v, (t,))

    def step() -> None:
        _step(method, kind, student, teacher, targets)

    def base() -> None:
        _step("log-probs", "-", student, teacher, targets)

    step()  # warm-up: lazy imports, the compile
    peak = peak_growth(step)
    interleave = method == "cpslice"
    if interleave:
        base()
    times, cpu, base_cpu = [], [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - start_cpu)
        times.append(time.perf_counter() - start)
        if interleave:
            start_cpu = time.process_time()
            base()
            base_cpu.append(time.process_time() - start_cpu)
    return Result(method, kind, t, v, peak / (t * v * 4), 1e3 * statistics.median(times),
                  1e3 * statistics.median(cpu), 1e3 * statistics.median(base_cpu) if base_cpu else None)


def _in_subprocess(method: str, kind: str, t: int, v: int, repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, kind, str(t), str(v), str(repeat), str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(
    quick: bool = False, threads: int = 0, kinds: Sequence[str] = KINDS, methods: Sequence[str] = METHODS,
    cases: Sequence[tuple[int, int]] | None = None,
) -> list[Result]:
    """One Result per (case, method, kind), each in a fresh subprocess; ``log-probs`` once
    per case (its kind ``"-"``)."""
    repeat = 2 if quick else 5
    chosen = cases or (QUICK_CASES if quick else CASES)
    results = []
    for t, v in chosen:
        for m in methods:
            for kind in kinds if m != "log-probs" else ("-",):
                results.append(_in_subprocess(m, kind, t, v, repeat, threads))
    return results


def _ratios(mine: Result, base: Result | None, naive_: Result | None) -> str:
    parts = [f"peak {mine.peak_buffers:.2f} buffers (target <= {BUFFERS_TARGET})"
             + ("" if mine.peak_buffers <= BUFFERS_TARGET else " !")]
    against = mine.base_ms if mine.base_ms is not None else None if base is None else base.cpu_ms
    if against is not None:
        ratio = mine.cpu_ms / against
        parts.append(f"time {ratio:.2f}x log-probs (target <= {TIME_TARGET}x)" + ("" if ratio <= TIME_TARGET else " !"))
    if naive_ is not None:
        peak = mine.peak_buffers / naive_.peak_buffers
        parts.append(f"peak {peak:.2f}x naive (target <= {PEAK_TARGET}x)" + ("" if peak <= PEAK_TARGET else " !")
                     + f", time {mine.cpu_ms / naive_.cpu_ms:.2f}x naive")
    return "; ".join(parts)


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    say(f"vocab_divergence, forward + backward of the mean, float32 logits, temperature {TEMPERATURE}, "
        f"jsd beta {BETA}; peak in float32 [T, V] buffers (the gradient included), ratios of CPU times")
    say(f"{'T':>6}{'V':>8}  {'method':<10}{'kind':<9}{'peak':>7}{'median ms':>11}{'cpu ms':>9}{'base ms':>9}")
    for r in results:
        base = "" if r.base_ms is None else f"{r.base_ms:>9.1f}"
        say(f"{r.t:>6}{r.v:>8}  {r.method:<10}{r.kind:<9}{r.peak_buffers:>7.2f}{r.median_ms:>11.1f}{r.cpu_ms:>9.1f}"
            + base)
    by = {(r.t, r.v, r.method, r.kind): r for r in results}
    missed = 0
    for r in results:
        if r.method != "cpslice":
            continue
        line = _ratios(r, by.get((r.t, r.v, "log-probs", "-")), by.get((r.t, r.v, "naive", r.kind)))
        missed += line.count(" !")
        say(f"T={r.t} V={r.v} {r.kind}: {line}")
    say("every ratio meets its target" if not missed else f"MISSED: {missed} ratios (marked !) miss the target")


def _case(text: str) -> tuple[int, int]:
    t, _, v = text.partition("x")
    return int(t), int(v)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per method (0: torch's default); 1 on a shared machine")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    parser.add_argument("--cases", default="", help="comma-separated TxV, e.g. 4096x32000 (default: the two cases)")
    parser.add_argument("--child", nargs=6, metavar=("METHOD", "KIND", "T", "V", "REPEAT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one method in this process: its Result as the last line of JSON
        method, kind, *numbers = args.child
        print(json.dumps(_child(method, kind, *(int(n) for n in numbers)).__dict__))
        return 0
    methods, kinds = args.methods.split(","), args.kinds.split(",")
    for given, known, what in ((methods, METHODS, "method"), (kinds, KINDS, "kind")):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {what} {unknown[0]!r}; one of {', '.join(known)}")
    cases = [_case(c) for c in args.cases.split(",") if c] or None
    report(run(args.quick, args.threads, kinds, methods, cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
