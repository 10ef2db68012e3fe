"""``cpslice plan``: draw what each context-parallel rank holds of each sample, and
its response share.

Every offset is read from ``_layout.plan`` (runs and selections); none is computed here.
A ``LayoutError`` names the flags the user typed (``--cp-size``), not the API's
argument names (``cp_size``).
"""

import argparse
import itertools
import os
import re
import sys
from collections.abc import Callable
from typing import Literal, NamedTuple, cast

import torch
from torch import Tensor

from .._errors import LayoutError
from .._layout.extract import extraction_strategy
from .._layout.layout import Layout
from .._layout.plan import default_length, needed_length, runs, selection, selection_at
from .._types import CpMode, QkvFormat
from .args import EXIT_FAILURE, Subcommand, one_line
from .balancers import TorchBalancerMissing
from .order import add_order_arguments, check_order_arguments, order_layout, order_line, source
from .stars import groups, star_layout, star_line, strips

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
    "row_offsets": "--row-offsets",
    "shared_prefix": "--shared-prefix",
}
_API_NAMES = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")
_FLAG_VALUE = re.compile(r"(--[a-z-]+)=(?:'([^']*)'|(\d+))")


def _flag_names(message: str) -> str:
    """``message`` with the API's argument names replaced by plan's flags, and
    ``name='value'`` advice written as ``--flag value``."""
    flags = _API_NAMES.sub(lambda m: _FLAGS[m.group(1)], message)
    return _FLAG_VALUE.sub(lambda m: f"{m.group(1)} {m.group(2) or m.group(3)}", flags)


Colour = Literal["auto", "always", "never"]


def _lengths(text: str, each: str = "one per sample (e.g. 10,7,13)") -> tuple[int, ...]:
    """``"10,7,13"`` -> ``(10, 7, 13)``; the rules on the values are Layout's."""
    items = [item.strip() for item in text.split(",")]
    try:
        return tuple(int(item) for item in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints, {each}") from None


def _group_sizes(text: str) -> tuple[int, ...]:
    """``--shared-prefix``: ``"4,1,3"`` -> ``(4, 1, 3)``, one size per group."""
    return _lengths(text, "one size per group (e.g. 4,1,3: the samples 0-3, 4 and 5-7)")


class _Valued(NamedTuple):
    """An optional flag that takes one value: ``--flag METAVAR``."""

    flag: str
    type: Callable[[str], int | tuple[int, ...]]
    metavar: str
    help: str
    default: int | None = None


_VALUED = (
    _Valued("--max-seq-len", int, "S", "bshd row length"),
    _Valued("--local-length", int, "T", "length of each rank's local tensor (default: the least that fits)"),
    _Valued("--align", int, "N", "thd: pad every sample on the right to a multiple of N (verl, Megatron-Bridge: "
            "tp * cp * 2 under CP); under zigzag a multiple of 2 * cp-size"),
    _Valued("--padded-lengths", _lengths, "W0,W1,...", "thd: the positions W_i >= L_i each sample occupies, its "
            "padding included (the differences of cu_seqlens_padded)"),
    _Valued("--row-offsets", _lengths, "O0,O1,...", "bshd: the column where each sample starts in its row, the "
            "columns before it padding (a left-padded prompt: Hugging Face trainers)"),
    _Valued("--shared-prefix", _group_sizes, "G0,G1,...", "thd: group sizes; the G_j consecutive samples of group "
            "j share one prompt, packed once as a star: the prompt, then each response (GRPO's G responses)"),
    _Valued("--depth", int, "D", "the shares at target depth D: position p predicts token p + 1 + D "
            "(multi-token prediction; default 0, the next token)", default=0),
)
"""plan's flags after ``--format`` that take one value, in ``--help``'s order."""


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
        "--mode", choices=("none", "zigzag", "allgather"), default=None,
        help="context-parallel layout (default none; not with --order or --balancer)",
    )
    parser.add_argument(
        "--format", choices=("thd", "bshd"), default="thd",
        help="thd: samples packed back to back; bshd: rows of --max-seq-len (default thd)",
    )
    for option in _VALUED:
        parser.add_argument(option.flag, type=option.type, default=option.default, metavar=option.metavar,
                            help=option.help)
    add_order_arguments(parser)
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

_ORDER_NOTE = "        an order's runs: in row order in the picture, in position order in the lines below"
_COMPACT_NOTE = "        pictures over {} rows are run-length coded: p5 is five p rows"


def _legend(colour: bool, depth: int, shared: bool) -> list[str]:
    p, r, pad, big_p, big_r = (_paint(glyph, colour) for glyph in "pr.PR")
    first = (
        f"legend: {p} prompt token, {r} response token, {pad} padding; {big_p}, {big_r}: "
        "that token's logit is in the response span, so that rank extracts it"
    )
    span, predicts = "[P_i - 1, L_i - 1)", "its response"
    if depth:
        span = f"[max(0, P_i - {1 + depth}), L_i - {1 + depth})"
        predicts = f"its response at depth {depth} (position p predicts token p + {1 + depth})"
    unit = "star" if shared else "sample"
    second = (
        f"        (response span of sample i: the logits {span} that predict "
        f"{predicts}); '|' separates {unit}s, ' ' a {unit}'s runs"
    )
    if not shared:
        return [first, second]
    third = (
        "        a star: a shared-prefix group's prompt once, then each sample's response; under "
        "the picture, a line per sample: its rows (upper case: its share), '-' another's"
    )
    return [first, second, third]


def _picture_rows(layout: Layout, length: int, depth: int) -> str:
    """One glyph per local row (``_GLYPHS``), read from the layout's selections."""
    codes = torch.zeros(length, dtype=torch.int64)
    tokens = selection(layout, length, "sample")
    sample_of = torch.repeat_interleave(
        torch.arange(layout.num_samples), torch.tensor(tokens.counts, dtype=torch.int64)
    )
    prompt = torch.tensor(layout.prompt_lengths, dtype=torch.int64)[sample_of]
    codes[tokens.rows] = 1 + (tokens.positions >= prompt).to(torch.int64)
    codes[selection_at(layout, length, "response", depth).rows] += 2
    values: list[int] = codes.tolist()
    return "".join(_GLYPHS[v] for v in values)


class _Slot(NamedTuple):
    """Rows ``[lo, lo + width)`` of one sample's run: ``lead`` rows of padding, then
    ``size`` rows holding positions ``[start, start + size)`` from row ``local``, then
    that run's padding."""

    sample: int
    local: int
    start: int
    size: int
    width: int
    lead: int

    @property
    def lo(self) -> int:
        return self.local - self.lead

    @property
    def hi(self) -> int:
        return self.local - self.lead + self.width


def _slots(layout: Layout, length: int) -> list[_Slot]:
    rs = runs(layout, length)
    columns: list[list[int]] = torch.stack(
        [rs.sample, rs.local, rs.start, rs.length, rs.width, rs.lead], 1
    ).tolist()
    return [_Slot(*run) for run in columns]


def _picture(rows: str, length: int, slots: list[_Slot], colour: bool) -> str:
    """The glyphs ``rows`` of the local rows, cut where the ``slots`` (runs) are."""
    pieces: list[tuple[int | None, int, int]] = []
    cursor = 0
    for s in sorted(slots, key=lambda s: s.lo):  # an order's runs: sample by sample, not row by row
        if s.width == 0:
            continue
        if s.lo > cursor:
            pieces.append((None, cursor, s.lo))
        pieces.append((s.sample, s.lo, s.hi))
        cursor = s.hi
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


def _held(slots: list[_Slot], what: str = "positions") -> str:
    parts = []
    for s in slots:
        if s.lead:
            parts.append(f"left padding at local {_range(s.lo, s.local)}")
        if s.size:
            parts.append(
                f"{what} {_range(s.start, s.start + s.size)} at local "
                f"{_range(s.local, s.local + s.size)}"
            )
        after = s.hi - s.local - s.size
        if after:
            parts.append(
                f"padding {_range(s.start + s.size, s.start + s.size + after)} at local "
                f"{_range(s.local + s.size, s.hi)}"
            )
    return "holds " + " + ".join(parts) if parts else "holds nothing"


def _shares(layout: Layout, length: int, depth: int, spans: list[int]) -> list[str]:
    """Per sample, the local rows and positions of its share of the response span (at
    ``depth``; ``spans[i]`` the span's length)."""
    sel = selection_at(layout, length, "response", depth)
    counts: list[int] = sel.run_count.tolist()
    rows = torch.split(sel.rows, counts)
    positions = torch.split(sel.positions, counts)
    out = []
    of_sample: list[list[int]] = [[] for _ in layout.response_lengths]
    for j, (i, count) in enumerate(zip(sel.run_sample.tolist(), counts)):
        if count:
            of_sample[i].append(j)
    for i, span in enumerate(spans):
        runs_of = of_sample[i]
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
            f"response share local {local}, positions {held} ({sel.counts[i]} of {span})"
        )
    return out


def _spans(total: tuple[int, ...], response: tuple[int, ...], depth: int) -> tuple[list[str], list[int]]:
    """Each sample's response span at ``depth``, as cp none extracts it, and its length."""
    whole = Layout(total, response)
    sel = selection_at(whole, needed_length(whole), "response", depth)
    out = []
    for piece in torch.split(sel.positions, sel.counts):
        out.append(_range(int(piece[0]), int(piece[-1]) + 1) if piece.numel() else "empty")
    return out, sel.counts


def _rank_block(
    layout: Layout, length: int, colour: bool, depth: int, stars: Layout | None, spans: list[int]
) -> list[str]:
    """What one rank holds: its picture (with a shared prefix, ``stars``: the stars as
    samples, and a line per sample), then per sample its positions and its share
    (``spans[i]``: the length of sample ``i``'s response span at ``depth``)."""
    own = _slots(layout, length)
    slots = own if stars is None else _slots(stars, length)
    rows = _picture_rows(layout, length, depth)
    strategy = extraction_strategy(layout)
    lines = [
        f"rank {layout.cp_rank} of {layout.cp_size}: T = {length}, strategy {strategy}",
        "  " + _picture(rows, length, slots, colour),
    ]
    if stars is not None:
        for i, strip in enumerate(strips(layout, length, depth, rows)):
            lines.append(f"  {_picture(strip, length, slots, colour)}  sample {i}")
    shares = _shares(layout, length, depth, spans)
    for j, group in enumerate(groups(layout)):
        if stars is not None:
            lines.append(f"  star {j}: {_held([s for s in slots if s.sample == j], 'star positions')}")
        for i in group:
            lines.append(f"  sample {i}: {_held([s for s in own if s.sample == i])}")
            lines.append(f"  sample {i}: {shares[i]}")
    tail = max((s.hi for s in slots if s.width), default=0)
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


def _first_layout(args: argparse.Namespace) -> tuple[Layout, Tensor | None]:
    """Rank 0's layout, with ``--local-length`` when given, and its order (for
    ``--order`` and ``--balancer``; else None).

    Raises:
        LayoutError: the arguments are no layout (named as the API names them).
        TorchBalancerMissing: ``--balancer``'s torch balancer moved.
    """
    problem = check_order_arguments(args)
    if problem is not None:
        raise LayoutError(problem)
    if args.depth < 0:
        raise LayoutError(f"--depth {args.depth} < 0 (at depth d the logit at position p "
                          "predicts token p + 1 + d; 0 is the next token)")
    given = cast("int | None", args.local_length)
    total, response = cast(tuple[int, ...], args.total), cast(tuple[int, ...], args.response)
    fmt, seq = cast(QkvFormat, args.format), cast("int | None", args.max_seq_len)
    padded = cast("tuple[int, ...] | None", args.padded_lengths)
    align = cast("int | None", args.align)
    offsets = cast("tuple[int, ...] | None", args.row_offsets)
    groups = cast("tuple[int, ...] | None", args.shared_prefix)
    if args.order is None and args.balancer is None:
        return Layout(
            total, response, qkv_format=fmt, max_seq_len=seq, cp_mode=cast(CpMode, args.mode or "none"),
            cp_rank=0, cp_size=cast(int, args.cp_size), local_length=given, padded_lengths=padded,
            align=align, row_offsets=offsets, shared_prefix=groups,
        ), None
    base = Layout(total, response, qkv_format=fmt, max_seq_len=seq, padded_lengths=padded,
                  align=align, row_offsets=offsets, shared_prefix=groups)
    return order_layout(args, base, given)


def _header(args: argparse.Namespace, first: Layout, length: int) -> str:
    how = "the least that fits" if args.local_length is None else "given"
    mode: str = first.cp_mode
    if args.order is not None or args.balancer is not None:
        alike = "" if mode == "order" else f", which places every position as {mode} does"
        mode = f"{mode} ({source(args)}{alike})"
    seq = f", max_seq_len {first.max_seq_len}" if first.max_seq_len is not None else ""
    if args.align is not None:
        seq += f", align {args.align}"
    elif args.padded_lengths is not None:
        seq += ", padded lengths given"
    if args.row_offsets is not None:
        seq += ", row offsets given"
    if first.shared_prefix is not None:
        seq += f", shared prefix {','.join(map(str, first.shared_prefix))}"
    if args.depth:
        seq += f", depth {args.depth}"
    n = first.num_samples
    return (
        f"cpslice plan: {n} sample{'s' if n != 1 else ''}, cp_mode {mode}, "
        f"cp_size {first.cp_size}, qkv_format {first.qkv_format}{seq}, strategy "
        f"{extraction_strategy(first)}, local length T = {length} ({how})"
    )


def _sample_lines(args: argparse.Namespace, first: Layout, spans: list[str]) -> list[str]:
    """Per sample, its lengths, its tokens and its response span (``spans``, from
    ``_spans``; with a shared prefix, each star's line before its samples')."""
    lines = []
    total, response = first.total_lengths, first.response_lengths
    padded = args.align is not None or args.padded_lengths is not None
    shared = first.shared_prefix is not None
    at = f" at depth {args.depth}" if args.depth else ""
    for j, group in enumerate(groups(first)):
        if shared:
            lines.append(star_line(first, j, group, padded))
        for i in group:
            t, r, p, o = total[i], response[i], first.prompt_lengths[i], first.row_offsets[i]
            tokens = _range(p, t) if r else "none"
            width = f", padded to W {first.padded_lengths[i]}" if padded and not shared else ""
            if args.row_offsets is not None:
                width += f", at columns {_range(o, o + t)} of its row"
            lines.append(
                f"sample {i}: L {t} = prompt {p} + response {r}{width}; prompt tokens "
                f"{_range(0, p)}, response tokens {tokens}, response span{at} {spans[i]}"
            )
    return lines


def _plan(args: argparse.Namespace) -> int:
    """Print, for every rank, what it holds of each sample and its response share."""
    cp_size = cast(int, args.cp_size)
    colour = _use_colour(cast(Colour, args.color))
    if cp_size > MAX_PLAN_CP_SIZE:
        raise LayoutError(
            f"--cp-size {cp_size} > {MAX_PLAN_CP_SIZE}: plan draws every rank, and no real "
            f"setup has more than {MAX_PLAN_CP_SIZE} context-parallel ranks"
        )
    try:
        first, order = _first_layout(args)
        # An allgather layout without a local length has no pieces yet: take the least.
        length = default_length(first)
    except LayoutError as err:  # name the flags the user typed, not the API's arguments
        raise LayoutError(_flag_names(str(err))) from None
    except TorchBalancerMissing as err:  # not a usage error: this torch lacks it
        one_line("cpslice plan", str(err))
        return EXIT_FAILURE
    d = cast(int, args.depth)
    stars = star_layout(first, order, length)
    spans, span_lengths = _spans(first.total_lengths, first.response_lengths, d)  # once: every rank's
    lines = [_header(args, first, length), *_sample_lines(args, first, spans)]
    shown = None if order is None else order_line(order, _FULL_PICTURE_MAX)
    if shown is not None:
        lines.append(f"{shown} (rank r holds stream positions order[r*T:(r+1)*T])")
    lines += _legend(colour, d, stars is not None)
    if first.cp_mode == "order":
        lines.append(_ORDER_NOTE)
    if length > _FULL_PICTURE_MAX:
        lines.append(_COMPACT_NOTE.format(_FULL_PICTURE_MAX))
    for rank in range(cp_size):
        star_rank = None if stars is None else stars.for_rank(rank)
        lines += ["", *_rank_block(first.for_rank(rank).with_local_length(length), length, colour, d, star_rank,
                                   span_lengths)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


COMMAND = Subcommand(
    "draw what each context-parallel rank holds of each sample, and its response share",
    _plan_arguments,
    _plan,
)
