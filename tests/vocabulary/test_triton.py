"""The Triton backend's default kernels on the CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``, set for the session by conftest.py): ``log_probs_and_entropy``,
``log_probs_at`` and ``topk_log_probs`` with every softmax option against float64, values
and gradients; a Triton launch is asserted for each (a silent fallback to another backend
fails); TP 2 on gloo ranks; the ``CPSLICE_BACKEND`` setting and its refusals.
tests/vocabulary/test_triton_cuda.py runs the same natively where a GPU exists."""

import math
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import (
    Layout,
    _probe,
    log_probs_and_entropy,
    log_probs_at,
    response_log_probs,
    response_rows,
    shifted_targets,
    topk_log_probs,
)
from cpslice._vocab.backends import selection as backend

from ..support import tp_cases
from ..support._dist import run_distributed, tp_groups
from ..support.reference import support_reference
from ..support.token_sets import csr
from ..support.triton_cases import OPTIONS, launched, logits, reference

pytest.importorskip("triton")  # in the dev install (requirements-dev.txt): never skipped by `make test`

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture
def triton_backend() -> Iterator[None]:
    with backend.using("triton"):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_log_probs_and_entropy_against_float64(triton_backend: None, seen: _probe.Seen, dtype: torch.dtype,
                                               options: dict[str, Any]) -> None:
    t, v = 6, 700
    opts = dict(options)
    if opts.get("temperature") == "per-row":
        opts["temperature"] = torch.linspace(0.5, 1.5, t)
    with_entropy = opts.pop("with_entropy", True)
    entropy_grad = opts.get("entropy_grad", True)
    vocab = opts.get("vocab_size")
    x0 = logits(t, v, dtype, 1)
    targets = torch.tensor([0, 500, 699, 3, 250, 11]) % (vocab or v)
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    lp, h = log_probs_and_entropy(x, targets, with_entropy=with_entropy, **opts)
    assert launched(seen, before) == {"default.stats"}
    g_lp, g_h = torch.randn(t), torch.randn(t)
    use_h = with_entropy and entropy_grad
    loss = (lp * g_lp).sum() + ((h * g_h).sum() if use_h and h is not None else 0.0)
    loss.backward()
    assert launched(seen, before) == {"default.stats", "default.grad"}
    ref_lp, ref_h, ref_grad = reference(x0, targets[:, None], opts.get("temperature", 1.0), opts.get("softcap"),
                                         vocab, g_lp[:, None], g_h if use_h else torch.zeros(t))
    torch.testing.assert_close(lp.double(), ref_lp[:, 0], rtol=0, atol=2e-5)
    if with_entropy:
        assert h is not None
        torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=2e-5)
    assert x.grad is not None and x.grad.dtype == dtype
    # float32: a few roundings; bfloat16: the gradient's own rounding (8 bits)
    rel = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=rel, atol=rel * float(ref_grad.abs().max()))
    if vocab is not None:
        assert not x.grad[:, vocab:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_probs_at_repeated_ids_and_topk(triton_backend: None, seen: _probe.Seen, dtype: torch.dtype) -> None:
    t, v = 5, 600
    x0 = logits(t, v, dtype, 2)
    ids = torch.tensor([[3, 3, 599], [0, 400, 400], [599, 1, 2], [7, 7, 7], [100, 200, 300]])
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    lp = log_probs_at(x, ids, temperature=0.9, softcap=25.0)
    g = torch.randn(t, 3)
    (lp * g).sum().backward()  # type: ignore[no-untyped-call]
    assert launched(seen, before) == {"default.stats", "default.grad"}
    ref_lp, _, ref_grad = reference(x0, ids, 0.9, 25.0, None, g, torch.zeros(t))
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    assert x.grad is not None
    rel = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=rel, atol=rel * float(ref_grad.abs().max()))

    x = x0.clone().requires_grad_()
    before = len(seen.events)
    top, top_ids = topk_log_probs(x, 4, temperature=0.9)
    g = torch.randn(t, 4)
    (top * g).sum().backward()  # type: ignore[no-untyped-call]
    assert {"default.stats", "default.grad"} <= launched(seen, before)
    ref_lp, _, ref_grad = reference(x0, top_ids, 0.9, None, None, g, torch.zeros(t))
    want = torch.log_softmax(x0.double() / 0.9, -1).topk(4, -1)
    torch.testing.assert_close(top.double(), want.values, rtol=0, atol=2e-5)
    torch.testing.assert_close(top.double(), ref_lp, rtol=0, atol=2e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=rel, atol=rel * float(ref_grad.abs().max()))


def test_response_rows_by_index_with_a_temperature_per_sample(triton_backend: None, seen: _probe.Seen) -> None:
    """The kernels given the response rows as an index (``response_log_probs``), each row
    with its sample's temperature: a program reads the temperature of the row it
    computes, not of its place in the index, and the gradient kernel writes those rows
    only (every other gradient row stays zero)."""
    total, response, temperatures, v = [7, 5, 6], [3, 2, 2], [0.6, 1.4, 0.9], 300
    layout = Layout(total, response)
    gen = torch.Generator().manual_seed(8)
    tokens = [torch.randint(0, v, (t,), generator=gen) for t in total]
    x0 = logits(sum(total), v, torch.float32, 8)  # row 1, a prompt row, all -inf
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    lp, h = response_log_probs(x, tokens, layout, with_entropy=True, temperature=temperatures)
    assert launched(seen, before) == {"default.stats"}
    assert [e.rows for e in seen.of("launch", name="default.stats")[-1:]] == [sum(response)]
    g_lp, g_h = torch.randn(sum(response), generator=gen), torch.randn(sum(response), generator=gen)
    torch.autograd.backward((torch.cat(lp) * g_lp).sum() + (torch.cat(h) * g_h).sum())
    assert launched(seen, before) == {"default.stats", "default.grad"}
    read = response_rows(layout)
    tau = torch.tensor(temperatures).repeat_interleave(torch.tensor(read.counts))
    targets = shifted_targets(tokens, layout)[read.rows]
    ref_lp, ref_h, ref_grad = reference(x0[read.rows], targets[:, None], tau, None, None, g_lp[:, None], g_h)
    torch.testing.assert_close(torch.cat(lp).double(), ref_lp[:, 0], rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.cat(h).double(), ref_h, rtol=0, atol=2e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad[read.rows].double(), ref_grad, rtol=2e-6, atol=2e-6 * float(ref_grad.abs().max()))
    others = torch.ones(sum(total), dtype=torch.bool).index_fill_(0, read.rows, False)
    assert not x.grad[others].any()


def test_empty_and_all_masked_rows(triton_backend: None) -> None:
    x = torch.full((3, 300), -math.inf)
    x[0] = torch.randn(300)
    x[2, 5] = 0.0
    x.requires_grad_()
    lp, h = log_probs_and_entropy(x, torch.tensor([1, 0, 5]), with_entropy=True)
    assert lp[2] == 0 and h[2] == 0  # one finite logit: p = 1
    empty = torch.zeros((0, 300), requires_grad=True)
    lp0, _ = log_probs_and_entropy(empty, torch.zeros(0, dtype=torch.int64))
    assert lp0.shape == (0,)


def test_backend_setting_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in [(None, "auto"), ("", "auto"), ("auto", "auto"), ("eager", "eager"),
                        ("compiled", "compiled"), ("triton", "triton")]:
        if value is None:
            monkeypatch.delenv("CPSLICE_BACKEND", raising=False)
        else:
            monkeypatch.setenv("CPSLICE_BACKEND", value)
        assert backend.setting() == want
    # a value with spaces around it, or of spaces only, is no name either: refused
    for bad in ("1", "0", "cuda", "Triton", "inductor", " triton", "eager ", "  "):
        monkeypatch.setenv("CPSLICE_BACKEND", bad)
        with pytest.raises(ValueError, match=rf"CPSLICE_BACKEND='{bad}' is not valid; use one of.*'auto'.*'eager'"
                                             r".*'compiled'.*'triton'"):
            backend.setting()


def test_triton_on_a_cpu_tensor_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch, seen: _probe.Seen) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with backend.using("triton"), pytest.raises(RuntimeError, match="CPSLICE_BACKEND=triton runs on CUDA tensors"):
        log_probs_and_entropy(torch.randn(2, 5), torch.tensor([0, 1]))
    # auto never takes Triton for a CPU tensor
    before = len(seen.events)
    with backend.using("auto"):
        log_probs_and_entropy(torch.randn(2, 5), torch.tensor([0, 1]))
    assert launched(seen, before) == set()


def test_float64_falls_back(triton_backend: None, seen: _probe.Seen) -> None:
    """float64 logits are not the Triton kernels' (documented): the selection falls back."""
    before = len(seen.events)
    x = torch.randn(3, 50, dtype=torch.float64, requires_grad=True)
    lp, _ = log_probs_and_entropy(x, torch.tensor([0, 1, 2]))
    lp.sum().backward()  # type: ignore[no-untyped-call]
    assert launched(seen, before) == set()
    torch.testing.assert_close(lp, torch.log_softmax(x.detach(), -1)[[0, 1, 2], [0, 1, 2]])


def tp_worker(rank: int, world: int) -> list[tuple[int, int]]:
    """tests/support/tp_cases.py's logits cases through the Triton kernels at every TP size of the
    world: one all-gather forward, none backward, float64 references."""
    done = []
    with backend.using("triton"), _probe.watch() as seen:
        for group, tp, tp_rank in tp_groups(rank, world):
            before = len(seen.events)
            done.append((tp, tp_cases._run_logits(tp_cases.LOGITS_CASES, group, tp, tp_rank, seen)))
            assert {"default.stats", "default.grad"} <= launched(seen, before)
    dist.barrier()
    return done


def test_tensor_parallel_on_gloo() -> None:
    results = run_distributed(tp_worker, 2, timeout=200)
    assert all(dict(r)[2] == len(tp_cases.LOGITS_CASES) for r in results)


@pytest.mark.parametrize("over", ["full", "support"])
def test_supports_against_float64(triton_backend: None, seen: _probe.Seen, over: Literal["full", "support"]) -> None:
    """A support's set statistics stay in torch; the dense ones (every row with entropy
    over the full vocabulary, the rows without a set) are the Triton kernels'."""
    t, v = 5, 400
    x0 = logits(t, v, torch.float32, 5)
    x0[1] = torch.randn(v)  # a set's row with finite logits
    targets = torch.tensor([3, 17, 399, 0, 250])
    sets = [[1, 2, 3, 100], [17], [], [5, 6, 350, 399], list(range(0, 400, 7))]
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    lp, h = log_probs_and_entropy(x, targets, with_entropy=True, temperature=0.8, support=csr(sets),
                                  entropy_over=over)
    g_lp, g_h = torch.randn(t), torch.randn(t)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()  # type: ignore[no-untyped-call]
    assert {"default.stats", "default.grad"} <= launched(seen, before)
    ref_lp, ref_h, ref_grad = support_reference(x0, targets, sets, 0.8, over, g_lp, g_h)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=2e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=2e-6, atol=2e-6 * float(ref_grad.abs().max()))


INVARIANT_OPTIONS: list[dict[str, Any]] = [
    {},
    {"temperature": 0.7},
    {"temperature": "per-row", "softcap": 15.0},
    {"vocab_size": 650, "softcap": 30.0},
]


def _invariant_call(which: str, x0: Tensor, targets: Tensor, opts: dict[str, Any],
                    tp_group: Any = None) -> tuple[Tensor, ...]:
    """log-prob, entropy, the gradient and top-3 (values, ids) of ``invariant=True`` under
    the backend ``which``."""
    with backend.using(which):
        x = x0.clone().requires_grad_()
        lp, h = log_probs_and_entropy(x, targets, with_entropy=True, invariant=True, tp_group=tp_group, **opts)
        g = torch.linspace(-1, 1, x0.shape[0])
        ((lp * g).sum() + (h * g.flip(0)).sum()).backward()
        top_opts = {k: v for k, v in opts.items() if k != "entropy_grad"}
        top, ids = topk_log_probs(x0, 3, invariant=True, tp_group=tp_group, **top_opts)
    assert x.grad is not None
    return lp.detach(), h.detach(), x.grad, top, ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", INVARIANT_OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_invariant_mode_gives_the_eager_bits(seen: _probe.Seen, dtype: torch.dtype, options: dict[str, Any]) -> None:
    t, v = 5, 700
    opts = dict(options)
    if opts.get("temperature") == "per-row":
        opts["temperature"] = torch.linspace(0.5, 1.5, t)
    x0 = logits(t, v, dtype, 6)
    x0[3, :10] = x0[3, 10:20]  # ties for the top-k
    targets = torch.tensor([0, 500, 649, 3, 250])
    before = len(seen.events)
    got = _invariant_call("triton", x0, targets, opts)
    assert {"invariant_tiles", "invariant_merge", "invariant_grad"} <= launched(seen, before)
    want = _invariant_call("eager", x0, targets, opts)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_mode_without_an_entropy_gradient_gives_the_eager_bits(seen: _probe.Seen,
                                                                         dtype: torch.dtype) -> None:
    """``entropy_grad=False``: the gradient kernel's entropy coefficient is zero (no ``a``)."""
    x0 = logits(4, 400, dtype, 9)
    targets = torch.tensor([5, 300, 399, 17])
    before = len(seen.events)
    got = _invariant_call("triton", x0, targets, {"entropy_grad": False, "temperature": 0.8})
    assert "invariant_grad" in launched(seen, before)
    want = _invariant_call("eager", x0, targets, {"entropy_grad": False, "temperature": 0.8})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_invariant_mode_takes_float16_logits_off_the_triton_kernels(seen: _probe.Seen) -> None:
    """Invariant mode's Triton kernels take float32 and bfloat16 (its spec's dtypes):
    float16 logits fall back with ``triton`` selected (no Triton launch), to the eager bits."""
    x0 = logits(4, 400, torch.float16, 10)
    targets = torch.tensor([5, 300, 399, 17])
    before = len(seen.events)
    got = _invariant_call("triton", x0, targets, {"temperature": 0.8})
    assert launched(seen, before) == set()
    want = _invariant_call("eager", x0, targets, {"temperature": 0.8})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def invariant_tp_worker(rank: int, world: int) -> int:
    """Invariant mode through the Triton kernels at TP 2: the bits of the eager backend at
    TP 1 on the whole rows (each rank's gradient its shard's columns)."""
    checked = 0
    with _probe.watch() as seen:
        _invariant_at_tp_2(rank, seen)
        checked = len(DTYPES) * len(INVARIANT_OPTIONS)
    dist.barrier()
    return checked


def _invariant_at_tp_2(rank: int, seen: _probe.Seen) -> None:
    for dtype in DTYPES:
        for options in INVARIANT_OPTIONS:
            opts = dict(options)
            if opts.get("temperature") == "per-row":
                opts["temperature"] = torch.linspace(0.5, 1.5, 5)
            if "vocab_size" in opts:
                opts["vocab_size"] = 700
            full = logits(5, 768, dtype, 7)
            targets = torch.tensor([0, 500, 699, 3, 250])
            shard = full[:, rank * 384 : (rank + 1) * 384].contiguous()
            before = len(seen.events)
            got = _invariant_call("triton", shard, targets, opts, dist.group.WORLD)
            assert {"invariant_tiles", "invariant_merge", "invariant_grad"} <= launched(seen, before)
            want = _invariant_call("eager", full, targets, opts)
            cols = slice(rank * 384, (rank + 1) * 384)
            for i, (g, w) in enumerate(zip(got, want)):
                w = w[:, cols] if i == 2 else w
                assert g.dtype == w.dtype and torch.equal(g, w), (dtype, options, i)


def test_invariant_mode_at_tp_2_on_gloo() -> None:
    assert run_distributed(invariant_tp_worker, 2, timeout=200) == [8, 8]
