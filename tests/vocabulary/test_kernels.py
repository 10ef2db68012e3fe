"""The compiled chunk kernels (cpslice._vocab.kernels): CPSLICE_BACKEND, the fixed chunk
shapes, and log_probs_and_entropy through the compiled path against the float64
reference, every dtype (with TP: tests/support/tp_cases.py, on test_logprob_tp's ranks), in
debug mode (the pytest plugin).

Most compiled-path tests trace with dynamo's ``aot_eager`` backend: the same captured
and functionalized graphs that inductor compiles, without its C++ build (seconds per
kernel on two cores). Two tests run inductor itself, on tiny shapes."""

import contextlib
import importlib
import importlib.util
import math
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpslice import _probe, log_probs_and_entropy
from cpslice._vocab import invariant as _invariant
from cpslice._vocab import kernels as _kernels
from cpslice._vocab.backends import compiled as _compiled
from cpslice._vocab.backends import selection as _backend
from cpslice._vocab.backends.chunks import Chunks, compiled_chunk_rows
from cpslice._vocab.gradient import RowGrad
from cpslice._vocab.memory import buffer
from cpslice._vocab.rows import chunk_starts
from cpslice._vocab.softmax import Softmax
from cpslice._vocab.spec import FLOOR
from cpslice._vocab.stats import placeholders

from ..support.compare import check_linear, check_logits
from ..support.compiled import ran
from ..support.reference import reference, tolerance

Use = Callable[..., None]  # use(mode, backend="aot_eager")


MODE = {"1": "compiled", "0": "eager", "auto": "auto"}  # the compiled kernels' modes, by backend


@pytest.fixture
def use() -> Iterator[Use]:
    """``use(mode, compiler)`` for one test: the backend of the mode (``1`` compiled, ``0``
    eager, ``auto``) with ``compiler`` as torch.compile's backend, no compiled kernel run,
    verified or broken yet; the selection is restored after the test (``backend.using``)."""
    with contextlib.ExitStack() as stack:
        def set_(mode: str, compiler: str | Callable[..., Any] = "aot_eager") -> None:
            stack.enter_context(_backend.using(MODE[mode], compiler=compiler, fresh=True))

        yield set_


def test_compile_mode_of_each_backend() -> None:
    for name, want in [("auto", "auto"), ("compiled", "1"), ("eager", "0"), ("triton", "auto")]:
        with _backend.using(name):
            assert _backend.compile_mode() == want
    for bad in ("yes", "1", "0", "AUTO"):
        with pytest.raises(ValueError, match=rf"CPSLICE_BACKEND='{bad}' is not valid; use one of.*'auto'.*'eager'"):
            _backend.setting(bad)


def _import_a_copy() -> ModuleType:
    """A fresh copy of the kernels module, imported beside it: the real one (whose classes
    the other modules' annotations hold) is left as it is."""
    spec = importlib.util.spec_from_file_location("cpslice._vocab.backends.selection_copy", _backend.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_invalid_value_is_refused_where_a_backend_is_first_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at import, refused by ``current`` (what every kernel's choice reads), not by the
    import: what needs no backend still works (tests/cli/test_cli_plan.py runs a fresh
    interpreter with one)."""
    for bad in ("on", " eager", "   "):
        monkeypatch.setenv("CPSLICE_BACKEND", bad)
        copy = _import_a_copy()
        with pytest.raises(ValueError, match=rf"^CPSLICE_BACKEND='{bad}' is not valid; use one of[^\n]*'triton'"):
            copy.current()
        with pytest.raises(ValueError, match=rf"CPSLICE_BACKEND='{bad}' is not valid"):
            copy.compile_mode()
        with copy.using("eager"):  # the seam's choice replaces the refused one for the block
            assert copy.current() == "eager"
        with pytest.raises(ValueError, match="is not valid"):
            copy.current()
    monkeypatch.setenv("CPSLICE_BACKEND", "eager")
    copy = _import_a_copy()
    assert copy.selected.name == copy.current() == "eager"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 70), st.integers(1, 16))
def test_chunk_starts_cover_every_row_with_one_shape(rows: int, chunk: int) -> None:
    c, starts = chunk_starts(rows, chunk)
    if rows == 0:
        assert starts == []
        return
    # The shape: the given chunk, or for fewer rows the largest power of two <= rows.
    want = chunk if rows >= chunk else max(2**k for k in range(8) if 2**k <= rows)
    assert c == want
    assert all(0 <= s and s + c <= rows for s in starts)
    covered = [0] * rows
    for s in starts:
        for i in range(s, s + c):
            covered[i] += 1
    assert min(covered) >= 1
    assert len(starts) == -(-rows // c)  # ceil: at most one chunk of redundant rows
    assert sum(covered) - rows < c


def test_compiled_chunk_rows() -> None:
    assert compiled_chunk_rows(32768) == 256  # 256 x 128 KiB = 32 MiB
    assert compiled_chunk_rows(32768, torch.bfloat16) == 256  # float32 arithmetic
    assert compiled_chunk_rows(151936, torch.float32, "cuda") == 1024  # 1766 -> 1024
    assert compiled_chunk_rows(1000, torch.float64) == 4096  # 4194 -> 4096
    assert compiled_chunk_rows(10**9) == 1


def test_auto_runs_eager_for_small_work(use: Use, seen: _probe.Seen) -> None:
    use("auto")
    logits = torch.randn(8, 16, requires_grad=True)
    lp, _ = log_probs_and_entropy(logits, torch.zeros(8, dtype=torch.int64), chunk_size=4)
    torch.autograd.backward(lp.sum())
    assert seen.count("launch", backend="compiled") == 0
    assert seen.count("launch", backend="eager") == 4  # two chunks of 4 rows, forward and backward
    assert not _compiled.use_compiled(torch.zeros(2**11, 2**10))
    assert _compiled.use_compiled(torch.zeros(2**12, 2**10))
    assert not _compiled.use_compiled(torch.zeros(2**10, 2**12).t())  # not contiguous


def _masked_logits(t: int, v: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=gen) * 3
    logits[1, v // 2 :] = -math.inf  # masked tokens
    logits[2, :-1] = -math.inf  # all but one masked: p = 1
    logits[3, 5] += 1e4  # peaked
    targets = torch.randint(0, v // 2, (t,), generator=gen)
    targets[2] = v - 1
    return logits.to(dtype), targets


DTYPES = [(torch.float32, 16 * 2.0**-24), (torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float64, 1e-5)]


@pytest.mark.parametrize(("dtype", "grad_rtol"), DTYPES)
def test_compiled_path_matches_float64_reference(
    dtype: torch.dtype, grad_rtol: float, use: Use, seen: _probe.Seen
) -> None:
    use("1")
    for t, chunk, temperature in [(11, 4, 0.7), (6, None, 1.0), (5, 8, 1.7)]:
        logits, targets = _masked_logits(t, 24, dtype, seed=t)
        check_logits(logits, targets, temperature, chunk, grad_rtol=grad_rtol)
    # 11 rows in chunks of 4 (starts 0, 4, 7); 6 and 5 rows below their chunk: 4 rows.
    assert ran(seen, 4) == {"chunk_stats", "chunk_grad"}


def test_compiled_path_without_entropy_and_all_masked_row(use: Use, seen: _probe.Seen) -> None:
    logits, targets = _masked_logits(9, 20, torch.float32, seed=3)
    logits[4] = -math.inf  # NaN log-prob, and NaN gradient on that row, as eager
    g = torch.randn(9)
    keep = torch.arange(9) != 4
    ref_lp, _, ref_grad = reference(logits[keep], targets[keep], 0.5, g[keep], torch.zeros(8))
    grads = []
    for mode in ("1", "0"):
        use(mode)
        x = logits.clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy(x, targets, temperature=0.5, chunk_size=4)
        assert ent is None
        assert math.isnan(float(lp[4].detach()))
        torch.autograd.backward((lp[keep] * g[keep]).sum())
        torch.testing.assert_close(lp[keep].double(), ref_lp, rtol=0, atol=tolerance(logits[keep], 0.5))
        assert x.grad is not None
        torch.testing.assert_close(x.grad[keep].double(), ref_grad, rtol=1e-5, atol=1e-6)
        grads.append(x.grad[4])
    assert torch.isnan(grads[0]).all() and torch.isnan(grads[1]).all()
    assert ran(seen, 4) == {"chunk_stats", "chunk_grad"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_masked_target_gets_the_same_finite_gradient_compiled_and_eager(
    dtype: torch.dtype, use: Use, seen: _probe.Seen
) -> None:
    """A row whose target logit is -inf (a masked token): its log-prob is -inf, and the
    gradient of its entropy (and of the log-prob) is finite, the eager one, in the
    compiled kernels too, whose picked entries are written apart (``gradient.pick_grad``)."""
    logits, targets = _masked_logits(9, 20, dtype, seed=8)
    logits[1, 15], targets[1] = -math.inf, 15  # the target among the masked columns
    logits[6, 3], targets[6] = -math.inf, 3  # one masked column, the target's
    gen = torch.Generator().manual_seed(8)
    g_lp, g_h = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    g_lp[1] = 0.0  # row 1: the entropy's gradient alone; row 6: both
    grads = []
    for mode in ("1", "0"):
        use(mode)
        for temperature in (1.0, 0.6):
            x = logits.clone().requires_grad_(True)
            lp, ent = log_probs_and_entropy(x, targets, with_entropy=True, temperature=temperature, chunk_size=4)
            assert lp[1] == lp[6] == -math.inf
            torch.autograd.backward([lp, ent], [g_lp, g_h])
            assert x.grad is not None
            assert bool(x.grad.isfinite().all()), (mode, x.grad[[1, 6]])
            grads.append(x.grad)
    for compiled, eager in zip(grads[:2], grads[2:]):
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(compiled.double(), eager.double(), rtol=0, atol=atol)
    assert ran(seen, 4) == {"chunk_stats", "chunk_grad"}


def test_eager_and_compiled_chunk_functions_agree(use: Use) -> None:
    """The pure chunk functions called eagerly (as another path may) equal the compiled
    ones and the float64 statistics."""
    use("1")
    logits, _ = _masked_logits(8, 32, torch.float32, seed=4)
    eager = _compiled.chunk_stats(logits, torch.tensor(1 / 0.8))
    out = placeholders(8, 1, torch.float32, logits.device, with_entropy=True)
    _kernels.stats(logits, Softmax(0.8), out, chunks=Chunks(8, 8))
    assert out.ent is not None
    compiled = (out.max, out.sum, out.ent)
    x = logits.double()
    m = x.amax(1)
    d = ((x - m[:, None]) / 0.8).clamp(min=FLOOR)
    want = (m, d.exp().sum(1), (d.exp() * d).sum(1))
    for e, c, w in zip(eager, compiled, want, strict=True):
        torch.testing.assert_close(e.double(), w)
        torch.testing.assert_close(c.double(), w)


def test_auto_falls_back_to_eager_once_with_one_warning(use: Use) -> None:
    """A compiler that fails (a torch.compile backend that raises): ``auto`` warns once and
    computes eagerly, then stays eager silently, even for work large enough to compile
    (``T * V >= 2**22``, docs/dev/backends.md); ``compiled`` makes it an error."""
    def broken_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    use("auto", broken_backend)
    big = torch.randn(2**10, 2**12, generator=torch.Generator().manual_seed(5))  # 2**22 elements: compiled
    ids = torch.zeros(2**10, dtype=torch.int64)
    with pytest.warns(RuntimeWarning, match="torch.compile of the log-prob kernels failed.*no C\\+\\+ compiler"):
        with _probe.watch() as seen:
            want = log_probs_and_entropy(big, ids, with_entropy=True)
    assert seen.count("launch", backend="compiled") == 0 and seen.rows("launch", backend="eager") == 2**10
    with warnings.catch_warnings(), _probe.watch() as seen:
        warnings.simplefilter("error")
        got = log_probs_and_entropy(big, ids, with_entropy=True)  # eager from now on, silently
    assert seen.count("launch", backend="compiled") == 0 and seen.rows("launch", backend="eager") == 2**10
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    logits, targets = _masked_logits(7, 12, torch.float32, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_logits(logits, targets, 0.9, 3)
    use("1", broken_backend)
    with pytest.raises(RuntimeError,
                       match="CPSLICE_BACKEND=compiled but torch.compile of cpslice's chunk_stats failed"):
        log_probs_and_entropy(logits, targets, chunk_size=3)


@pytest.mark.parametrize("mode", ["1", "0"], ids=["compiled", "eager"])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_the_rows_of_an_index_are_computed_in_full_chunks(mode: str, invariant: bool, use: Use) -> None:
    """``rows`` an index of every third row (runs of one row): the compiled kernels take
    them in full chunks of selected rows (two of 8 for 13 rows, where a chunk per run
    would take 13 of one: read in place by the default kernels, gathered by invariant
    mode's), the eager loop in pieces of its chunk; each row's statistics and gradient
    are those of the selected rows as a tile of their own (to the default compiled
    kernels' rounding: another compiled loop), and no other row is read (NaN there) or
    written (its placeholders, its gradient's 7s)."""
    use(mode)  # each compiled shape checked again
    gen = torch.Generator().manual_seed(9)
    t, v = 40, 24
    rows = torch.arange(1, t, 3)  # 13 rows
    x = torch.full((t, v), math.nan)
    x[rows] = torch.randn(rows.numel(), v, generator=gen) * 3
    tau = torch.rand(t, generator=gen) + 0.5
    a, b = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    column = torch.randint(0, v, (t, 2), generator=gen)
    grad_terms = RowGrad(a, b, torch.randn(t, 2, generator=gen), column)
    chunks = Chunks(4, 8)
    stats_fn: Any = _invariant.stats if invariant else _kernels.stats
    grad_fn: Any = _invariant.grad if invariant else _kernels.grad

    def both(x: torch.Tensor, tau: torch.Tensor, terms: RowGrad, index: torch.Tensor | None) -> tuple[Any, Any]:
        n = x.shape[0]
        out = placeholders(n, 0, torch.float32, x.device, True)
        if invariant:
            stats_fn(x, Softmax(tau), v, out, index, chunks.eager)
        else:
            stats_fn(x, Softmax(tau), out, chunks=chunks, rows=index)
        grad = torch.full((n, v), 7.0)
        grad_fn(x, out.max, torch.log(out.sum), Softmax(tau), terms, grad, chunks=chunks, rows=index)
        return out, grad

    with _probe.watch() as seen:
        out, grad = both(x, tau, grad_terms, rows)
    # a compiled chunk's rows, gathered or read in place
    asked = [e.rows for e in seen.of("launch", backend="compiled", invariant=invariant)]
    want, want_grad = both(x[rows], tau[rows], grad_terms.rows(rows), None)
    for got, expected in zip(out, want):
        if got is not None and expected is not None and got.dim() == 1:
            assert torch.equal(got[rows], expected)
    assert torch.equal(grad[rows], want_grad)
    others = torch.ones(t, dtype=torch.bool).index_fill_(0, rows, False)
    assert bool((out.max[others] == 0).all() and (out.sum[others] == 1).all()), "a row outside was written"
    assert bool((grad[others] == 7.0).all()), "a gradient row outside was written"
    if mode == "1":
        assert asked == [8, 8, 8, 8], asked  # forward and backward: two full chunks each
    else:
        assert asked == [] and seen.rows("launch", backend="eager", invariant=invariant) == 2 * 13
    assert [e.rows for e in seen.of("call")] == [13, 13]  # stats and grad, the index's rows


@pytest.mark.parametrize(("dtype", "grad_rtol"), DTYPES[:2])
def test_inductor_kernels_match_float64_reference(
    dtype: torch.dtype, grad_rtol: float, use: Use, seen: _probe.Seen
) -> None:
    use("1", "inductor")
    logits, targets = _masked_logits(11, 24, dtype, seed=6)
    check_logits(logits, targets, 0.7, 4, grad_rtol=grad_rtol)
    assert ran(seen, 4) == {"chunk_stats", "chunk_grad"}


def _vma_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_gradient_buffer_is_advised_huge_pages_and_zeroed_on_request() -> None:
    shape = (1024, 16384)  # 64 MiB of float32
    zeroed = buffer(shape, torch.float32, torch.device("cpu"), zero=True)
    assert zeroed.shape == shape and zeroed.is_contiguous() and not zeroed.any()
    small = buffer((8, 8), torch.bfloat16, torch.device("cpu"), zero=True)
    assert small.dtype == torch.bfloat16 and not small.any()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this system")
    if "[never]" in setting:
        pytest.skip("transparent huge pages are off on this system")
    big = buffer(shape, torch.float32, torch.device("cpu"), zero=False)
    middle = big.data_ptr() + big.numel() * big.element_size() // 2
    assert "hg" in _vma_flags(middle)  # MADV_HUGEPAGE landed on the buffer's mapping
    assert "hg" not in _vma_flags(small.data_ptr())


@pytest.mark.parametrize(
    ("dtype", "value_rel", "grad_rel"),
    [(torch.float32, 2.0**-18, 1e-5), (torch.bfloat16, 2.0**-7, 3e-2)],
)
def test_hidden_state_path_runs_the_compiled_kernels(
    dtype: torch.dtype, value_rel: float, grad_rel: float, use: Use, seen: _probe.Seen
) -> None:
    """log_probs_and_entropy_from_hidden through the compiled kernels, forward and backward on
    its [rows, V_block] tiles; values and gradients against the float64 reference."""
    use("1")
    gen = torch.Generator().manual_seed(8)
    t, h, v = 12, 4, 24
    hidden, weight = torch.randn(t, h, generator=gen).to(dtype), torch.randn(v, h, generator=gen).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen)
    check_linear(hidden, weight, targets, 0.8, 4, value_rel=value_rel, grad_rel=grad_rel)
    # forward and backward on the same six [12, 4 * 24 // (2 * 12) = 4] tiles, each in two
    # compiled chunks of 8 rows (the second overlapping the first)
    assert ran(seen, 8) == {"chunk_stats", "chunk_grad"}
    assert seen.count("launch", backend="compiled") == 24 and seen.count("launch", backend="eager") == 0
