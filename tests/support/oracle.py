"""A deliberately naive, loop-by-loop reading of docs/layouts.md, used only as a test oracle.

It shares no code with cpslice._layout.plan, so the library's vectorized arithmetic is
checked against an independent transcription of the ground truth.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from cpslice import Layout
from cpslice._types import CpMode, QkvFormat


@dataclass(frozen=True)
class Config:
    total: tuple[int, ...]
    response: tuple[int, ...]
    fmt: QkvFormat
    seq: int | None
    mode: CpMode
    cp: int
    local_length: int | None  # given to the Layout (allgather: the piece length)
    extra: int  # padding rows at the end of the local tensor (when no local_length), declared to the Layout
    padded: tuple[int, ...] | None = None  # thd: each sample's W_i, given to the Layout
    align: int | None = None  # thd: W_i = L_i rounded up to a multiple of align
    row_offsets: tuple[int, ...] | None = None  # bshd: sample i at columns [o_i, o_i + L_i)

    def layout(self, rank: int, *, with_local: bool = True) -> Layout:
        return Layout(
            list(self.total),
            list(self.response),
            qkv_format=self.fmt,
            max_seq_len=self.seq,
            cp_mode=self.mode,
            cp_rank=rank,
            cp_size=self.cp,
            local_length=local_length(self) if with_local and (self.local_length is not None or self.extra) else None,
            padded_lengths=None if self.padded is None else list(self.padded),
            align=self.align,
            row_offsets=None if self.row_offsets is None else list(self.row_offsets),
        )


def _round_up(value: int, step: int) -> int:
    while value % step:
        value += 1
    return value


def widths(cfg: Config) -> list[int]:
    """Each sample's positions, its right padding included (W_i)."""
    out = []
    for i, length in enumerate(cfg.total):
        if cfg.padded is not None:
            out.append(cfg.padded[i])
        elif cfg.align is not None:
            out.append(_round_up(length, cfg.align))
        elif cfg.fmt == "bshd":
            assert cfg.seq is not None
            out.append(_round_up(cfg.seq, 2 * cfg.cp) if cfg.mode == "zigzag" else cfg.seq)
        elif cfg.mode == "zigzag":
            out.append(_round_up(length, 2 * cfg.cp))
        else:
            out.append(length)
    return out


def _holds(cfg: Config, i: int, p: int) -> tuple[int, int] | None:
    """What position ``p`` of sample ``i``'s extent holds: ``(i, p - o_i)`` for its
    tokens at ``[o_i, o_i + L_i)``, padding (None) before and after them."""
    o = cfg.row_offsets[i] if cfg.row_offsets is not None else 0
    return (i, p - o) if o <= p < o + cfg.total[i] else None


def least_length(cfg: Config) -> int:
    if cfg.mode == "zigzag":
        # two chunks of W_i / 2c per sample
        return sum(2 * (w // (2 * cfg.cp)) for w in widths(cfg))
    stream = sum(widths(cfg))
    return (stream + cfg.cp - 1) // cfg.cp


def local_length(cfg: Config) -> int:
    return cfg.local_length if cfg.local_length is not None else least_length(cfg) + cfg.extra


def local_map(cfg: Config, rank: int) -> list[tuple[int, int] | None]:
    """For each local row: (sample, within-sample position), or None for padding."""
    t = local_length(cfg)
    rows: list[tuple[int, int] | None] = []
    width = widths(cfg)
    if cfg.mode == "none":
        for i in range(len(cfg.total)):
            rows += [_holds(cfg, i, p) for p in range(width[i])]
    elif cfg.mode == "zigzag":
        c = cfg.cp
        for i in range(len(cfg.total)):
            chunk = width[i] // (2 * c)
            for k in (rank, 2 * c - 1 - rank):
                for p in range(k * chunk, (k + 1) * chunk):
                    rows.append(_holds(cfg, i, p))
    else:
        stream: list[tuple[int, int] | None] = [
            _holds(cfg, i, p) for i in range(len(cfg.total)) for p in range(width[i])
        ]
        stream += [None] * (cfg.cp * t - len(stream))
        rows = list(stream[rank * t : (rank + 1) * t])
    assert len(rows) <= t, (len(rows), t)
    return rows + [None] * (t - len(rows))


def encode(sample: int, pos: int) -> float:
    return float(sample * 1000 + pos)


def local_values(cfg: Config, rank: int, rest: tuple[int, ...] = ()) -> Tensor:
    """The rank's local tensor whose row holding (i, p) is encode(i, p); padding is -1."""
    vals = [encode(*m) if m is not None else -1.0 for m in local_map(cfg, rank)]
    base = torch.tensor(vals, dtype=torch.float64)
    return base.reshape(-1, *([1] * len(rest))).expand(-1, *rest).clone()


def expected_share(cfg: Config, rank: int) -> list[list[float]]:
    """Per sample, encode(i, p) of the rank's response-span positions, in ascending order."""
    out: list[list[float]] = [[] for _ in cfg.total]
    for m in local_map(cfg, rank):
        if m is None:
            continue
        i, p = m
        prompt = cfg.total[i] - cfg.response[i]
        if prompt - 1 <= p < cfg.total[i] - 1:
            out[i].append(encode(i, p))
    for share in out:
        assert share == sorted(share)
    return out


def response_rows(cfg: Config, rank: int) -> list[int]:
    """Local rows of the rank's response-span positions."""
    rows = []
    for row, m in enumerate(local_map(cfg, rank)):
        if m is not None:
            i, p = m
            if cfg.total[i] - cfg.response[i] - 1 <= p < cfg.total[i] - 1:
                rows.append(row)
    return rows


def config_of(layout: Layout) -> Config:
    """The oracle's Config of a Layout (its plain numbers only; no local length: the least)."""
    offsets = layout.row_offsets if layout.qkv_format == "bshd" else None
    return Config(tuple(layout.total_lengths), tuple(layout.response_lengths), layout.qkv_format,
                  layout.max_seq_len, layout._closed_mode(), layout.cp_size, layout.local_length, 0,
                  row_offsets=offsets)


def shares(whole: list[Tensor], cfg: Config, rank: int) -> list[Tensor]:
    """The rank's share of whole per-sample response tensors ``[R_i, *rest]``: the
    elements at its response-span positions, ascending."""
    offsets: list[list[int]] = [[] for _ in cfg.total]
    for m in local_map(cfg, rank):
        if m is not None:
            i, p = m
            first = cfg.total[i] - cfg.response[i] - 1
            if first <= p < cfg.total[i] - 1:
                offsets[i].append(p - first)
    return [w[torch.tensor(o, dtype=torch.int64)] for w, o in zip(whole, offsets)]


def rows(per_sample: list[Tensor], cfg: Config, rank: int) -> Tensor:
    """The rank's local tensor of whole per-sample ``[L_i, *rest]`` tensors; zero padding."""
    places = local_map(cfg, rank)
    out = torch.zeros((len(places), *per_sample[0].shape[1:]), dtype=per_sample[0].dtype)
    for row, m in enumerate(places):
        if m is not None:
            out[row] = per_sample[m[0]][m[1]]
    return out
