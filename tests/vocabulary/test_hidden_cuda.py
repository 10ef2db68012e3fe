"""The hidden-state path natively on a CUDA device, in its own blocks (``blocks.sizes``:
8192-column splits by every row within the budget): against float64 at a GPU's sizes
(several splits, every row in one block, and several row blocks at a small budget),
default and invariant, with the Triton kernels asserted; invariant mode's bits across
batches, row orders and other partitions of the rows into 1024-row blocks; the GEMM
settings it fixes. Skipped, saying so, where no GPU exists (``make test`` runs on CPUs:
tests/vocabulary/test_hidden_triton.py and test_hidden_blocks.py prove the same through
Triton's interpreter, in a GPU's blocks) and under the interpreter (``make gpu-check``
runs this module natively, ``TRITON_INTERPRET=0``)."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import _probe, log_probs_and_entropy_from_hidden, topk_log_probs_from_hidden
from cpslice._vocab import blocks
from cpslice._vocab.backends import selection
from cpslice._vocab.blocks import Blocks, sizes

from ..support.triton_cases import (
    EXACT,
    Settings,
    close,
    gemm_settings,
    head,
    hidden_reference,
    launched,
    on_cuda,
    options,
)

pytestmark = on_cuda("the hidden path's GPU blocks ran on the CPU only, through Triton's interpreter "
                     "(tests/vocabulary/test_hidden_triton.py, test_hidden_blocks.py)")

T, H, V = 3000, 256, 40000  # 5 splits of 8192 columns, the last 7232


def budget(mib: int | None) -> Callable[..., Blocks]:
    """A ``block_sizes`` substitute: CUDA's blocks at a budget of ``mib`` MiB (None: the
    setting's)."""
    def sized(device: str, dtype: torch.dtype, rows: int, vocab: int, chunk: int | None, invariant: bool) -> Blocks:
        return sizes(device, dtype, rows, vocab, chunk, invariant, None if mib is None else mib * 2**20)
    return sized


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("mib", [None, 24], ids=["every-row-one-block", "row-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opts", [{}, {"temperature": "per-row", "softcap": 30.0, "vocab_size": V - 123}],
                         ids=["plain", "per-row,softcap,vocab_size"])
def test_cuda_blocks_against_float64(seen: _probe.Seen, dtype: torch.dtype, mib: int | None, invariant: bool,
                                     opts: dict[str, Any]) -> None:
    kw = options(opts, T, "cuda")
    grid = budget(mib)("cuda", dtype, T, V, None, invariant)
    assert grid.columns == blocks.SPLIT and (grid.rows >= T if mib is None and not invariant else grid.rows < T)
    hidden, weight = (t.cuda() for t in head(T, H, V, dtype, 3))
    targets = torch.randint(0, kw.get("vocab_size", V), (T,), device="cuda")
    g_lp, g_h = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with selection.using("auto"), _probe.substitute("block_sizes", budget(mib)):
        lp, ent = log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=True, invariant=invariant, **kw)
        torch.autograd.backward((lp * g_lp).sum() + (ent * g_h).sum())
    want_kernels = {"invariant_tiles", "invariant_grad"} if invariant else {"default.stats", "default.grad"}
    assert want_kernels <= launched(seen)
    want = hidden_reference(hidden, weight, targets[:, None], kw.get("temperature", 1.0), kw.get("softcap"),
                            kw.get("vocab_size"), g_lp[:, None], g_h)
    close(hidden, weight, kw.get("temperature", 1.0), (lp, ent, x.grad, w.grad), (want[0][:, 0], *want[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_bits_in_any_batch_order_and_blocking(dtype: torch.dtype) -> None:
    """A row's log-prob, entropy, top-k and hidden gradient are the same bits whatever the
    other rows: in another batch, another order, another partition into 1024-row blocks
    (the fixed GEMM shape: cuBLAS sums an output in one order wherever it sits)."""
    hidden, weight = (t.cuda() for t in head(T, H, V, dtype, 5))
    targets = torch.randint(0, V, (T,), device="cuda")
    g = torch.randn(T, device="cuda")

    def call(rows: Tensor) -> tuple[Tensor, ...]:
        x = hidden[rows].clone().requires_grad_()
        lp, ent = log_probs_and_entropy_from_hidden(x, weight, targets[rows], with_entropy=True, temperature=0.9,
                                                    invariant=True)
        top, ids = topk_log_probs_from_hidden(hidden[rows], weight, 3, temperature=0.9, invariant=True)
        (lp * g[rows]).sum().backward()  # type: ignore[no-untyped-call]
        assert x.grad is not None
        return lp.detach(), ent, top, ids, x.grad

    every = torch.arange(T, device="cuda")
    want = call(every)
    perm = torch.randperm(T, device="cuda")
    for rows in (perm, perm[:700], every[300:], every[1:1025]):
        for got, w in zip(call(rows), want):
            assert torch.equal(got, w[rows])


def test_invariant_mode_fixes_the_gemm_settings_on_cuda(loose_gemms: Settings) -> None:
    inside: list[Settings] = []

    def gemm(a: Tensor, b: Tensor) -> Tensor:
        inside.append(gemm_settings())
        return torch.mm(a, b)

    hidden, weight = (t.cuda() for t in head(64, H, 9000, torch.float32, 9))
    with _probe.substitute("block_gemm", gemm):
        log_probs_and_entropy_from_hidden(hidden, weight, torch.arange(64, device="cuda"), invariant=True)
    assert inside and set(inside) == {EXACT} and gemm_settings() == loose_gemms
