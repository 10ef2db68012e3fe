"""Bugs planted in copies of the package, and the ``cpslice verify`` runs that must catch
them (``tests/cli/test_verify_planted.py``), with the reading of verify's result table.

The runs take most of a minute of both cores (each spawns ranks that import torch and
megatron-core), so they are background jobs (``background.py``), started when the
session's tests are collected: they run beside the other tests, and the planted
tests, collected last, wait for them. Run alone, the first planted test starts them."""

import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import cpslice

from . import background
from .background import Done, Job


class Plant(NamedTuple):
    """A bug planted in a copy of the package, and the verify run that must catch it."""

    edits: tuple[tuple[str, str, str], ...]  # (file under cpslice/, line, planted line)
    argv: tuple[str, ...]  # cpslice verify's arguments: the fewest layouts that show it


PLANTS = {
    # zigzag rank r holds chunks r and 2c-1-r; plant 2c-2-r. pack, extraction and
    # shard_responses all read the same wrong plan, so only expected values computed
    # independently of _plan (the verifier's oracle) can catch it.
    "zigzag chunk": Plant(
        (("_layout/pieces.py", "(2 * c - 1 - r) * chunk", "(2 * c - 2 - r) * chunk"),),
        ("--cp-size", "2", "--mode", "zigzag", "--format", "thd"),
    ),
    # redistribute cuts the allgather pieces at the least local length, not the tensor's
    "redistribute reads the least length": Plant(
        (("_layout/redistribute.py", "from .plan import resolve, response_base, select, selection_at",
          "from .plan import needed_length, resolve, response_base, select, selection_at"),
         ("_layout/redistribute.py",
          "route = _device_route(src, src_length, dst, dst_length, size, nlists, stacked.device, d)",
          "route = _device_route(src, needed_length(src), dst, needed_length(dst), size, nlists, stacked.device, d)")),
        ("--cp-size", "2", "--mode", "allgather"),
    ),
    # every sample one position wider than its cu_seqlens_padded say; and, in the same
    # run, a shared prefix's prompt row whose gradient is its first branch's alone (the
    # other branches' log-probs detached there): the log-probs stay right, so only the
    # verifier's gradient rows, a shared row's summed over the branches, catch it
    "from_cu_seqlens widths off by one, a shared row's gradient not summed": Plant(
        (("_layout/checks.py", "widths = tuple(b - a for a, b in zip(bounds, bounds[1:]))",
          "widths = tuple(b - a + 1 for a, b in zip(bounds, bounds[1:]))"),
         ("_layout/extract.py", "        return values[at, p.slot]",
          "        return torch.where(p.slot == 0, values[at, p.slot], values[at, p.slot].detach())")),
        ("--cp-size", "2", "--format", "thd"),
    ),
    # bshd rows without CP rounded up to an even width (only zigzag rounds them); and,
    # in the same run (each run costs a start-up), the row offsets left out of _plan's
    # runs: every bshd sample at column 0, consistently in pack and extraction; and a
    # bshd order read with each rank's columns strided (rank r holding columns
    # order[b, r::c], not order[b, r*S/c:(r+1)*S/c]): still a permutation, read alike by
    # every function, so only the oracle's own reading of the order catches it
    "bshd rows: no-CP rounded to even, row offsets ignored, an order's columns strided": Plant(
        (("_layout/widths.py", '        step = 2 * cp_size if mode == "zigzag" else 1\n        return (',
          '        step = 2 * cp_size if mode == "zigzag" else 2\n        return ('),
         ("_layout/plan.py", "    offset = torch.tensor(layout.row_offsets, dtype=_I64)[p.sample]",
          "    offset = 0 * torch.tensor(layout.row_offsets, dtype=_I64)[p.sample]"),
         ("_layout/pieces.py", "(order + starts[:, None]).view(rows, size, seq // size).transpose(0, 1)",
          "(order + starts[:, None]).view(rows, seq // size, size).permute(2, 0, 1)")),
        ("--cp-size", "2", "--format", "bshd"),
    ),
}
"""Every planted run shares ``--tp-size 1 --samples 4``."""


def _patched_copy(folder: Path, edits: tuple[tuple[str, str, str], ...]) -> Path:
    """A copy of the cpslice package with lines changed (planted bugs); returns the
    folder to put on PYTHONPATH."""
    src = folder / "src"
    shutil.copytree(Path(cpslice.__file__).parent, src / "cpslice",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name, old, new in edits:
        path = src / "cpslice" / name
        text = path.read_text()
        assert text.count(old) == 1, f"the line to plant the bug in moved: {name}: {old!r}"
        path.write_text(text.replace(old, new))
    return src


def jobs() -> dict[str, Job]:
    """Each PLANTS run, as a background job (``background.py``) on its own copy."""
    found = {}
    for i, (name, plant) in enumerate(PLANTS.items()):
        copy = background.folder() / f"planted-{i}"
        env = {**os.environ, "PYTHONPATH": str(_patched_copy(copy, plant.edits))}
        argv = (sys.executable, "-m", "cpslice", "verify", *plant.argv, "--tp-size", "1",
                "--samples", "4", "--startup-timeout", "400", "--timeout", "400")
        found[name] = Job(argv, env, copy)
    return found


def results(timeout: float = 450) -> dict[str, Done]:
    """Each PLANTS run's ``Done``, once all have ended (started here if not yet)."""
    return background.result("planted", timeout)


background.register("planted", "tests/cli/test_verify_planted.py", jobs)


def rows(stdout: str) -> dict[str, list[str]]:
    """The result table: layout name -> its columns (ranks, samples, empty ranks, the
    five errors, result)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = {}
    for line in lines[head + 1 :]:
        if line.startswith("errors: "):
            break
        name, rest = line[: line.index("  ")], line[line.index("  ") :].split(maxsplit=10)
        rows[name] = [" ".join(rest[:3]), *rest[3:]]  # "2 x 1", samples, ..., result
    return rows


def verdicts(stdout: str) -> dict[str, str]:
    """Layout name -> pass, FAIL or not run (a FAIL's reason left out)."""
    return {name: r[-1].split("  ")[0] for name, r in rows(stdout).items()}
