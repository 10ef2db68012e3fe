"""``cpslice.backend_for``: the backend a call would run, against the backend that the
call's launches show (every setting, both heads, both modes), and its refusals."""

from collections.abc import Callable
from typing import Literal, assert_type

import pytest
import torch
from torch import Tensor

from cpslice import (
    LayoutError,
    _probe,
    backend_for,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
)
from cpslice._vocab.backends import selection

Call = Callable[[bool], Tensor]


def _logits(invariant: bool) -> Tensor:
    x = torch.randn(6, 300, requires_grad=True)
    lp, _ = log_probs_and_entropy(x, torch.arange(6), with_entropy=True, invariant=invariant)
    return lp


def _hidden(invariant: bool) -> Tensor:
    lp, _ = log_probs_and_entropy_from_hidden(torch.randn(6, 16, requires_grad=True), torch.randn(300, 16),
                                              torch.arange(6), invariant=invariant)
    return lp


@pytest.mark.parametrize(("name", "invariant"), [
    (name, invariant) for name in ("auto", "eager", "compiled", "triton") for invariant in (False, True)
    if (name, invariant) != ("compiled", True)  # invariant mode's compiled kernels: 5 s of tracing
])
def test_the_answer_is_the_backend_that_runs(name: str, invariant: bool) -> None:
    with selection.using(name, compiler="aot_eager", fresh=True):
        for head, args in ((_logits, (torch.randn(6, 300),)), (_hidden, (torch.randn(6, 16), torch.randn(300, 16)))):
            want = backend_for(*args, invariant=invariant)
            assert_type(want, Literal["eager", "compiled", "triton"])
            with _probe.watch() as seen:
                head(invariant).sum().backward()  # type: ignore[no-untyped-call]
            ran = [e.backend for e in seen.of("launch")]
            assert ran and ran[0] == want, (head.__name__, ran)
            assert want == {"auto": "eager"}.get(name, name)  # small CPU blocks: a compile would not pay


def test_what_decides() -> None:
    big = torch.empty_strided((4096, 1024), (0, 1))  # 2**22 logits: a compile pays in auto
    with selection.using("auto"):
        assert backend_for(big) == "compiled" and backend_for(big.t()) == "eager"  # columns not contiguous
        assert backend_for(torch.randn(4, 8)) == "eager"
    with selection.using("triton"):  # the interpreter (the session's TRITON_INTERPRET=1)
        assert backend_for(torch.randn(4, 8, dtype=torch.bfloat16)) == "triton"
        assert backend_for(torch.randn(4, 8, dtype=torch.float64)) == "eager"  # float64: not Triton's
        assert backend_for(torch.randn(4, 8, dtype=torch.float16)) == "triton"
        assert backend_for(torch.randn(4, 8, dtype=torch.float16), invariant=True) == "eager"  # not the spec's


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="logits"):
        backend_for(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(LayoutError, match="hidden"):
        backend_for(torch.randn(4, 8), torch.randn(10, 9))
    with pytest.raises(TypeError, match="invariant"):
        backend_for(torch.randn(4, 8), invariant=1)  # type: ignore[arg-type]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with selection.using("triton"), pytest.raises(RuntimeError, match="CPSLICE_BACKEND=triton runs on CUDA tensors"):
        backend_for(torch.randn(4, 8))
