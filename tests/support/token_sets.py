"""Token sets (supports) for the tests: the ``Sets`` of a tensor's rows and their CSR
``Support``, a hypothesis strategy of single-process support cases, random sets per
response token, the fixed sets of the TP cases, and the random LM head (hidden size
``H``) the hidden-state path's support cases run on."""

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from cpslice import Support

from .oracle import Config

Sets = list[list[int]]
H = 5


def head(t: int, v: int, seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(hidden [t, H], weight [v, H])``, random from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, generator=gen) * 1.5).to(dtype), torch.randn(v, H, generator=gen).to(dtype)


def csr(sets: Sets) -> Support:
    """The ``Support`` whose row ``t`` is ``sets[t]``."""
    ids = torch.tensor([i for s in sets for i in s], dtype=torch.int64)
    counts = torch.tensor([len(s) for s in sets], dtype=torch.int64)
    return Support(ids, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))


@st.composite
def support_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Logits, targets and a set per row (empty, one id, with or without the target,
    random), the temperature, chunk, entropy options and ``entropy_over`` of one call."""
    t = draw(st.integers(0, 10))
    v = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=gen) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    targets = torch.randint(0, v, (t,), generator=gen)
    sets: Sets = []
    for row in range(t):
        kind = draw(st.sampled_from(["empty", "single", "target-in", "target-out", "random"]))
        perm = torch.randperm(v, generator=gen).tolist()
        if kind == "empty":
            sets.append([])
        elif kind == "single":
            sets.append(perm[:1])
        else:
            size = draw(st.integers(1, v))
            chosen = perm[:size]
            tgt = int(targets[row])
            if kind == "target-in" and tgt not in chosen:
                chosen[-1] = tgt
            if kind == "target-out" and tgt in chosen:
                chosen.remove(tgt)
            sets.append(chosen)
    return {
        "logits": logits, "targets": targets, "sets": sets,
        "temperature": draw(st.sampled_from([0.6, 1.0, 1.7])),
        "chunk": draw(st.sampled_from([None, 1, 2, 3, 100])),
        "with_entropy": draw(st.booleans()),
        "entropy_grad": draw(st.sampled_from([True, True, False])),
        "over": draw(st.sampled_from(["full", "support"])),
    }


def tp_sets(i: int, t: int, vocab: int, targets: Tensor) -> Sets:
    """Empty rows, single ids, targets outside and inside, sets spanning shards or one shard."""
    gen = torch.Generator().manual_seed(500 + i)
    sets: Sets = []
    for row in range(t):
        kind = row % 5
        perm = torch.randperm(vocab, generator=gen).tolist()
        if kind == 0:
            sets.append([])
        elif kind == 1:
            sets.append(perm[:1])
        elif kind == 2:  # within the first shard, the target maybe elsewhere
            sets.append([j for j in perm if j < vocab // 4][:2] or [0])
        else:
            chosen = perm[: 2 + row % 3]
            if kind == 3 and int(targets[row]) not in chosen:
                chosen[0] = int(targets[row])
            sets.append(chosen)
    return sets


def response_sets(cfg: Config, seed: int, vocab: int = 30) -> tuple[list[Sets], list[Tensor], list[Tensor]]:
    """Per sample, per response token, a random set (some empty); and the CSR form."""
    gen = torch.Generator().manual_seed(seed)
    per: list[Sets] = []
    for r in cfg.response:
        sample: Sets = []
        for _ in range(r):
            size = int(torch.randint(0, 5, (1,), generator=gen))
            sample.append(torch.randperm(vocab, generator=gen)[:size].tolist())
        per.append(sample)
    ids = [torch.tensor([i for s in sample for i in s], dtype=torch.int64) for sample in per]
    offsets = [torch.tensor([0] + [len(s) for s in sample], dtype=torch.int64).cumsum(0) for sample in per]
    return per, ids, offsets
