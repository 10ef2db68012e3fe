"""The hidden-state path's blocks sized for CUDA (``blocks.sizes``), on the CPU: the pure
sizing function at a GPU's sizes, the ``CPSLICE_BLOCK_MIB`` setting, and the block walk
of CPU tensors in a GPU's blocks (the ``block_sizes`` step: several row blocks and
splits at a small budget and a narrow split, one block of every row at the default),
through the eager backend and the Triton kernels (the interpreter), against float64.
tests/vocabulary/test_hidden_cuda.py walks them natively on a GPU."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpslice import _probe, log_probs_and_entropy_from_hidden
from cpslice._vocab import blocks
from cpslice._vocab.backends import selection
from cpslice._vocab.blocks import Blocks, sizes

from ..support.reference import grad_close, linear_reference, value_atol

BF16, F32 = torch.bfloat16, torch.float32


def test_a_gpu_block_holds_every_row_of_the_benchmark_in_bfloat16() -> None:
    # T = 16384, V = 151936: 8192 columns x every row within 512 MiB (2 x 8192 x 2 B a row)
    assert sizes("cuda", BF16, 16384, 151936, None, False) == Blocks(16384, 8192, True)
    assert sizes("cuda", F32, 16384, 151936, None, False) == Blocks(8192, 8192, True)  # 4 B a value
    assert sizes("cuda", BF16, 16385, 151936, None, False).rows == 16384  # one row more: two blocks
    assert sizes("cuda", BF16, 16384, 151936, None, False, budget=2**20) == Blocks(32, 8192, True)
    assert sizes("cuda", BF16, 100, 5000, None, False) == Blocks(100, 5000, True)  # a narrow shard: one split
    assert sizes("cuda", BF16, 16384, 151936, 1000, False) == Blocks(1000, 8192, True)  # chunk_size caps rows
    assert sizes("cuda", BF16, 16384, 151936, None, False, split=1024) == Blocks(16384, 1024, True)


def test_invariant_blocks_have_one_shape_per_device() -> None:
    for rows, vocab, chunk in [(1, 300, None), (16384, 151936, None), (5000, 75968, 77)]:
        assert sizes("cuda", BF16, rows, vocab, chunk, True) == Blocks(blocks.DEVICE_ROWS, blocks.SPLIT, True)
        assert sizes("cpu", F32, rows, vocab, chunk or 64, True) == Blocks(64, 1024)  # the CPU's, as before


def test_the_cpu_keeps_its_tuned_blocks() -> None:
    for rows, vocab, chunk in [(4096, 32768, 256), (7, 300, 3), (50000, 151936, 55)]:
        for device in ("cpu", "mps"):
            assert sizes(device, F32, rows, vocab, chunk, False) == Blocks.of(rows, vocab, chunk)
    assert Blocks.of(4096, 32768, 256) == Blocks(2048, 2048)  # half of a 256-row chunk's elements


def test_the_budget_setting() -> None:
    assert blocks.block_budget("") == 512 * 2**20 == blocks.BLOCK_MIB * 2**20
    assert blocks.block_budget("64") == 64 * 2**20
    rule = r"use a whole number of MiB >= 1 \(the hidden-state path's block buffers on CUDA; unset: 512\)$"
    for bad in ("0", "-5", "1.5", "512MiB", " 64", "lots"):
        with pytest.raises(ValueError, match=rf"^CPSLICE_BLOCK_MIB='{bad}' is not valid; {rule}"):
            blocks.block_budget(bad)


def _gpu_blocks(budget: int | None, split: int) -> Callable[..., Blocks]:
    """A ``block_sizes`` substitute: the blocks CUDA would take, for CPU tensors."""
    def fake(device: str, dtype: torch.dtype, rows: int, vocab: int, chunk: int | None, invariant: bool) -> Blocks:
        return sizes("cuda", dtype, rows, vocab, None, invariant, budget, split)
    return fake


# (dtype, budget in bytes, split): several row blocks by several splits; every row in one block
WALKS = [
    pytest.param(F32, 3 * 2 * 128 * 4, 128, 3 * 3, id="float32-3x3-blocks"),
    pytest.param(BF16, 4 * 2 * 128 * 2, 128, 2 * 3, id="bfloat16-2x3-blocks"),
    pytest.param(BF16, None, blocks.SPLIT, 1, id="bfloat16-one-block"),
]


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize(("dtype", "budget", "split", "count"), WALKS)
def test_the_walk_in_a_gpus_blocks_against_float64(backend: str, dtype: torch.dtype, budget: int | None, split: int,
                                                   count: int) -> None:
    t, h, v = 7, 16, 300
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(t, h, generator=gen).to(dtype), (torch.randn(v, h, generator=gen) / 2).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen)
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with selection.using(backend), _probe.substitute("block_sizes", _gpu_blocks(budget, split)), \
            _probe.watch() as seen:
        lp, ent = log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=True, temperature=0.8)
        torch.autograd.backward((lp * g_lp).sum() + (ent * g_h).sum())
    assert seen.count("call", name="stats") == seen.count("call", name="grad") == count
    assert {e.backend for e in seen.of("launch")} == {backend}
    ref_lp, ref_h, ref_dx, ref_dw = linear_reference(hidden, weight, targets, 0.8, g_lp, g_h)
    rel: tuple[float, float] = (2e-6, 1e-5) if dtype == F32 else (2.0**-7, 3e-2)
    atol = value_atol(hidden, weight, 0.8, rel[0])
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(ent.double(), ref_h, rtol=0.0, atol=atol)
    assert x.grad is not None and w.grad is not None and x.grad.dtype == w.grad.dtype == dtype
    grad_close(x.grad, ref_dx, rel[1])
    grad_close(w.grad, ref_dw, rel[1])


@pytest.mark.parametrize("budget", [None, 2 * 4 * 4 * 3], ids=["one-block", "row-blocks"])
def test_a_row_sure_of_its_target_gets_exactly_zero_gradient_in_a_gpus_blocks(budget: int | None) -> None:
    """Exactly 0 only if the backward recomputes the forward's logits bit for bit: the
    same blocks both ways (the weight gradient written straight, or summed)."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(40, 5, generator=gen) * 4).requires_grad_(True)
    weight = torch.randn(1, 5, generator=gen).requires_grad_(True)
    sized: Any = _gpu_blocks(budget, 4)
    with selection.using("eager"), _probe.substitute("block_sizes", sized):
        logp, entropy = log_probs_and_entropy_from_hidden(hidden, weight, torch.zeros(40, dtype=torch.int64),
                                                          with_entropy=True, temperature=0.5)
        torch.autograd.backward((logp * torch.randn(40, generator=gen)).sum() + entropy.sum())
    assert not logp.any() and not entropy.any()
    assert hidden.grad is not None and weight.grad is not None
    assert not hidden.grad.any() and not weight.grad.any()
