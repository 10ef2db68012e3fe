"""The recipes of docs/recipes.md ("Which Layout is my framework's packing?"), each
checked against a plain transcription of that framework's packing rule (written from
the rule, not from the framework's code, and sharing nothing with cpslice._layout.plan or
tests/support/oracle.py):
on every rank, ``pack`` lays the tokens where the framework puts them, ``shifted_targets``
gives each row the next token of its sample, and ``extract_responses`` returns exactly
the rows whose logits predict a response token.

The rules:
- slime: samples back to back; under CP each sample is padded to the least multiple of
  ``2 * cp`` and cut into ``2 * cp`` chunks, rank ``r`` keeping chunks ``r`` and
  ``2 * cp - 1 - r``; the rank's stream is padded at the end to a multiple of ``tp * 128``.
- verl and Megatron-Bridge: every sample padded on the right to a multiple of
  ``align = tp * cp * 2`` under CP (``tp`` without), then split as above; FP8 setups
  use ``lcm(16, align)`` and stretch the last sample so that the whole (global) stream
  is a multiple of ``128 * align``.
- megatron-core ``PackedSeqParams``: ``cu_seqlens_q_padded`` holds the global padded
  sample boundaries; the split is the same.
- Hugging Face trainers (TRL, OpenRLHF, verl without remove-padding): ``[B, S]`` rows,
  the prompt left-padded to the longest, the response right after it, padded on the
  right to ``R`` columns; the log-probs of the response tokens are
  ``log_softmax(logits[:, -R-1:-1])`` gathered at the response ids, where the response
  mask is 1. Under zigzag CP a row (padded on the right to a multiple of ``2 * cp``) is
  split as a sample is above.
"""

import math
import random

import pytest
import torch

from cpslice import (
    Layout,
    extract_responses,
    pack,
    response_log_probs,
    shard_responses,
    shifted_targets,
)
from cpslice._types import CpMode

Row = tuple[int, int] | None  # (sample, position within the sample), or padding

SETUPS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]  # (tp, cp)


def _lengths(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    total = [rng.choice([1, 2, 3, rng.randint(4, 40)]) for _ in range(rng.randint(3, 8))]
    return total, [rng.randint(0, t - 1) for t in total]


def _rank_rows(total: list[int], widths: list[int], cp: int, rank: int) -> list[Row]:
    """Each sample: its tokens then padding up to its width; under CP the zigzag split."""
    rows: list[Row] = []
    for i, (length, width) in enumerate(zip(total, widths)):
        sample: list[Row] = [(i, p) if p < length else None for p in range(width)]
        if cp == 1:
            rows += sample
            continue
        chunk = width // (2 * cp)
        rows += sample[rank * chunk : (rank + 1) * chunk]
        rows += sample[(2 * cp - 1 - rank) * chunk : (2 * cp - rank) * chunk]
    return rows


def _check(layout: Layout, rows: list[Row], total: list[int], response: list[int]) -> None:
    code = [torch.tensor([1000.0 * i + p for p in range(t)]) for i, t in enumerate(total)]
    packed = pack(code, layout, fill=-1)
    assert packed.tolist() == [-1.0 if m is None else 1000.0 * m[0] + m[1] for m in rows]
    tokens = [torch.arange(t) + 1000 * i for i, t in enumerate(total)]
    want_targets = [
        1000 * m[0] + m[1] + 1 if m is not None and m[1] + 1 < total[m[0]] else -5 for m in rows
    ]
    assert shifted_targets(tokens, layout, fill=-5).tolist() == want_targets
    want: list[list[float]] = [[] for _ in total]
    for m in rows:
        if m is not None and total[m[0]] - response[m[0]] - 1 <= m[1] < total[m[0]] - 1:
            want[m[0]].append(1000.0 * m[0] + m[1])
    shares, _ = extract_responses(packed.double(), layout)
    assert [s.tolist() for s in shares] == want


def _verl_widths(total: list[int], tp: int, cp: int, fp8: bool) -> list[int]:
    align = tp * cp * 2 if cp > 1 else tp
    if fp8:
        align = math.lcm(16, align)
    widths = [-(-t // align) * align for t in total]
    if fp8:
        widths[-1] += -sum(widths) % (128 * align)
    return widths


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize(("tp", "cp"), SETUPS)
def test_slime(tp: int, cp: int, seed: int) -> None:
    total, response = _lengths(seed)
    widths = [-(-t // (2 * cp)) * 2 * cp if cp > 1 else t for t in total]
    for rank in range(cp):
        rows = _rank_rows(total, widths, cp, rank)
        rows += [None] * (-len(rows) % (tp * 128))
        # the docs/recipes.md recipe
        layout = Layout(total, response, cp_mode="zigzag" if cp > 1 else "none",
                        cp_rank=rank, cp_size=cp, local_length=len(rows))
        _check(layout, rows, total, response)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize(("tp", "cp"), SETUPS)
def test_verl_and_megatron_bridge(tp: int, cp: int, seed: int, fp8: bool) -> None:
    total, response = _lengths(seed)
    widths = _verl_widths(total, tp, cp, fp8)
    # the docs/recipes.md recipe
    align = tp * cp * 2 if cp > 1 else tp
    for rank in range(cp):
        rows = _rank_rows(total, widths, cp, rank)
        mode: CpMode = "zigzag" if cp > 1 else "none"
        if fp8:
            align8 = math.lcm(16, align)
            padded = [-(-t // align8) * align8 for t in total]
            padded[-1] += -sum(padded) % (128 * align8)
            layout = Layout(total, response, cp_mode=mode, cp_rank=rank, cp_size=cp,
                            padded_lengths=padded)
        else:
            layout = Layout(total, response, cp_mode=mode, cp_rank=rank, cp_size=cp, align=align)
        assert pack([torch.zeros(t) for t in total], layout).shape[0] == len(rows)
        _check(layout, rows, total, response)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize(("tp", "cp"), SETUPS)
def test_packed_seq_params(tp: int, cp: int, seed: int) -> None:
    total, response = _lengths(seed)
    widths = _verl_widths(total, tp, cp, fp8=seed == 1)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    cu_seqlens_q_padded = torch.tensor(bounds, dtype=torch.int32)  # as megatron-core holds it
    for rank in range(cp):
        rows = _rank_rows(total, widths, cp, rank)
        layout = Layout.from_cu_seqlens(cu_seqlens_q_padded, total, response,
                                        cp_mode="zigzag" if cp > 1 else "none",
                                        cp_rank=rank, cp_size=cp)
        assert layout.padded_lengths == tuple(widths)
        _check(layout, rows, total, response)


def _hf_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded prompt batch and its right-padded responses, as a trainer holds
    them: ``input_ids`` ``[B, S]``, ``attention_mask`` ``[B, S]``, the response mask
    ``[B, R]`` (a row may have an empty response, and the last column may be padding)."""
    rng = random.Random(seed)
    rows = rng.randint(1, 5)
    prompt = [rng.randint(1, 9) for _ in range(rows)]
    answer = [rng.randint(0, 8) for _ in range(rows)]
    width, resp = max(prompt), max(1, max(answer) + rng.randint(0, 2))  # R = 0: no slice
    ids = torch.randint(1, 50, (rows, width + resp), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(rows, width + resp, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompt, answer)):
        mask[i, width - p : width + r] = 1
    return ids * mask, mask, mask[:, width:]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_hugging_face(cp: int, seed: int) -> None:
    input_ids, attention_mask, response_mask = _hf_batch(seed)
    rows, width = input_ids.shape
    resp = response_mask.shape[1]
    logits = torch.randn(rows, width, 11, dtype=torch.float64)
    # TRL's and verl's slicing, row by row
    per_token = torch.log_softmax(logits[:, -resp - 1 : -1], -1).gather(
        2, (input_ids[:, -resp:] % 11)[..., None])[..., 0]
    want = [per_token[i][response_mask[i].bool()] for i in range(rows)]
    # the docs/recipes.md recipe
    layouts = [Layout.from_attention_mask(attention_mask, response_mask.sum(1).tolist(),
                                          cp_mode="zigzag" if cp > 1 else "none",
                                          cp_rank=rank, cp_size=cp) for rank in range(cp)]
    tokens = [ids[m.bool()] % 11 for ids, m in zip(input_ids, attention_mask)]
    padded = -(-width // (2 * cp)) * 2 * cp if cp > 1 else width
    chunk = padded // (2 * cp)
    for rank, layout in enumerate(layouts):
        local: list[Row] = []
        for i in range(rows):
            first = int(attention_mask[i].argmax())
            row: list[Row] = [(i, j - first) if j < width and attention_mask[i, j] else None
                              for j in range(padded)]
            if cp == 1:
                local += row
            else:
                local += row[rank * chunk : (rank + 1) * chunk]
                local += row[(2 * cp - 1 - rank) * chunk : (2 * cp - rank) * chunk]
        total, response = list(layout.total_lengths), list(layout.response_lengths)
        _check(layout, local, total, response)
        if cp == 1:
            flat = logits.reshape(rows * width, -1)
        else:
            flat = pack([x[m.bool()] for x, m in zip(logits, attention_mask)], layout)
        lp, _ = response_log_probs(flat, tokens, layout)
        for got, expect in zip(lp, shard_responses(want, layout)):
            torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)
