"""Invariant mode (``invariant=True``, docs/invariance.md) against a float64 reference,
where tests/test_invariant.py compares it with itself:

- a soft cap with the compiled kernels on (``CPSLICE_COMPILE=1``: the merged ``row_kernel``
  without TP, the per-tile ``tile_kernel`` under TP), at TP 1 and TP 2 on gloo: the eager
  bits and, within rounding, float64."""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import log_probs_and_entropy
from cpslice._vocab import invariant as _invariant
from cpslice._vocab import kernels as _kernels

from ._dist import run_distributed
from .invariant_cases import edge_rows
from .reference import grad_close, tolerance

# --- 1. a soft cap with the compiled kernels on, TP 1 and TP 2

CAP, CAP_V, CAP_VOCAB = 12.0, 768, 740  # TP 2: 384 columns a shard; the distribution's last tile partial
CAP_ROWS = 24


def _capped_data(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(21)
    targets = torch.randint(0, CAP_VOCAB, (CAP_ROWS,), generator=gen)
    targets[5:8] = torch.tensor([3, 400, CAP_VOCAB - 1])  # a target in each shard, one in the partial tile
    logits = edge_rows(targets, CAP_V, dtype, 22)  # logits up to ~60: the cap bends them
    return (logits, targets, torch.rand(CAP_ROWS, generator=gen) + 0.5, torch.randn(CAP_ROWS, generator=gen),
            torch.randn(CAP_ROWS, generator=gen))


def _capped_reference(logits: Tensor, targets: Tensor, temps: Tensor, g_lp: Tensor,
                      g_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-probs, entropies and logits' gradient of ``cap * tanh(x / cap) / tau``
    over the first ``CAP_VOCAB`` columns (a -inf logit caps to ``-cap``, and the cap's
    derivative there is 0)."""
    x = logits.double().requires_grad_(True)
    z = torch.tanh(x[:, :CAP_VOCAB] / CAP) * CAP / temps.double()[:, None]
    lp = torch.log_softmax(z, -1)
    logp = lp.gather(1, targets[:, None])[:, 0]
    entropy = -(lp.exp() * lp).sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (entropy * g_h.double()).sum())
    assert x.grad is not None
    return logp.detach(), entropy.detach(), x.grad


def _capped_worker(rank: int, world: int) -> dict[str, Any]:
    """Each dtype at TP 1 (no group) and TP 2 (the world), eager then compiled, with a cap:
    every result the bits of eager TP 1, and within rounding of float64; the compiled
    kernels open to these tiles (``compiled_ok``) and none caught differing."""
    assert world == 2
    v_local = CAP_V // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    compared: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets, temps, g_lp, g_h = _capped_data(dtype)
        ref_lp, ref_h, ref_grad = _capped_reference(logits, targets, temps, g_lp, g_h)
        runs: dict[tuple[str, int], tuple[Tensor, Tensor, Tensor]] = {}
        for mode in ("0", "1"):
            _kernels.mode = mode  # the rank's baseline puts it back after the task
            _invariant._verified, _invariant._disagree = set(), None
            for tp, group, part in ((1, None, slice(None)), (2, dist.group.WORLD, cols)):
                x = logits[:, part].clone().requires_grad_(True)
                valid = min(x.shape[1], max(0, CAP_VOCAB - (rank * v_local if tp == 2 else 0)))
                # the compiled kernels would take these rows uncapped: the cap alone keeps them eager
                assert _invariant.compiled_ok(x[:, :valid]) is (mode == "1")
                lp, h = log_probs_and_entropy(x, targets, with_entropy=True, temperature=temps, softcap=CAP,
                                              vocab_size=CAP_VOCAB, tp_group=group, invariant=True)
                torch.autograd.backward((lp * g_lp).sum() + (h * g_h).sum())
                assert x.grad is not None
                runs[mode, tp] = (lp.detach(), h.detach(), x.grad)
            assert _invariant._disagree is None, _invariant._disagree
        want = runs["0", 1]
        for (mode, tp), (lp, h, grad) in runs.items():
            assert torch.equal(lp, want[0]), (dtype, mode, tp, (lp - want[0]).abs().max())
            assert torch.equal(h, want[1]), (dtype, mode, tp, (h - want[1]).abs().max())
            assert torch.equal(grad, want[2] if tp == 1 else want[2][:, cols]), (dtype, mode, tp)
        atol = tolerance(logits.float()[:, :CAP_VOCAB].clamp(-CAP, CAP), float(temps.min()))
        torch.testing.assert_close(want[0].double(), ref_lp, rtol=0.0, atol=atol)
        torch.testing.assert_close(want[1].double(), ref_h, rtol=0.0, atol=atol)
        grad_close(want[2], ref_grad, 1e-5 if dtype == torch.float32 else 1e-2)
        compared[str(dtype)] = len(runs)
    return compared


def test_a_soft_cap_with_the_compiled_kernels_on_gives_the_eager_bits_at_tp_1_and_2() -> None:
    # CPSLICE_COMPILE=1 opens the compiled kernels to every tile (the size no bar): a
    # capped row must still get the capped statistics, the eager ones, bit for bit
    results = run_distributed(_capped_worker, 2, timeout=200)
    assert results == [{"torch.float32": 4, "torch.bfloat16": 4}] * 2
