"""The Triton backend natively on a CUDA device: the options of tests/vocabulary/test_triton.py at a
GPU's sizes (several blocks of the compiled kernels' width) against float64, with the
``auto`` selection taking Triton for CUDA tensors. Skipped, saying so, where no GPU
exists (``make test`` runs on CPUs; benchmarks/gpu_bench.py and this module run on a
GPU machine)."""

from typing import Any

import pytest
import torch

from cpslice import _probe, log_probs_and_entropy, log_probs_at, topk_log_probs
from cpslice._vocab.backends import selection as backend

from ..triton_cases import OPTIONS, launched, logits, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the Triton kernels ran "
                                "under the interpreter only (tests/vocabulary/test_triton.py)")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_cuda_against_float64(seen: _probe.Seen, dtype: torch.dtype, options: dict[str, Any]) -> None:
    t, v = 64, 40000
    opts = dict(options)
    if opts.get("temperature") == "per-row":
        opts["temperature"] = torch.linspace(0.5, 1.5, t, device="cuda")
    if "vocab_size" in opts:
        opts["vocab_size"] = v - 123
    with_entropy = opts.pop("with_entropy", True)
    use_h = with_entropy and opts.get("entropy_grad", True)
    x0 = logits(t, v, dtype, 3).cuda()
    targets = torch.randint(0, opts.get("vocab_size", v), (t,), device="cuda")
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    with backend.using("auto"):
        lp, h = log_probs_and_entropy(x, targets, with_entropy=with_entropy, **opts)
        g_lp, g_h = torch.randn(t, device="cuda"), torch.randn(t, device="cuda")
        loss = (lp * g_lp).sum() + ((h * g_h).sum() if use_h and h is not None else 0.0)
        loss.backward()
    assert launched(seen, before) == {"default.stats", "default.grad"}
    ref_lp, ref_h, ref_grad = reference(x0, targets[:, None], opts.get("temperature", 1.0), opts.get("softcap"),
                                         opts.get("vocab_size"), g_lp[:, None], g_h if use_h else 0 * g_h)
    torch.testing.assert_close(lp.double(), ref_lp[:, 0], rtol=0, atol=2e-5)
    if with_entropy:
        assert h is not None
        torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=2e-5)
    assert x.grad is not None
    rel = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=rel, atol=rel * float(ref_grad.abs().max()))


def test_cuda_log_probs_at_and_topk(seen: _probe.Seen) -> None:
    t, v = 32, 20000
    x0 = logits(t, v, torch.bfloat16, 4).cuda()
    ids = torch.randint(0, v, (t, 3), device="cuda")
    ids[:, 1] = ids[:, 0]
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    lp = log_probs_at(x, ids, temperature=0.8)
    g = torch.randn(t, 3, device="cuda")
    (lp * g).sum().backward()  # type: ignore[no-untyped-call]
    top, top_ids = topk_log_probs(x0, 5)
    assert {"default.stats", "default.grad"} <= launched(seen, before)
    ref_lp, _, ref_grad = reference(x0, ids, 0.8, None, None, g, torch.zeros(t, device="cuda"))
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=2**-8, atol=2**-8 * float(ref_grad.abs().max()))
    want = torch.log_softmax(x0.double(), -1).topk(5, -1)
    torch.testing.assert_close(top.double(), want.values, rtol=0, atol=2e-5)
