"""Hypothesis strategies over random layouts, edges included: empty responses,
single-token samples, samples shorter than 2 * cp_size, responses crossing chunk
and rank boundaries, ranks that hold nothing."""

from hypothesis import strategies as st

from cpslice._types import CpMode, QkvFormat

from .oracle import Config


@st.composite
def samples(draw: st.DrawFn, max_n: int = 6, max_len: int = 24) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = draw(st.integers(0, max_n))
    total = tuple(draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n)))
    response = tuple(draw(st.integers(0, t - 1)) for t in total)
    return total, response


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
    cp = 1 if mode == "none" else draw(st.integers(1, max_cp))
    seq = max(total, default=1) + draw(st.integers(0, 5)) if fmt == "bshd" else None
    extra = draw(st.integers(0, 4))
    # allgather: T is the piece length, given to the Layout or inferred from the tensor;
    # other modes: a local tensor may carry padding rows beyond what the layout needs.
    local: int | None = None
    if draw(st.booleans()):
        least = -(-sum(total) // cp) if mode == "allgather" else None
        if least is not None:
            local, extra = least + extra, 0
    return Config(total, response, fmt, seq, mode, cp, local, extra)
