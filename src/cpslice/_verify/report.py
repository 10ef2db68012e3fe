"""What ``cpslice verify`` prints: the header before the run, a progress line per
finished layout (stderr), and the result table with its verdict (stdout).

A ``CaseResult`` is one layout's outcome over every rank; it passes when each of
its errors is within the tolerance (``check.max_error`` stands inf for NaN). A layout
the run broke in (a rank raised, died or hung) is a FAIL with its reason, and the
layouts after it are "not run": they have no errors.
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .batches import BLOCK, TEMPERATURE, VOCAB_PER_RANK
from .cases import Case, Config
from .check import Errors


@dataclass(frozen=True)
class CaseResult:
    """One layout's outcome over every rank."""

    case: Case
    cp_size: int
    tp_size: int
    samples: int
    empty_ranks: int | None  # (batch, CP rank) pairs in which that rank held no response
    errors: Errors | None  # None: the layout did not finish
    tolerance: float
    seconds: float
    failure: str | None = None  # why the run broke in this layout (one line)

    @property
    def passed(self) -> bool:
        # NaN-free: max_error stands inf for it; invariance passes at 0 only (the same bits)
        return (self.errors is not None and all(e <= self.tolerance for e in self.errors)
                and self.errors.invariance == 0.0)

    @property
    def ran(self) -> bool:
        """Whether the layout finished, or the run broke in it."""
        return self.errors is not None or self.failure is not None

    @property
    def verdict(self) -> str:
        """``pass``, ``FAIL``, ``FAIL  <why the run broke here>`` or ``not run``."""
        if self.failure is not None:
            return f"FAIL  {self.failure}"
        if self.errors is None:
            return "not run"
        return "pass" if self.passed else "FAIL"


def header(config: Config) -> str:
    """What the run checks, before it starts."""
    sparse = (
        " + a few short ones that leave some CP ranks without a response"
        if config.cp_size > 1 else ""
    )
    kinds = ""
    if any(c.shared for c in config.cases):
        kinds += ("  shared-prefix: groups of samples with one prompt, each packed once as a star "
                  "with its responses after it (shared_prefix=), empty and single-token "
                  "responses, stars shorter than 2*cp; the prompt's last row predicts each "
                  "branch's first token, its gradient the sum over them;\n")
    if any(c.padded for c in config.cases):
        kinds += ("  padded: each sample its own width W_i >= L_i (Layout.from_cu_seqlens), "
                  "some several chunks longer than needed, the last one stretched;\n")
    if any(c.left_padded for c in config.cases):
        kinds += ("  left-padded: bshd rows as Hugging Face trainers hold them, each prompt "
                  "left-padded to the longest, its response after it, one sample ending at "
                  "its row's last column (Layout.from_attention_mask);\n")
    kinds += _order_kinds(config)
    if any(c.mode == "none" and c.fmt == "bshd" and not c.left_padded for c in config.cases):
        where = ", without CP on every CP rank (each holds the whole batch)"
        kinds += f"  none bshd: rows of odd length{where if config.cp_size > 1 else ''};\n"
    return (
        f"cpslice verify: {plural(config.world, 'gloo process', 'gloo processes')} "
        f"(cp {config.cp_size} x "
        f"tp {config.tp_size}) with megatron-core parallel_state; vocabulary "
        f"{VOCAB_PER_RANK * config.tp_size} ({VOCAB_PER_RANK} per TP rank), temperature "
        f"{TEMPERATURE}, seed {config.seed}\n"
        f"  each layout: {config.samples} random samples (single tokens, empty responses, "
        f"shorter than 2*cp, responses across chunk and rank boundaries){sparse};\n"
        f"{kinds}"
        "  log-probs, entropy and the logits' gradient of a weighted loss against "
        "float64 torch.log_softmax; the same under per-token top-p sets (Support) and as "
        "the divergence from a teacher's top-k (response_distillation); and invariant=True "
        "(each rank's 8 ids widened to a 128-id tile) against one call at TP 1 without a layout"
        + ("\n  log-prob kernels compiled by torch.compile (CPSLICE_BACKEND=compiled)" if config.compile else "")
    )


def _order_kinds(config: Config) -> str:
    """The header's line on the order layouts, if the run has any."""
    said = {"random": "a random permutation", "block": f"shuffled blocks of {BLOCK} positions",
            "per-document head-tail": "torch's per-document head-tail index (its private "
            "_PerDocumentHeadTailLoadBalancer)"}
    kinds = list(dict.fromkeys(said[c.order] for c in config.cases if c.order is not None))
    if not kinds:
        return ""
    what = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
    return f"  order: Layout.from_order of {what}, the shares redistributed to zigzag;\n"


def progress_line(result: CaseResult, width: int) -> str:
    """One line per finished layout, its name padded to ``width`` (the run's longest: the
    verdicts in one column)."""
    return f"  {result.case.name:<{width}} {result.verdict}  ({result.seconds:.2f} s)"


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _fmt(error: float | None) -> str:
    return "-" if error is None else "0" if error == 0.0 else f"{error:.1e}"


def table(results: Sequence[CaseResult], tolerance: float) -> str:
    """The result table, its tolerance, and the verdict."""
    width = max([15, *(len(r.case.name) + 1 for r in results)])
    head = (
        f"{'layout':<{width}}{'ranks (cp x tp)':>16}{'samples':>9}{'empty ranks':>13}"
        f"{'log-prob err':>14}{'entropy err':>13}{'grad err':>10}{'distill err':>13}{'invariance':>12}  result"
    )
    lines = [head]
    for r in results:
        lp, ent, grad, distill, inv = (None,) * 5 if r.errors is None else r.errors
        empty = "-" if r.empty_ranks is None else r.empty_ranks
        lines.append(
            f"{r.case.name:<{width}}{f'{r.cp_size} x {r.tp_size}':>16}{r.samples:>9}"
            f"{empty:>13}{_fmt(lp):>14}{_fmt(ent):>13}{_fmt(grad):>10}{_fmt(distill):>13}{_fmt(inv):>12}"
            f"  {r.verdict}"
        )
    failed = sum(r.ran and not r.passed for r in results)
    not_run = sum(not r.ran for r in results)
    lines.append(
        f"errors: largest absolute difference on any rank; pass when each is <= "
        f"{tolerance:g} (float32 log-probs reach about -20 here)"
    )
    lines.append(
        "empty ranks: (batch, CP rank) pairs where that rank held no response, yet "
        "entered every collective"
    )
    lines.append(
        "invariance: invariant=True log-probs, entropy and gradient here against decode time "
        "(TP 1, no layout); pass at 0 only, the same bits"
    )
    if not failed and not not_run:
        lines.append(f"{plural(len(results), 'layout')}: all pass")
    else:
        lines.append(f"{failed} of {plural(len(results), 'layout')} FAIL"
                     + (f", {not_run} not run" if not_run else ""))
    return "\n".join(lines)


def say(line: str) -> None:
    """A line on stdout, flushed (the table)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """A line on stderr, flushed (progress)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
