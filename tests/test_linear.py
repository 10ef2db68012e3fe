"""log_probs_and_entropy_from_hidden and response_log_probs_from_hidden without TP, against a
float64 reference (``log_softmax(hidden @ weight.T / temperature)``): values, the
gradients of hidden and weight, chunking, dtypes, temperatures, entropy_grad, every
refusal, and no tensor of ``[T, V]`` size anywhere in forward or backward."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpslice import (
    Layout,
    LayoutError,
    log_probs_and_entropy_from_hidden,
    pack,
    response_log_probs_from_hidden,
    shard_responses,
)
from tests.checked import refused

from .compare import check_linear
from .lengths import edge_lengths
from .reference import EPS32, TEMPS, grad_close, linear_reference

PROPS = settings(max_examples=15, deadline=None)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, float, int | None]:
    t, h, v = draw(st.integers(0, 12)), draw(st.integers(1, 9)), draw(st.integers(1, 30))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    hidden = torch.randn(t, h, generator=gen) * scale
    weight = torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (t,), generator=gen)
    chunk = draw(st.sampled_from([None, 1, 2, 5, 1000]))
    return hidden, weight, targets, draw(st.sampled_from(TEMPS)), chunk


@PROPS
@given(cases())
def test_float32_matches_float64_reference(case: tuple[Tensor, Tensor, Tensor, float, int | None]) -> None:
    hidden, weight, targets, temperature, chunk = case
    check_linear(hidden, weight, targets, temperature, chunk)


@PROPS
@given(cases())
def test_bfloat16_matches_float64_of_its_values(
    case: tuple[Tensor, Tensor, Tensor, float, int | None],
) -> None:
    # The chunk logits are bf16 (as the materialized head's are; the reference rounds
    # them too); statistics in float32; the gradients come back in bfloat16.
    hidden, weight, targets, temperature, chunk = case
    check_linear(hidden.bfloat16(), weight.bfloat16(), targets, temperature, chunk,
          value_rel=2.0**-7, grad_rel=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(7, 5, generator=gen).to(dtype), torch.randn(9, 5, generator=gen).to(dtype)
    targets = torch.randint(0, 9, (7,), generator=gen)
    if dtype == torch.float64:
        check_linear(hidden, weight, targets, 1.7, 3, value_rel=1e-12, grad_rel=1e-10)
    else:
        check_linear(hidden, weight, targets, 1.7, 3, value_rel=2.0**-9, grad_rel=1e-2)


def test_float64_gradcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(7, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 7, (5,), generator=gen)

    def both(h: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        return log_probs_and_entropy_from_hidden(h, w, targets, with_entropy=True, temperature=0.8,
                                            chunk_size=2)

    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_peaked_rows_and_large_logits() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 8, generator=gen)
    weight = torch.randn(40, 8, generator=gen)
    hidden[0] *= 300.0  # logits in the thousands: a one-hot distribution
    targets = torch.randint(0, 40, (6,), generator=gen)
    targets[0] = int((hidden[0] @ weight.T).argmax())
    for temperature in TEMPS:
        check_linear(hidden, weight, targets, temperature, 4, value_rel=64 * EPS32)
    logp, entropy = log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entropy=True)
    assert abs(float(logp[0])) < 1e-6 and abs(float(entropy[0])) < 1e-6


def test_chunk_sizes_agree() -> None:
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(37, 6, generator=gen).requires_grad_(True)
    weight = torch.randn(29, 6, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 29, (37,), generator=gen)
    got = []
    for chunk in (1, 4, 36, 37, 100, None):
        logp, entropy = log_probs_and_entropy_from_hidden(
            hidden, weight, targets, with_entropy=True, temperature=1.7, chunk_size=chunk
        )
        grads = torch.autograd.grad(logp.sum() + 2 * entropy.sum(), (hidden, weight))
        got.append((logp, entropy, *grads))
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_zero_rows(with_entropy: bool) -> None:
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(8, 4, requires_grad=True)
    logp, entropy = log_probs_and_entropy_from_hidden(
        hidden, weight, torch.zeros(0, dtype=torch.int64), with_entropy=with_entropy, chunk_size=3
    )
    assert logp.shape == (0,) and logp.dtype == torch.float32
    assert (entropy is None) == (not with_entropy)
    torch.autograd.backward(logp.sum() if entropy is None else logp.sum() + entropy.sum())
    assert hidden.grad is not None and hidden.grad.shape == (0, 4)
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros(8, 4))


def test_without_entropy_and_entropy_as_a_detached_metric() -> None:
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(7, 5, generator=gen)
    weight = torch.randn(11, 5, generator=gen)
    targets = torch.randint(0, 11, (7,), generator=gen)
    g = torch.randn(7, generator=gen)
    _, ref_h, ref_dh, ref_dw = linear_reference(hidden, weight, targets, 0.5, g, torch.zeros(7))
    for with_entropy in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, entropy = log_probs_and_entropy_from_hidden(
            h, w, targets, with_entropy=with_entropy, entropy_grad=False, temperature=0.5,
            chunk_size=2,
        )
        if with_entropy:
            assert entropy is not None and not entropy.requires_grad and entropy.grad_fn is None
            torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-5, atol=1e-6)
        else:
            assert entropy is None
        torch.autograd.backward((logp * g).sum())
        grad_close(h.grad, ref_dh, 1e-5)
        grad_close(w.grad, ref_dw, 1e-5)


@pytest.mark.parametrize("which", ["log_probs", "entropy", "hidden only", "weight only"])
def test_gradient_through_one_output_or_one_input(which: str) -> None:
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(6, 5, generator=gen)
    weight = torch.randn(13, 5, generator=gen)
    targets = torch.randint(0, 13, (6,), generator=gen)
    g, zero = torch.randn(6, generator=gen), torch.zeros(6)
    h = hidden.clone().requires_grad_(which != "weight only")
    w = weight.clone().requires_grad_(which != "hidden only")
    logp, entropy = log_probs_and_entropy_from_hidden(h, w, targets, with_entropy=True, chunk_size=4)
    if which == "entropy":
        torch.autograd.backward((entropy * g).sum())
        *_, ref_dh, ref_dw = linear_reference(hidden, weight, targets, 1.0, zero, g)
    else:
        torch.autograd.backward((logp * g).sum())
        *_, ref_dh, ref_dw = linear_reference(hidden, weight, targets, 1.0, g, zero)
    if which == "weight only":
        assert h.grad is None
    else:
        grad_close(h.grad, ref_dh, 1e-5)
    if which == "hidden only":
        assert w.grad is None
    else:
        grad_close(w.grad, ref_dw, 1e-5)


class _Sizes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the storage size (in elements) of every tensor an operator returns: a
    view or an expanded tensor counts what it really holds."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, Tensor):
                self.sizes.append((str(func), x.untyped_storage().nbytes() // x.element_size()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_a_tensor_of_logits_size(dtype: torch.dtype) -> None:
    t, h, v, chunk = 96, 8, 40, 8
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(t, h, generator=gen).to(dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (t,), generator=gen)
    with _Sizes() as sizes:
        logp, entropy = log_probs_and_entropy_from_hidden(
            hidden, weight, targets, with_entropy=True, temperature=0.9, chunk_size=chunk
        )
        torch.autograd.backward(logp.sum() + entropy.sum())
    biggest = max(n for _, n in sizes.sizes)
    # the inputs' gradients ([T, H], [V, H]) and [chunk, V] blocks; never T x V
    assert biggest <= max(t * h, v * h, chunk * v) < t * v, sorted(sizes.sizes, key=lambda s: -s[1])[:3]
    assert hidden.grad is not None and weight.grad is not None


GOOD_H, GOOD_W = torch.zeros(3, 4), torch.zeros(5, 4)
TARGETS = torch.tensor([0, 1, 4])


@pytest.mark.parametrize(
    ("hidden", "weight", "targets", "kwargs", "error", "match"),
    [
        ([[0.0]], GOOD_W, TARGETS, {}, TypeError, r"hidden must be a torch.Tensor \[T, H\]"),
        (GOOD_H, "w", TARGETS, {}, TypeError, r"weight must be a torch.Tensor \[V_local, H\]"),
        (GOOD_H.long(), GOOD_W, TARGETS, {}, TypeError, "hidden has dtype torch.int64"),
        (GOOD_H, GOOD_W.int(), TARGETS, {}, TypeError, "weight has dtype torch.int32"),
        (GOOD_H, GOOD_W.double(), TARGETS, {}, TypeError, "hidden has dtype torch.float32 but weight torch.float64"),
        (torch.zeros(12), GOOD_W, TARGETS, {}, LayoutError, r"hidden has shape \(12,\); it must be 2-D"),
        (GOOD_H, torch.zeros(5, 4, 1), TARGETS, {}, LayoutError, "weight has shape .* must be 2-D"),
        (GOOD_H, torch.zeros(0, 4), TARGETS, {}, LayoutError, "0 vocabulary rows"),
        (GOOD_H, torch.zeros(5, 3), TARGETS, {}, LayoutError, "hidden sizes 4 and 3 must agree"),
        (GOOD_H, GOOD_W, [0, 1, 4], {}, TypeError, "targets must be a torch.Tensor"),
        (GOOD_H, GOOD_W, TARGETS.int(), {}, TypeError, r"int32; pass int64 token ids"),
        (GOOD_H, GOOD_W, TARGETS[:2], {}, LayoutError, r"shape \(2,\) but hidden has 3 rows"),
        (GOOD_H, GOOD_W, TARGETS, {"temperature": 0.0}, LayoutError, "temperature=0.0 .* > 0"),
        (GOOD_H, GOOD_W, TARGETS, {"temperature": math.nan}, LayoutError, "finite"),
        (GOOD_H, GOOD_W, TARGETS, {"temperature": "1"}, TypeError, "temperature must be a real number"),
        (GOOD_H, GOOD_W, TARGETS, {"chunk_size": 0}, LayoutError, "chunk_size=0 .* >= 1"),
        (GOOD_H, GOOD_W, TARGETS, {"chunk_size": 2.0}, TypeError, "chunk_size 2.0 is a float, not an int"),
        (GOOD_H, GOOD_W, torch.tensor([0, 5, 1]), {}, LayoutError, r"targets\[1\] = 5 is outside .*\[0, 5\)"),
    ],
)
def test_refusals(
    hidden: object, weight: object, targets: object, kwargs: dict[str, object], error: type, match: str
) -> None:
    with refused(error, match):
        log_probs_and_entropy_from_hidden(hidden, weight, targets, **kwargs)  # type: ignore[call-overload]


# --- response_log_probs_from_hidden ---------------------------------------------------


@pytest.mark.parametrize("kind", ["none-thd", "none-bshd", "zigzag", "allgather"])
def test_response_shares_and_gradients_match_the_reference(kind: str) -> None:
    """Each CP rank's shares equal the float64 reference at its positions; its hidden
    gradient the reference at its rows (zero elsewhere); the weight gradients of the
    ranks sum to the reference's."""
    cp = 1 if kind.startswith("none") else 3
    total, response = edge_lengths(9, cp, 0)
    gen = torch.Generator().manual_seed(12)
    h_size, vocab, temperature = 6, 23, 0.8
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    hiddens = [torch.randn(t, h_size, generator=gen) for t in total]
    weight = torch.randn(vocab, h_size, generator=gen)
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    w_ent = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    ref_lp, ref_ent, ref_dh = [], [], []
    wd = weight.double().requires_grad_(True)
    for t, r, tok, hs, a, b in zip(total, response, tokens, hiddens, w_lp, w_ent):
        x = hs.double().requires_grad_(True)
        span = torch.log_softmax((x @ wd.T) / temperature, -1)[t - r - 1 : t - 1]
        lp_ref = span.gather(1, tok[t - r :, None])[:, 0]
        ent_ref = -(span.exp() * span).sum(-1)
        torch.autograd.backward((a * lp_ref).sum() + (b * ent_ref).sum())
        ref_lp.append(lp_ref.detach())
        ref_ent.append(ent_ref.detach())
        assert x.grad is not None
        ref_dh.append(x.grad)
    mode = "none" if cp == 1 else kind
    fmt = "bshd" if kind == "none-bshd" else "thd"
    seq = max(total) + 1 if fmt == "bshd" else None
    dw = torch.zeros(vocab, h_size, dtype=torch.float64)
    for rank in range(cp):
        layout = Layout(total, response, qkv_format=fmt, max_seq_len=seq,  # type: ignore[arg-type]
                        cp_mode=mode, cp_rank=rank, cp_size=cp)  # type: ignore[arg-type]
        if mode == "allgather":
            layout = layout.with_local_length(-(-sum(total) // cp))
        hidden = pack(hiddens, layout).requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        lp, ent = response_log_probs_from_hidden(
            hidden, w, tokens, layout, with_entropy=True, temperature=temperature, chunk_size=4
        )
        for got, want in ((lp, shard_responses(ref_lp, layout)), (ent, shard_responses(ref_ent, layout))):
            assert [x.shape for x in got] == [x.shape for x in want]
            for x, y in zip(got, want):
                torch.testing.assert_close(x.double(), y, rtol=0, atol=1e-5)
                assert x.grad_fn is not None  # empty shares too: in the graph
        loss = sum(((a.float() * x).sum() + (b.float() * y).sum()
                    for a, x, b, y in zip(shard_responses(w_lp, layout), lp,
                                          shard_responses(w_ent, layout), ent)), torch.zeros(()))
        torch.autograd.backward(loss)
        assert hidden.grad is not None and w.grad is not None
        grad_close(hidden.grad, pack(ref_dh, layout).double(), 1e-5)
        dw += w.grad.double()
    assert wd.grad is not None
    grad_close(dw, wd.grad, 1e-5)


def test_response_from_hidden_refuses_and_keeps_the_entropy_none() -> None:
    layout = Layout([5, 4], [2, 1])
    tokens = [torch.zeros(5, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)]
    lp, ent = response_log_probs_from_hidden(torch.randn(9, 3), torch.randn(7, 3), tokens, layout)
    assert ent is None
    assert [x.shape[0] for x in lp] == [2, 1]
    with refused(LayoutError, r"hidden has shape \(9,\); it must be 2-D \[T, H\]"):
        response_log_probs_from_hidden(torch.randn(9), torch.randn(7, 3), tokens, layout)
    with pytest.raises(LayoutError, match="hidden"):
        response_log_probs_from_hidden(torch.randn(8, 3), torch.randn(7, 3), tokens, layout)


def test_default_linear_chunk_rows() -> None:
    from cpslice._vocab.hidden import default_hidden_chunk_rows

    assert default_hidden_chunk_rows(32768) == 256  # 256 rows x 128 KiB = 32 MiB
    assert default_hidden_chunk_rows(10**9) == 1


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_a_row_sure_of_its_target_gets_exactly_zero_gradient(chunk: int | None) -> None:
    """With one vocabulary entry every log-prob and entropy is 0 and so is every
    gradient: exactly, only if backward recomputes bit for bit the logits forward took
    the max and the sum of (a matmul of another shape rounds differently)."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(40, 5, generator=gen) * 4).requires_grad_(True)
    weight = torch.randn(1, 5, generator=gen).requires_grad_(True)
    logp, entropy = log_probs_and_entropy_from_hidden(
        hidden, weight, torch.zeros(40, dtype=torch.int64), with_entropy=True, temperature=0.5,
        chunk_size=chunk,
    )
    torch.autograd.backward((logp * torch.randn(40, generator=gen)).sum() + entropy.sum())
    assert not logp.any() and not entropy.any()
    assert hidden.grad is not None and weight.grad is not None
    assert not hidden.grad.any() and not weight.grad.any()
