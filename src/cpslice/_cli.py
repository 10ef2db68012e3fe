"""The ``cpslice`` command line (also ``python -m cpslice``).

A subcommand is one function that adds its arguments, one that runs it, and one
entry in ``SUBCOMMANDS``. A subcommand that needs heavy or optional imports
(megatron-core, torch.distributed) imports them inside its run function, so that
``cpslice plan`` never loads them.

Every mistake in the arguments, argparse's or a ``LayoutError`` from the library,
ends in one line ``cpslice <subcommand>: error: <problem>`` on stderr and exit
status 2, never a traceback.
"""

import argparse
import contextlib
import importlib
import io
import itertools
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal, NamedTuple, NoReturn, cast

import torch

from . import __version__
from ._errors import LayoutError
from ._extract import extraction_strategy
from ._layout import Layout
from ._plan import default_length, needed_length, runs, selection
from ._types import CpMode, QkvFormat

EXIT_USAGE = 2
EXIT_FAILURE = 1

MAX_PLAN_CP_SIZE = 1024
"""``cpslice plan`` draws every rank; a CP size beyond any real setup is refused."""

# The API's argument names in a LayoutError from plan, and plan's flags for them.
_FLAGS = {
    "total_lengths": "--total",
    "response_lengths": "--response",
    "cp_size": "--cp-size",
    "cp_mode": "--mode",
    "qkv_format": "--format",
    "max_seq_len": "--max-seq-len",
    "local_length": "--local-length",
    "padded_lengths": "--padded-lengths",
    "align": "--align",
}
_API_NAMES = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")


_FLAG_VALUE = re.compile(r"(--[a-z-]+)=(?:'([^']*)'|(\d+))")


def _flag_names(message: str) -> str:
    """``message`` with the API's argument names replaced by plan's flags, and
    ``name='value'`` advice written as ``--flag value``."""
    flags = _API_NAMES.sub(lambda m: _FLAGS[m.group(1)], message)
    return _FLAG_VALUE.sub(lambda m: f"{m.group(1)} {m.group(2) or m.group(3)}", flags)

Colour = Literal["auto", "always", "never"]


def _one_line(prog: str, message: str) -> None:
    text = " ".join(message.splitlines())
    sys.stderr.write(f"{prog}: error: {text}\n")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        _one_line(self.prog, message)
        raise SystemExit(EXIT_USAGE)


class Subcommand(NamedTuple):
    """One ``cpslice`` subcommand: its help line, its arguments and its body."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------
# cpslice plan


def _lengths(text: str) -> tuple[int, ...]:
    """``"10,7,13"`` -> ``(10, 7, 13)``; the rules on the values are Layout's."""
    items = [item.strip() for item in text.split(",")]
    try:
        return tuple(int(item) for item in items)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints, one per sample (e.g. 10,7,13)"
        ) from None


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--total", type=_lengths, required=True, metavar="L0,L1,...",
        help="total length (prompt + response tokens) of each sample",
    )
    parser.add_argument(
        "--response", type=_lengths, required=True, metavar="R0,R1,...",
        help="response length of each sample",
    )
    parser.add_argument(
        "--cp-size", type=int, default=1, metavar="C", help="context-parallel size (default 1)"
    )
    parser.add_argument(
        "--mode", choices=("none", "zigzag", "allgather"), default="none",
        help="context-parallel layout (default none)",
    )
    parser.add_argument(
        "--format", choices=("thd", "bshd"), default="thd",
        help="thd: samples packed back to back; bshd: rows of --max-seq-len (default thd)",
    )
    parser.add_argument(
        "--max-seq-len", type=int, default=None, metavar="S", help="bshd row length"
    )
    parser.add_argument(
        "--local-length", type=int, default=None, metavar="T",
        help="length of each rank's local tensor (default: the least that fits)",
    )
    parser.add_argument(
        "--align", type=int, default=None, metavar="N",
        help="thd: pad every sample on the right to a multiple of N (verl, Megatron-Bridge: "
        "tp * cp * 2 under CP); under zigzag a multiple of 2 * cp-size",
    )
    parser.add_argument(
        "--padded-lengths", type=_lengths, default=None, metavar="W0,W1,...",
        help="thd: the positions W_i >= L_i each sample occupies, its padding included "
        "(the differences of cu_seqlens_padded)",
    )
    parser.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto",
        help="colour the pictures: auto (a terminal, and NO_COLOR unset), always, never",
    )


def _range(lo: int, hi: int) -> str:
    return f"[{lo}, {hi})"


def _paint(text: str, colour: bool) -> str:
    if not colour:
        return text
    out = []
    for glyph, group in itertools.groupby(text):
        run = "".join(group)
        code = _ANSI.get(glyph)
        out.append(f"\x1b[{code}m{run}\x1b[0m" if code else run)
    return "".join(out)


# Row codes of a picture: 0 padding, 1 prompt token, 2 response token; +2 when the
# row's logit is in the response span (extracted on that rank).
_GLYPHS = ".prPR"
_ANSI = {".": "2", "p": "34", "r": "32", "P": "1;7;34", "R": "1;7;32"}
# A longer picture is run-length coded: "p5" is five prompt rows.
_FULL_PICTURE_MAX = 120

_COMPACT_NOTE = "        pictures over {} rows are run-length coded: p5 is five p rows"


def _legend(colour: bool) -> list[str]:
    p, r, pad, big_p, big_r = (_paint(glyph, colour) for glyph in "pr.PR")
    first = (
        f"legend: {p} prompt token, {r} response token, {pad} padding; {big_p}, {big_r}: "
        "that token's logit is in the response span, so that rank extracts it"
    )
    second = (
        "        (response span of sample i: the logits [P_i - 1, L_i - 1) that predict "
        "its response); '|' separates samples, ' ' a sample's runs"
    )
    return [first, second]


def _picture_rows(layout: Layout, length: int) -> str:
    """One glyph per local row (``_GLYPHS``), read from the layout's selections."""
    codes = torch.zeros(length, dtype=torch.int64)
    tokens = selection(layout, length, "sample")
    sample_of = torch.repeat_interleave(
        torch.arange(layout.num_samples), torch.tensor(tokens.counts, dtype=torch.int64)
    )
    prompt = torch.tensor(layout.prompt_lengths, dtype=torch.int64)[sample_of]
    codes[tokens.rows] = 1 + (tokens.positions >= prompt).to(torch.int64)
    codes[selection(layout, length, "response").rows] += 2
    values: list[int] = codes.tolist()
    return "".join(_GLYPHS[v] for v in values)


class _Slot(NamedTuple):
    """Rows ``[local, local + width)`` of one sample's run: the first ``size`` hold
    positions ``[start, start + size)``, the rest that run's padding."""

    sample: int
    local: int
    start: int
    size: int
    width: int


def _slots(layout: Layout, length: int) -> list[_Slot]:
    rs = runs(layout, length)
    local: list[int] = rs.local.tolist()
    start: list[int] = rs.start.tolist()
    size: list[int] = rs.length.tolist()
    width: list[int] = rs.width.tolist()
    return [
        _Slot(j // rs.k, local[j], start[j], size[j], width[j]) for j in range(len(local))
    ]


def _picture(layout: Layout, length: int, slots: list[_Slot], colour: bool) -> str:
    rows = _picture_rows(layout, length)
    pieces: list[tuple[int | None, int, int]] = []
    cursor = 0
    for s in slots:
        if s.width == 0:
            continue
        if s.local > cursor:
            pieces.append((None, cursor, s.local))
        pieces.append((s.sample, s.local, s.local + s.width))
        cursor = s.local + s.width
    if cursor < length:
        pieces.append((None, cursor, length))
    compact = length > _FULL_PICTURE_MAX
    out = []
    for i, (sample, lo, hi) in enumerate(pieces):
        if i:
            out.append(" " if sample is not None and sample == pieces[i - 1][0] else "|")
        text = rows[lo:hi]
        if compact:
            text = "".join(f"{g}{len(list(run))}" for g, run in itertools.groupby(text))
        out.append(_paint(text, colour))
    return "".join(out)


def _held(slots: list[_Slot]) -> str:
    parts = []
    for s in slots:
        if s.size:
            parts.append(
                f"positions {_range(s.start, s.start + s.size)} at local "
                f"{_range(s.local, s.local + s.size)}"
            )
        if s.width > s.size:
            parts.append(
                f"padding {_range(s.start + s.size, s.start + s.width)} at local "
                f"{_range(s.local + s.size, s.local + s.width)}"
            )
    return "holds " + " + ".join(parts) if parts else "holds nothing"


def _shares(layout: Layout, length: int) -> list[str]:
    """Per sample, the local rows and positions of its share of the response span."""
    sel = selection(layout, length, "response")
    counts: list[int] = sel.run_count.tolist()
    rows = torch.split(sel.rows, counts)
    positions = torch.split(sel.positions, counts)
    out = []
    for i, r in enumerate(layout.response_lengths):
        runs_of = [j for j in range(i * sel.k, (i + 1) * sel.k) if counts[j]]
        if not runs_of:
            out.append("response share none")
            continue
        local = " + ".join(
            _range(int(rows[j][0]), int(rows[j][-1]) + 1) for j in runs_of
        )
        held = " + ".join(
            _range(int(positions[j][0]), int(positions[j][-1]) + 1) for j in runs_of
        )
        out.append(
            f"response share local {local}, positions {held} ({sel.counts[i]} of {r})"
        )
    return out


def _spans(total: tuple[int, ...], response: tuple[int, ...]) -> list[str]:
    """Each sample's response span, as cp none extracts it."""
    whole = Layout(total, response)
    sel = selection(whole, needed_length(whole), "response")
    out = []
    for piece in torch.split(sel.positions, sel.counts):
        out.append(_range(int(piece[0]), int(piece[-1]) + 1) if piece.numel() else "empty")
    return out


def _rank_block(layout: Layout, length: int, colour: bool) -> list[str]:
    """What one rank holds: its picture, then per sample its positions and its share."""
    slots = _slots(layout, length)
    strategy = extraction_strategy(layout)
    lines = [
        f"rank {layout.cp_rank} of {layout.cp_size}: T = {length}, strategy {strategy}",
        "  " + _picture(layout, length, slots, colour),
    ]
    for i, share in enumerate(_shares(layout, length)):
        lines.append(f"  sample {i}: {_held([s for s in slots if s.sample == i])}")
        lines.append(f"  sample {i}: {share}")
    tail = max((s.local + s.width for s in slots if s.width), default=0)
    if tail < length:
        lines.append(f"  padding at local {_range(tail, length)}")
    return lines


def _use_colour(choice: Colour) -> bool:
    """``--color``; for auto: off with NO_COLOR (https://no-color.org), on with
    FORCE_COLOR (https://force-color.org), each when set to anything but ""; else on
    for a terminal other than TERM=dumb."""
    if choice != "auto":
        return choice == "always"
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


def _plan(args: argparse.Namespace) -> int:
    """Print, for every rank, what it holds of each sample and its response share.

    Every offset is read from ``_plan`` (runs and selections); none is computed here.
    """
    total = cast(tuple[int, ...], args.total)
    response = cast(tuple[int, ...], args.response)
    cp_size = cast(int, args.cp_size)
    qkv_format = cast(QkvFormat, args.format)
    max_seq_len = cast("int | None", args.max_seq_len)
    cp_mode = cast(CpMode, args.mode)
    given = cast("int | None", args.local_length)
    align = cast("int | None", args.align)
    padded = cast("tuple[int, ...] | None", args.padded_lengths)
    colour = _use_colour(cast(Colour, args.color))
    if cp_size > MAX_PLAN_CP_SIZE:
        raise LayoutError(
            f"--cp-size {cp_size} > {MAX_PLAN_CP_SIZE}: plan draws every rank, and no real "
            f"setup has more than {MAX_PLAN_CP_SIZE} context-parallel ranks"
        )

    def layout(rank: int, local_length: int | None) -> Layout:
        return Layout(
            total,
            response,
            qkv_format=qkv_format,
            max_seq_len=max_seq_len,
            cp_mode=cp_mode,
            cp_rank=rank,
            cp_size=cp_size,
            local_length=local_length,
            padded_lengths=padded,
            align=align,
        )

    try:
        first = layout(0, given)
        # An allgather layout without a local length has no pieces yet: take the least.
        length = default_length(first)
    except LayoutError as err:  # name the flags the user typed, not the API's arguments
        raise LayoutError(_flag_names(str(err))) from None
    how = "the least that fits" if given is None else "given"
    strategy = extraction_strategy(first)
    seq = f", max_seq_len {first.max_seq_len}" if first.max_seq_len is not None else ""
    if align is not None:
        seq += f", align {align}"
    elif padded is not None:
        seq += ", padded lengths given"
    n = first.num_samples
    header = (
        f"cpslice plan: {n} sample{'s' if n != 1 else ''}, cp_mode {first.cp_mode}, "
        f"cp_size {cp_size}, qkv_format {first.qkv_format}{seq}, strategy {strategy}, "
        f"local length T = {length} ({how})"
    )
    lines = [header]
    for i, (t, r, p, span, w) in enumerate(
        zip(total, response, first.prompt_lengths, _spans(total, response),
            first.padded_lengths)
    ):
        tokens = _range(p, t) if r else "none"
        width = f", padded to W {w}" if align is not None or padded is not None else ""
        lines.append(
            f"sample {i}: L {t} = prompt {p} + response {r}{width}; prompt tokens "
            f"{_range(0, p)}, response tokens {tokens}, response span {span}"
        )
    lines += _legend(colour)
    if length > _FULL_PICTURE_MAX:
        lines.append(_COMPACT_NOTE.format(_FULL_PICTURE_MAX))
    for rank in range(cp_size):
        lines += ["", *_rank_block(layout(rank, length), length, colour)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


# ---------------------------------------------------------------------------
# cpslice verify


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int >= {minimum}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    # no megatron-core: that is the ranks'
    from ._verify import DEFAULT_STARTUP_TIMEOUT, DEFAULT_TIMEOUT, TOLERANCE

    parser.epilog = (
        "A layout passes when its log-probs, entropy and logits' gradient are each within "
        f"{TOLERANCE:g} (absolute) of float64 torch.log_softmax on every rank. Exit status: 0 when "
        "every layout passes; 1 when one fails, or a rank raises, dies, does not start "
        "within --startup-timeout or makes no progress for --timeout, or megatron-core "
        "is not installed; 2 on bad arguments; 130 on Ctrl-C."
    )
    parser.add_argument(
        "--cp-size", type=_count(1), default=2, metavar="N",
        help="context-parallel size (default 2)",
    )
    parser.add_argument(
        "--tp-size", type=_count(1), default=2, metavar="M",
        help="tensor-parallel size: the vocabulary is split over M ranks (default 2); "
        "N x M processes are spawned",
    )
    parser.add_argument(
        "--mode", choices=("zigzag", "allgather", "none", "all"), default="all",
        help="layouts to check (default all: zigzag and allgather with --cp-size > 1, "
        "none and allgather at --cp-size 1). none is the layout without context "
        "parallelism, so it needs --cp-size 1; zigzag needs --cp-size 2 or more",
    )
    parser.add_argument(
        "--format", choices=("thd", "bshd"), default=None,
        help="qkv format to check (default: every format the mode has; allgather is thd only)",
    )
    parser.add_argument(
        "--align", type=_count(1), default=None, metavar="N",
        help="also check every thd layout with each sample padded to a multiple of N "
        "(verl, Megatron-Bridge: tp * cp * 2); under zigzag a multiple of 2 * --cp-size "
        "(default: one extra layout, allgather thd with align 4 * --cp-size)",
    )
    parser.add_argument(
        "--samples", type=_count(1), default=16, metavar="K",
        help="random samples per layout, edge cases first (default 16)",
    )
    parser.add_argument(
        "--seed", type=_count(0), default=0, metavar="S", help="random seed (default 0)"
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SEC",
        help=f"once the ranks have started, fail as a hang (and kill them) when none "
        f"finishes a layout for SEC seconds (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--startup-timeout", type=_seconds, default=DEFAULT_STARTUP_TIMEOUT, metavar="SEC",
        help="fail when the ranks have not all spawned, imported megatron-core and joined "
        f"the group within SEC seconds (default {DEFAULT_STARTUP_TIMEOUT:g})",
    )
    parser.add_argument(
        "--compile", action="store_true",
        help="run the log-prob kernels compiled by torch.compile on every rank "
        "(CPSLICE_COMPILE=1; the first compile takes a while)",
    )


def _verify(args: argparse.Namespace) -> int:
    """Check every asked layout end to end on spawned gloo ranks (``_verify``)."""
    from . import _verify as verify

    cp_size = cast(int, args.cp_size)
    tp_size = cast(int, args.tp_size)
    try:
        verify.check_sizes(cp_size, tp_size)
        cases = verify.select_cases(
            cp_size, cast(str, args.mode), cast("str | None", args.format),
            cast("int | None", args.align),
        )
    except verify.VerifyArgumentError as err:
        _one_line("cpslice verify", str(err))
        return EXIT_USAGE
    config = verify.Config(
        cp_size, tp_size, cases, samples=cast(int, args.samples), seed=cast(int, args.seed),
        timeout=cast(float, args.timeout), startup_timeout=cast(float, args.startup_timeout),
        compile=cast(bool, args.compile),
    )
    try:
        return verify.verify_main(config)
    except ImportError as err:  # megatron-core missing: not a usage error
        _one_line("cpslice verify", str(err))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        sys.stderr.write("cpslice verify: interrupted\n")
        return 130


# ---------------------------------------------------------------------------
# cpslice bench

# The repository root when cpslice runs from a source checkout (src/cpslice/_cli.py).
_SOURCE_ROOT = Path(__file__).resolve().parents[2]

_BENCHMARKS = (
    ("bench_extract", "extraction: cpslice against the per-sample loop and the bare-gather floor"),
    ("bench_logprob", "log-probs + entropy: peak memory and time against naive and save-softmax"),
    ("bench_redistribute", "redistribute against the zero-padded all_reduce, cp 4 on gloo"),
    ("bench_sample_means", "sample_means against per-sample all-gathers and gather_responses"),
)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: under a minute on two cores"
    )


def _bench_report(module: ModuleType, quick: bool) -> str:
    """``module.run(quick)`` then ``module.report(rows)``: its returned text, or what it
    printed (bench_logprob's report prints through ``say``)."""
    run = cast(Callable[[bool], object], module.run)
    report = cast(Callable[[object], object], module.report)
    rows = run(quick)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = report(rows)
    return text if isinstance(text, str) else printed.getvalue().rstrip("\n")


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmarks of the source checkout's ``benchmarks/`` as one report."""
    quick = cast(bool, args.quick)
    folder = _SOURCE_ROOT / "benchmarks"
    missing = [name for name, _ in _BENCHMARKS if not (folder / f"{name}.py").is_file()]
    if missing:  # not a usage error: nothing to run in this installation
        _one_line(
            "cpslice bench",
            f"bench needs a source checkout: no {missing[0]}.py in {folder} (cpslice is "
            "installed without its benchmarks/ folder); clone the repository and "
            "pip install -e . there",
        )
        return EXIT_FAILURE
    if str(_SOURCE_ROOT) not in sys.path:
        sys.path.insert(0, str(_SOURCE_ROOT))
    sys.stdout.write(f"cpslice bench{' --quick' if quick else ''}: {len(_BENCHMARKS)} benchmarks "
                     f"from {folder}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    failed = 0
    for name, title in _BENCHMARKS:
        sys.stdout.write(f"\n== {title} ({name}) ==\n")
        sys.stdout.flush()
        start = time.perf_counter()
        try:
            text = _bench_report(importlib.import_module(f"benchmarks.{name}"), quick)
        except Exception:  # noqa: BLE001 - reported, and the other benchmarks still run
            failed += 1
            sys.stdout.write("failed; its traceback is on stderr\n")
            sys.stderr.write(f"cpslice bench: {name} failed:\n{traceback.format_exc()}")
            continue
        sys.stdout.write(f"{text}\n({time.perf_counter() - start:.1f} s)\n")
        sys.stdout.flush()
    if failed:
        sys.stdout.write(f"\n{failed} of {len(_BENCHMARKS)} benchmarks failed\n")
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# The registry and the entry point.

SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": Subcommand(
        "draw what each context-parallel rank holds of each sample, and its response share",
        _plan_arguments,
        _plan,
    ),
    "verify": Subcommand(
        "check every layout end to end on spawned gloo ranks with megatron-core's "
        "parallel_state (CP x TP) against a float64 reference",
        _verify_arguments,
        _verify,
    ),
    "bench": Subcommand(
        "run the benchmarks (extraction, log-probs, redistribute) as one report; "
        "needs a source checkout",
        _bench_arguments,
        _bench,
    ),
}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser: argparse.ArgumentParser = _Parser(
        prog="cpslice",
        description="Inspect packed, context-parallel layouts of response-aligned tensors.",
    )
    parser.add_argument("--version", action="version", version=f"cpslice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, command in SUBCOMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(child)
        parsers[name] = child
    return parser, parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cpslice`` on ``argv`` (default ``sys.argv[1:]``); return the exit status.

    0 on success, 2 on bad arguments (one line on stderr, no traceback), 1 when
    the reader of stdout goes away early.
    """
    parser, parsers = _parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the subcommand: `cpslice plan: error: ...`
            parsers[cast(str, args.command)].error(
                f"unrecognized arguments: {' '.join(unknown)}"
            )
    except SystemExit as stop:  # --help, or an argument error already reported
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    name = cast(str, args.command)
    try:
        return SUBCOMMANDS[name].run(args)
    except LayoutError as err:
        _one_line(parsers[name].prog, str(err))
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader left early (`cpslice plan ... | head`): stop quietly, and keep
        # the interpreter's final flush from raising again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
