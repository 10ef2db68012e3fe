"""Replacement rank entries for testing ``cpslice verify`` itself (``_probe.substitute("rank_main", ...)``).

Module-level, so that spawned ranks can import them. Each wraps or replaces
``cpslice._verify.rank.rank_main``; the library itself carries no fault injection.
"""

import time

from cpslice._verify import check
from cpslice._verify.cases import Case, Config
from cpslice._verify.rank import Outbox, Report, rank_main


def rank_1_raises_on_bshd(rank: int, port: int, config: Config, out: Outbox) -> None:
    """Rank 1 raises in the first layout with bshd rows while the others go on into
    its collectives."""
    real = check.check_batch

    def check_batch(case: Case, *args: object, **kwargs: object) -> object:
        if rank == 1 and case.fmt == "bshd":
            raise RuntimeError("fault injected: rank 1 raises")
        return real(case, *args, **kwargs)  # type: ignore[arg-type]

    check.check_batch = check_batch  # type: ignore[assignment]
    rank_main(rank, port, config, out)


def ready_then_stall(rank: int, port: int, config: Config, out: Outbox) -> None:
    """Says it started, rank 0 finishes the first layout, then nothing more (a hang).
    No gloo and no megatron-core: this checks the parent's clock only."""
    out.put(Report(rank, rank, -1, None, (), None))
    if rank == 0:
        out.put(Report(rank, rank, 0, check.Errors(0.0, 0.0, 0.0, 0.0, 0.0), (False,), None))
    time.sleep(600)


def never_start(rank: int, port: int, config: Config, out: Outbox) -> None:
    """Spawned, but never says it is ready (a start-up that takes too long)."""
    time.sleep(600)
