"""What ``cpslice verify`` prints: the header before the run, a progress line per
finished layout (stderr), and the result table with its verdict (stdout).

A ``CaseResult`` is one layout's outcome over every rank; it passes when each of
its errors is within the tolerance (``check.max_error`` stands inf for NaN).
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .batches import TEMPERATURE, VOCAB_PER_RANK
from .cases import Case, Config
from .check import Errors


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


def header(config: Config) -> str:
    """What the run checks, before it starts."""
    sparse = (
        " + a few short ones that leave some CP ranks without a response"
        if config.cp_size > 1 else ""
    )
    return (
        f"cpslice verify: {plural(config.world, 'gloo process', 'gloo processes')} "
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


def plural(n: int, one: str, many: str | None = None) -> str:
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
        f"{plural(len(results), 'layout')}: all pass" if not failed
        else f"{failed} of {plural(len(results), 'layout')} FAIL"
    )
    return "\n".join(lines)


def say(line: str) -> None:
    """A line on stdout, flushed (the table)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """A line on stderr, flushed (progress)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
