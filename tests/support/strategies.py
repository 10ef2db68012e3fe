"""Hypothesis strategies over random layouts, edges included: empty responses,
single-token samples, samples shorter than 2 * cp_size, responses crossing chunk
and rank boundaries, ranks that hold nothing, and (thd) samples that carry their
own padding: an ``align``, or ``padded_lengths`` several chunks longer than needed,
with a stretched last sample, so that some ranks hold samples that are all padding;
(bshd) left-padded rows: random ``row_offsets``, zeros, samples pushed to their row's
end, and Hugging Face batches (prompts left-padded to a common width, the responses
after them), whose left padding crosses zigzag chunks."""

import dataclasses

from hypothesis import strategies as st

from cpslice._types import CpMode, QkvFormat

from .oracle import Config, least_length


@st.composite
def samples(draw: st.DrawFn, max_n: int = 6, max_len: int = 24) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = draw(st.integers(0, max_n))
    total = tuple(draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n)))
    response = tuple(draw(st.integers(0, t - 1)) for t in total)
    return total, response


@st.composite
def padding(
    draw: st.DrawFn, total: tuple[int, ...], mode: CpMode, cp: int
) -> tuple[tuple[int, ...] | None, int | None]:
    """``(padded_lengths, align)`` for a thd layout: neither (today's packing), an
    align, or per-sample widths up to 3 steps beyond the least, the last one stretched."""
    step = 2 * cp if mode == "zigzag" else 1  # zigzag: every W_i and align are multiples of 2c
    kind = draw(st.sampled_from(("default", "default", "align", "padded")))
    if kind == "align":
        return None, step * draw(st.integers(1, 4 if step > 1 else 9))
    if kind == "default":
        return None, None
    more = draw(st.lists(st.integers(0, 3), min_size=len(total), max_size=len(total)))
    widths = [-(-t // step) * step + step * m for t, m in zip(total, more)]
    stretched = draw(st.booleans())
    if widths and stretched:  # the stream's last sample stretched to a round size
        widths[-1] += step * draw(st.integers(1, 8))
    return tuple(widths), None


@st.composite
def rows(
    draw: st.DrawFn, total: tuple[int, ...], response: tuple[int, ...]
) -> tuple[int, tuple[int, ...] | None]:
    """``(max_seq_len, row_offsets)`` for a bshd layout of these samples."""
    kind = draw(st.sampled_from(("none", "none", "zeros", "random", "end", "left-padded")))
    if kind == "left-padded":  # prompts right-aligned at a common column, then responses
        prompt = [t - r for t, r in zip(total, response)]
        width = max(prompt, default=0)
        seq = max(1, width + max(response, default=0) + draw(st.integers(0, 3)))
        return seq, tuple(width - p for p in prompt)
    seq = max(total, default=1) + draw(st.integers(0, 5))
    if kind == "none":
        return seq, None
    if kind == "zeros":
        return seq, (0,) * len(total)
    if kind == "end":
        return seq, tuple(seq - t for t in total)
    return seq, tuple(draw(st.integers(0, seq - t)) for t in total)


@st.composite
def configs(
    draw: st.DrawFn,
    modes: tuple[CpMode, ...] = ("none", "zigzag", "allgather"),
    max_cp: int = 8,
    max_n: int = 6,
) -> Config:
    total, response = draw(samples(max_n=max_n))
    mode = draw(st.sampled_from(modes))
    fmt: QkvFormat = "thd" if mode == "allgather" else draw(st.sampled_from(("thd", "bshd")))
    cp = 1 if mode == "none" else draw(st.integers(2 if mode == "zigzag" else 1, max_cp))  # zigzag: cp >= 2
    seq, offsets = draw(rows(total, response)) if fmt == "bshd" else (None, None)
    padded, align = draw(padding(total, mode, cp)) if fmt == "thd" else (None, None)
    extra = draw(st.integers(0, 4))
    cfg = Config(total, response, fmt, seq, mode, cp, None, extra, padded, align, offsets)
    # allgather: T is the piece length, given to the Layout or inferred from the tensor;
    # every mode: padding rows beyond what the layout needs, declared (Config.layout).
    if mode == "allgather" and draw(st.booleans()):
        cfg = dataclasses.replace(cfg, local_length=least_length(cfg) + extra, extra=0)
    return cfg
