"""A deliberately naive, loop-by-loop reading of LAYOUTS.md, used only as a test oracle.

It shares no code with cpslice._plan, so the library's vectorized arithmetic is
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
    extra: int  # extra padding rows at the end of the local tensor (when no local_length)

    def layout(self, rank: int, *, with_local: bool = True) -> Layout:
        return Layout(
            list(self.total),
            list(self.response),
            qkv_format=self.fmt,
            max_seq_len=self.seq,
            cp_mode=self.mode,
            cp_rank=rank,
            cp_size=self.cp,
            local_length=self.local_length if with_local else None,
        )


def least_length(cfg: Config) -> int:
    n = len(cfg.total)
    if cfg.mode == "none":
        return sum(cfg.total) if cfg.fmt == "thd" else n * (cfg.seq or 0)
    if cfg.mode == "zigzag":
        two_c = 2 * cfg.cp
        if cfg.fmt == "bshd":
            width = -(-(cfg.seq or 0) // two_c) * two_c
            return n * 2 * (width // two_c)
        return sum(2 * (-(-t // two_c) * two_c // two_c) for t in cfg.total)
    return -(-sum(cfg.total) // cfg.cp)


def local_length(cfg: Config) -> int:
    return cfg.local_length if cfg.local_length is not None else least_length(cfg) + cfg.extra


def local_map(cfg: Config, rank: int) -> list[tuple[int, int] | None]:
    """For each local row: (sample, within-sample position), or None for padding."""
    t = local_length(cfg)
    rows: list[tuple[int, int] | None] = []
    if cfg.mode == "none" and cfg.fmt == "thd":
        for i, length in enumerate(cfg.total):
            rows += [(i, p) for p in range(length)]
    elif cfg.mode == "none":
        assert cfg.seq is not None
        for i, length in enumerate(cfg.total):
            rows += [(i, p) if p < length else None for p in range(cfg.seq)]
    elif cfg.mode == "zigzag":
        c = cfg.cp
        for i, length in enumerate(cfg.total):
            base = cfg.seq if cfg.fmt == "bshd" else length
            assert base is not None
            width = base
            while width % (2 * c):
                width += 1
            chunk = width // (2 * c)
            for k in (rank, 2 * c - 1 - rank):
                for p in range(k * chunk, (k + 1) * chunk):
                    rows.append((i, p) if p < length else None)
    else:
        stream: list[tuple[int, int] | None] = [(i, p) for i, length in enumerate(cfg.total) for p in range(length)]
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
    return Config(tuple(layout.total_lengths), tuple(layout.response_lengths), layout.qkv_format,
                  layout.max_seq_len, layout.cp_mode, layout.cp_size, layout.local_length, 0)


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
