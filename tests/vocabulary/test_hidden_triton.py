"""The hidden-state path through the Triton kernels on the CPU (Triton's interpreter,
``TRITON_INTERPRET=1``, set for the session by conftest.py), in the CPU's blocks and in a
GPU's (the ``block_sizes`` step): every option of the logits path against float64 (the
temperature, one or per row, the soft cap, ``vocab_size``, the entropy with and without
its gradient, supports, ``log_probs_at``, top-k, the response rows, distillation), values
and the gradients w.r.t. ``hidden`` and ``weight``, a Triton launch asserted for each (a
silent fallback to another backend fails); invariant mode's bits against the eager
backend's, at TP 1 and TP 2 on gloo ranks; the GEMM settings invariant mode fixes for its
own calls. tests/vocabulary/test_hidden_cuda.py runs the same natively where a GPU
exists."""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import (
    Layout,
    _probe,
    log_probs_and_entropy_from_hidden,
    log_probs_at_from_hidden,
    response_distillation_from_hidden,
    response_log_probs_from_hidden,
    topk_log_probs_from_hidden,
)
from cpslice._vocab.backends import selection
from cpslice._vocab.blocks import Blocks, sizes

from ..support import distill_reference as distill
from ..support._dist import run_distributed
from ..support.reference import linear_support_reference
from ..support.token_sets import csr
from ..support.triton_cases import (
    EXACT,
    OPTIONS,
    Settings,
    close,
    gemm_settings,
    head,
    hidden_reference,
    launched,
    options,
)

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


DEFAULT_KERNELS = {"default.stats", "default.grad"}


@pytest.fixture
def triton_backend() -> Iterator[None]:
    with selection.using("triton"):
        yield


# float32 in the CPU's blocks (chunk_size 2: 7 vocabulary blocks), bfloat16 in a GPU's (3
# splits of 128 columns), every option of the logits path's tests
FLOAT64 = [pytest.param(F32, opts, "cpu", id="float32-" + (",".join(opts) or "plain")) for opts in OPTIONS] + [
    pytest.param(BF16, OPTIONS[0], "gpu", id="bfloat16-plain-gpu-blocks"),
    pytest.param(BF16, OPTIONS[4], "gpu", id="bfloat16-softcap,temperature,vocab_size-gpu-blocks"),
]


@pytest.mark.parametrize(("dtype", "opts", "sizing"), FLOAT64)
def test_log_probs_and_entropy_from_hidden_against_float64(triton_backend: None, seen: _probe.Seen,
                                                           dtype: torch.dtype, opts: dict[str, Any],
                                                           sizing: str) -> None:
    t, v = 6, 400
    kw = options(opts, t)
    if "vocab_size" in kw:
        kw["vocab_size"] = 350
    with_entropy = kw.pop("with_entropy", True)
    use_h = with_entropy and kw.get("entropy_grad", True)
    hidden, weight = head(t, 8, v, dtype, 1)
    targets = torch.tensor([0, 349, 128, 3, 250, 127])
    g_lp, g_h = torch.linspace(-1, 1, t), torch.linspace(2, 0, t)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with blocks_of(sizing):
        lp, ent = log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=with_entropy,
                                                    chunk_size=2 if sizing == "cpu" else None, **kw)
        assert launched(seen) == {"default.stats"}
        torch.autograd.backward((lp * g_lp).sum() + ((ent * g_h).sum() if use_h and ent is not None else 0.0))
    assert launched(seen) == DEFAULT_KERNELS
    want = hidden_reference(hidden, weight, targets[:, None], kw.get("temperature", 1.0), kw.get("softcap"),
                            kw.get("vocab_size"), g_lp[:, None], g_h if use_h else torch.zeros(t))
    got = (lp, ent, x.grad, w.grad) if with_entropy else (lp, x.grad, w.grad)
    close(hidden, weight, kw.get("temperature", 1.0), got, (want[0][:, 0], *want[1:]) if with_entropy else
          (want[0][:, 0], want[2], want[3]))
    if "vocab_size" in kw:
        assert w.grad is not None and not w.grad[350:].any()


@pytest.mark.parametrize("sizing", ["cpu", "gpu"])
def test_log_probs_at_and_topk_from_hidden_against_float64(triton_backend: None, seen: _probe.Seen,
                                                           sizing: str) -> None:
    t, v = 5, 300
    hidden, weight = head(t, 8, v, F32, 2)
    ids = torch.tensor([[3, 3, 299], [0, 200, 200], [299, 1, 2], [7, 7, 7], [100, 150, 250]])
    g = torch.linspace(-1, 1, 3 * t).view(t, 3)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with blocks_of(sizing):
        at = log_probs_at_from_hidden(x, w, ids, temperature=0.9, softcap=9.0)
        (at * g).sum().backward()  # type: ignore[no-untyped-call]
        assert launched(seen) == DEFAULT_KERNELS
        want = hidden_reference(hidden, weight, ids, 0.9, 9.0, None, g, torch.zeros(t))
        close(hidden, weight, 0.9, (at, x.grad, w.grad), (want[0], want[2], want[3]))

        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        top, top_ids = topk_log_probs_from_hidden(x, w, 4, temperature=0.9, vocab_size=290)
        (top * g[:, :1]).sum().backward()  # type: ignore[no-untyped-call]
    logits = hidden.double() @ weight.double().T
    best = torch.log_softmax(logits[:, :290] / 0.9, -1).topk(4, -1)
    assert torch.equal(top_ids, best.indices)
    want = hidden_reference(hidden, weight, top_ids, 0.9, None, 290, g[:, :1].expand(t, 4), torch.zeros(t))
    close(hidden, weight, 0.9, (top, x.grad, w.grad), (best.values, want[2], want[3]))


@pytest.mark.parametrize("over", ["full", "support"])
def test_supports_from_hidden_against_float64(triton_backend: None, seen: _probe.Seen,
                                              over: Literal["full", "support"]) -> None:
    """The sets' own statistics are torch's (gathered elements); the dense ones (the rows
    without a set, every row with the full entropy) the Triton kernels'."""
    t, v = 5, 300
    hidden, weight = head(t, 8, v, F32, 5)
    targets = torch.tensor([3, 17, 299, 0, 250])
    sets = [[1, 2, 3, 100], [17], [], [5, 6, 250, 299], list(range(0, 300, 7))]
    g_lp, g_h = torch.linspace(-1, 1, t), torch.linspace(2, 0, t)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=True, temperature=0.8,
                                                support=csr(sets), entropy_over=over)
    torch.autograd.backward((lp * g_lp).sum() + (ent * g_h).sum())
    assert launched(seen) == DEFAULT_KERNELS
    want = linear_support_reference(hidden, weight, targets, sets, 0.8, over, g_lp, g_h)
    close(hidden, weight, 0.8, (lp, ent, x.grad, w.grad), want)


def test_response_rows_and_distillation_from_hidden_against_float64(triton_backend: None,
                                                                    seen: _probe.Seen) -> None:
    """The per-sample functions compute the response rows only (rows by index: a copy of
    those rows of the hidden states), through the same kernels."""
    total, response, v, tau = [6, 5], [3, 2], 300, 0.8
    layout = Layout(total, response)
    gen = torch.Generator().manual_seed(6)
    hidden, weight = head(sum(total), 8, v, F32, 6)
    tokens = [torch.randint(0, v, (n,), generator=gen) for n in total]
    rows = torch.tensor([2, 3, 4, 8, 9])  # each sample's rows that predict its response
    targets = torch.cat([tok[n - r:] for tok, n, r in zip(tokens, total, response)])
    g_lp, g_h = torch.linspace(-1, 1, 5), torch.linspace(2, 0, 5)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = response_log_probs_from_hidden(x, w, tokens, layout, with_entropy=True, temperature=tau)
    torch.autograd.backward((torch.cat(lp) * g_lp).sum() + (torch.cat(ent) * g_h).sum())
    assert launched(seen) == DEFAULT_KERNELS
    want = hidden_reference(hidden[rows], weight, targets[:, None], tau, None, None, g_lp[:, None], g_h)
    assert x.grad is not None and not x.grad[[0, 1, 5, 6, 7, 10]].any()  # no other row read
    close(hidden, weight, tau, (torch.cat(lp), torch.cat(ent), x.grad[rows], w.grad), (want[0][:, 0], *want[1:]))

    # a student's forward KL to its teacher's top-3 at those rows, the tail in a bin
    teacher_lp, teacher_ids = distill.teacher_top_k(torch.randn(5, v, generator=gen, dtype=torch.float64), 3, tau)
    split = [0, 3, 5]
    t_lp = [teacher_lp[a:b].float() for a, b in zip(split, split[1:])]
    t_ids = [teacher_ids[a:b] for a, b in zip(split, split[1:])]
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    before = len(seen.events)
    div = response_distillation_from_hidden(x, w, t_lp, t_ids, layout, temperature=tau)
    torch.autograd.backward(sum(((d * s).sum() for d, s in zip(div, (g_lp[:3], g_lp[3:]))), torch.zeros(())))
    assert launched(seen, before) == DEFAULT_KERNELS
    h64, w64 = hidden[rows].double().requires_grad_(), weight.double().requires_grad_()
    student = torch.log_softmax(h64 @ w64.T / tau, -1).gather(1, teacher_ids)
    ref = distill.divergence(student, teacher_lp.float().double(), "forward", 0.5, "bin")
    (ref * g_lp.double()).sum().backward()  # type: ignore[no-untyped-call]
    assert h64.grad is not None and w64.grad is not None and x.grad is not None
    close(hidden, weight, tau, (torch.cat(div), x.grad[rows], w.grad), (ref.detach(), h64.grad, w64.grad))


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
