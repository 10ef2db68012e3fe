"""The hidden-state path through the Triton kernels on the CPU (Triton's interpreter,
``TRITON_INTERPRET=1``, set for the session by conftest.py): invariant mode's bits against
the eager backend's, in the CPU's blocks and in a GPU's (the ``block_sizes`` step), at
TP 1 and TP 2 on gloo ranks; the GEMM settings invariant mode fixes for its own calls.
tests/vocabulary/test_hidden_cuda.py runs the same natively where a GPU exists."""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import _probe, log_probs_and_entropy_from_hidden, topk_log_probs_from_hidden
from cpslice._vocab.backends import selection
from cpslice._vocab.blocks import Blocks, sizes

from .._dist import run_distributed
from ..triton_cases import launched

pytest.importorskip("triton")  # in the dev install (requirements-dev.txt): never skipped by `make test`

BF16, F32 = torch.bfloat16, torch.float32
INVARIANT_KERNELS = {"invariant_tiles", "invariant_merge", "invariant_grad"}


def gpu_blocks(budget: int | None = None, split: int = 128) -> Callable[..., Blocks]:
    """A ``block_sizes`` substitute: the blocks CUDA would take (``split`` columns: several
    splits of a small vocabulary), for CPU tensors."""
    def fake(device: str, dtype: torch.dtype, rows: int, vocab: int, chunk: int | None, invariant: bool) -> Blocks:
        return sizes("cuda", dtype, rows, vocab, None, invariant, budget, split)
    return fake


@contextmanager
def blocks_of(sizing: str) -> Iterator[None]:
    """The CPU's blocks (``cpu``) or a GPU's (``gpu``) for the block."""
    with ExitStack() as stack:
        if sizing == "gpu":
            stack.enter_context(_probe.substitute("block_sizes", gpu_blocks()))
        yield


def head(t: int, h: int, v: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    """``[t, h]`` hidden states and a ``[v, h]`` LM head of ``dtype``, a peaked row among them."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(t, h, generator=gen), torch.randn(v, h, generator=gen) / 2
    hidden[1] *= 8.0
    return hidden.to(dtype), weight.to(dtype)


def options(opts: dict[str, Any], t: int) -> dict[str, Any]:
    """``opts`` with a per-row temperature made a ``[t]`` tensor."""
    out = dict(opts)
    if out.get("temperature") == "per-row":
        out["temperature"] = torch.linspace(0.6, 1.4, t)
    return out


def invariant_call(which: str, hidden: Tensor, weight: Tensor, targets: Tensor, opts: dict[str, Any],
                   tp_group: Any = None) -> tuple[Tensor, ...]:
    """``invariant=True`` under the backend ``which``: log-prob, entropy, top-3 (values, ids)
    and, without TP, the gradients w.r.t. ``hidden`` and ``weight``."""
    with selection.using(which):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=True, invariant=True,
                                                    tp_group=tp_group, **opts)
        top, ids = topk_log_probs_from_hidden(hidden, weight, 3, invariant=True, tp_group=tp_group, **opts)
        if tp_group is not None:
            return lp, ent, top, ids
        g = torch.linspace(-1, 1, hidden.shape[0])
        torch.autograd.backward((lp * g).sum() + (ent * g.flip(0)).sum())
    assert x.grad is not None and w.grad is not None
    return lp.detach(), ent.detach(), top, ids, x.grad, w.grad


INVARIANT = [
    pytest.param(F32, {}, "cpu", id="float32-plain-cpu-blocks"),
    pytest.param(BF16, {}, "gpu", id="bfloat16-plain-gpu-blocks"),
    pytest.param(F32, {"temperature": "per-row", "softcap": 15.0}, "gpu", id="float32-per-row-softcap-gpu-blocks"),
    pytest.param(BF16, {"temperature": 0.7, "vocab_size": 280}, "cpu", id="bfloat16-vocab_size-cpu-blocks"),
]


@pytest.mark.parametrize(("dtype", "opts", "sizing"), INVARIANT)
def test_invariant_mode_gives_the_eager_bits(seen: _probe.Seen, dtype: torch.dtype, opts: dict[str, Any],
                                             sizing: str) -> None:
    t, v = 4, 300  # 3 tiles, the last partial; a GPU's blocks: 3 splits of 128 columns
    hidden, weight = head(t, 8, v, dtype, 3)
    targets = torch.tensor([0, 279, 128, 5])
    kw = options(opts, t)
    with blocks_of(sizing):
        before = len(seen.events)
        got = invariant_call("triton", hidden, weight, targets, kw)
        assert INVARIANT_KERNELS <= launched(seen, before)
        want = invariant_call("eager", hidden, weight, targets, kw)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_the_gpu_blocks_give_the_cpu_blocks_bits() -> None:
    """A row's logits are the same bits in the CPU's 64 x 1024 GEMMs and in a GPU's
    1024 x 128 ones on this BLAS (it sums each output in one order, whatever the shape,
    for these shapes), so the values are too (the eager backend: the bits are the Triton
    kernels' too, above)."""
    hidden, weight = head(7, 16, 700, F32, 4)
    targets = torch.arange(7) * 90
    cpu = invariant_call("eager", hidden, weight, targets, {})
    with blocks_of("gpu"):
        gpu = invariant_call("eager", hidden, weight, targets, {})
    for g, c in zip(gpu[:4], cpu[:4]):
        assert torch.equal(g, c)


def invariant_tp_worker(rank: int, world: int) -> int:
    """Invariant mode through the Triton kernels at TP 2 (each rank a 256-column shard:
    2 tiles), against the eager backend at TP 1 on the whole head: the same bits of the
    values, in the CPU's blocks and in a GPU's."""
    checked = 0
    for dtype, opts, sizing in [(BF16, {}, "cpu"), (F32, {"temperature": "per-row", "softcap": 15.0,
                                                             "vocab_size": 500}, "gpu")]:
        hidden, weight = head(4, 8, 512, dtype, 7)
        targets = torch.tensor([0, 499, 255, 256])
        kw = options(opts, 4)
        shard = weight[rank * 256 : (rank + 1) * 256].contiguous()
        with blocks_of(sizing), _probe.watch() as seen:
            got = invariant_call("triton", hidden, shard, targets, kw, dist.group.WORLD)
            assert INVARIANT_KERNELS - {"invariant_grad"} <= launched(seen)
            want = invariant_call("eager", hidden, weight, targets, kw)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype and torch.equal(g, w), (dtype, sizing, i)
            checked += 1
    dist.barrier()
    return checked


def test_invariant_mode_at_tp_2_on_gloo() -> None:
    assert run_distributed(invariant_tp_worker, 2, timeout=200) == [8, 8]


Settings = tuple[object, ...]


def gemm_settings() -> Settings:
    """The settings a GEMM's bits depend on, as one reads them."""
    cuda = torch.backends.cuda.matmul
    return (cuda.allow_tf32, cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction,
            cuda.allow_fp16_accumulation, torch.get_float32_matmul_precision(),
            torch.backends.mkldnn.matmul.fp32_precision)  # type: ignore[attr-defined]  # untyped in torch


EXACT: Settings = (False, False, False, False, "highest", "ieee")


@pytest.fixture
def loose_gemms() -> Iterator[Settings]:
    """Every GEMM setting at its fastest, loosest value for the test (TF32, reduced
    precision reductions, float16 accumulation, bfloat16 inside oneDNN), as it was after."""
    cuda = torch.backends.cuda.matmul
    before = (torch.get_float32_matmul_precision(), cuda.allow_bf16_reduced_precision_reduction,
              cuda.allow_fp16_reduced_precision_reduction, cuda.allow_fp16_accumulation)
    try:
        torch.set_float32_matmul_precision("medium")  # TF32 on CUDA, bfloat16 inside oneDNN
        cuda.allow_bf16_reduced_precision_reduction = cuda.allow_fp16_reduced_precision_reduction = True
        cuda.allow_fp16_accumulation = True
        yield gemm_settings()
    finally:
        torch.set_float32_matmul_precision(before[0])
        cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction = before[1:3]
        cuda.allow_fp16_accumulation = before[3]


def test_invariant_mode_fixes_the_gemm_settings_for_its_own_calls(loose_gemms: Settings) -> None:
    assert loose_gemms == (True, True, True, True, "medium", "bf16")
    inside: list[Settings] = []

    def gemm(a: Tensor, b: Tensor) -> Tensor:
        inside.append(gemm_settings())
        return torch.mm(a, b)

    hidden, weight = head(5, 8, 300, F32, 9)
    with _probe.substitute("block_gemm", gemm):
        for invariant in (True, False):
            x = hidden.clone().requires_grad_()
            lp, _ = log_probs_and_entropy_from_hidden(x, weight, torch.arange(5), invariant=invariant)
            lp.sum().backward()  # type: ignore[no-untyped-call]
            topk_log_probs_from_hidden(hidden, weight, 2, invariant=invariant)
            assert len(inside) == 3  # forward, the backward's recomputation, top-k
            assert set(inside) == {EXACT if invariant else loose_gemms}  # the default mode: the caller's
            assert gemm_settings() == loose_gemms  # restored
            inside.clear()

    def failing(a: Tensor, b: Tensor) -> Tensor:
        inside.append(gemm_settings())
        raise RuntimeError("a GEMM that fails")

    with _probe.substitute("block_gemm", failing), pytest.raises(RuntimeError, match="a GEMM that fails"):
        log_probs_and_entropy_from_hidden(hidden, weight, torch.arange(5), invariant=True)
    assert inside == [EXACT] and gemm_settings() == loose_gemms  # restored, the call raising
