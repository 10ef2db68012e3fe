"""The logits path's checks of the GPU command (``benchmarks/gpu_check.py``), on its device
(``gpu_device.Device``), each a function that prints its lines and returns whether it
passed:

- ``layouts``: ``response_log_probs`` on every CP layout, values and the logits' gradient
  against float64 on the CPU;
- ``log_probs_at``: ``log_probs_at`` and ``topk_log_probs`` against float64 on the CPU;
- ``response_rows``: rows outside the responses (NaN and -inf there) change neither the
  values nor the gradient, whose rows there are 0, in the default and invariant modes
  of the device's kernels and the eager ones; then a quarter of each sample as the
  response against all rows (time);
- ``memory``: ``log_probs_and_entropy`` forward + backward, peak memory beyond the logits
  against the naive ``log_softmax`` recipe.

The Triton kernels' bits (``gpu_triton_invariant.check``) and their time against the
bandwidth floor (``gpu_bench.table``) follow in the command itself.
"""

import math
import random

import torch

import cpslice
from cpslice import Layout, pack, response_log_probs, shard_responses
from cpslice._types import CpMode, QkvFormat
from cpslice._vocab.backends import selection
from cpslice._vocab.backends.triton.interpreter import interpreted

from .gpu_device import Device

TOLERANCE = 1e-4


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def backends() -> tuple[str, str]:
    """The device's kernels (``auto``: Triton on CUDA; the Triton interpreter in the smoke
    run, ``TRITON_INTERPRET=1``) and the eager ones."""
    return ("triton" if interpreted() else "auto", "eager")


def layouts(device: Device, samples: int = 64) -> bool:
    """``response_log_probs`` of every layout on the device against float64 on the CPU."""
    rng = random.Random(0)
    vocab, temp = 257, 0.9
    total = [rng.choice([1, 2, 3, rng.randint(4, 300)]) for _ in range(samples)]
    response = [rng.randint(0, t - 1) for t in total]
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    logits = [4 * torch.randn(t, vocab, generator=gen) for t in total]
    ref_lp, ref_grad = [], []
    for t, r, tok, lg in zip(total, response, tokens, logits):
        x64 = lg.double().requires_grad_()
        lp64 = torch.log_softmax(x64 / temp, -1)[t - r - 1 : t - 1].gather(1, tok[t - r :, None])
        ref_lp.append(lp64[:, 0].detach())
        ref_grad.append(torch.autograd.grad(lp64.sum(), x64)[0])
    cases: list[tuple[str, CpMode, QkvFormat, int, int]] = [
        ("none-thd", "none", "thd", 1, 0), ("none-bshd", "none", "bshd", 1, 0),
        ("zigzag-thd cp4 r1", "zigzag", "thd", 4, 1), ("zigzag-bshd cp4 r3", "zigzag", "bshd", 4, 3),
        ("allgather cp4 r2", "allgather", "thd", 4, 2)]
    ok = True
    for name, mode, fmt, cp, rank in cases:
        layout = Layout(total, response, qkv_format=fmt, max_seq_len=max(total) if fmt == "bshd" else None,
                        cp_mode=mode, cp_rank=rank, cp_size=cp)
        local = pack(logits, layout)
        layout = layout.with_local_length(local.shape[0])
        x = local.to(device.where).requires_grad_()
        lp, _ = response_log_probs(x, [t.to(device.where) for t in tokens], layout, temperature=temp)
        err = max((float((a.detach().cpu().double() - b).abs().max()) for a, b in
                   zip(lp, shard_responses(ref_lp, layout)) if a.numel()), default=0.0)
        torch.autograd.backward(sum((s.sum() for s in lp), x.sum() * 0))
        assert x.grad is not None
        gerr = float((x.grad.cpu().double() - pack(ref_grad, layout)).abs().max())
        passed = max(err, gerr) < TOLERANCE and all(s.device == x.device for s in lp)
        ok &= passed
        print(f"layout {name:<20} log-prob err {err:.1e}  grad err {gerr:.1e}  {_verdict(passed)}", flush=True)
    return ok


def log_probs_at(device: Device) -> bool:
    """``log_probs_at`` and ``topk_log_probs`` on the device against float64 on the CPU."""
    gen = torch.Generator().manual_seed(3)
    full = 4 * torch.randn(300, 1000, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 1000, (300, 64), generator=gen)
    x = full.float().to(device.where).requires_grad_(True)
    lp = cpslice.log_probs_at(x, ids.to(device.where), temperature=0.9)
    torch.autograd.backward(lp.sum())
    x64 = full.clone().requires_grad_(True)
    want = torch.log_softmax(x64 / 0.9, -1).gather(1, ids)
    torch.autograd.backward(want.sum())
    assert x.grad is not None and x64.grad is not None
    err = float((lp.detach().cpu().double() - want.detach()).abs().max())
    gerr = float((x.grad.cpu().double() - x64.grad).abs().max())
    values, top = cpslice.topk_log_probs(x.detach(), 64, temperature=0.9)
    logp64 = torch.log_softmax(full / 0.9, -1)
    ref_v, ref_ids = torch.topk(logp64, 64)
    terr = float((values.cpu().double() - ref_v).abs().max())
    # the ids: a top-k of float64 (near-ties within float32's rounding may come in either order)
    ierr = float((logp64.gather(1, top.cpu()) - ref_v).abs().max())
    swapped = int((top.cpu() != ref_ids).sum())
    ok = max(err, gerr, terr, ierr) < TOLERANCE
    print(f"log_probs_at err {err:.1e} grad err {gerr:.1e}; topk err {terr:.1e}, its ids' float64 err {ierr:.1e} "
          f"({swapped} places of near-ties swapped)  {_verdict(ok)}", flush=True)
    return ok


def _outside_rows(device: Device, backend: str, invariant: bool) -> bool:
    """NaN and -inf in the rows outside the responses change no value and no gradient bit,
    and those rows' gradient is 0."""
    gen = torch.Generator().manual_seed(4)
    layout = Layout([7, 5, 6], [3, 2, 2], padded_lengths=[9, 8, 8])
    tokens = [torch.randint(0, 40, (t,), generator=gen).to(device.where) for t in (7, 5, 6)]
    outside = [r for r in range(25) if r not in (3, 4, 5, 11, 12, 20, 21)]
    clean = torch.randn(25, 40, generator=gen) * 3
    bad = clean.clone()
    bad[outside[::2]], bad[outside[1::2]] = math.nan, -math.inf
    got = []
    with selection.using(backend):
        for logits in (clean, bad):
            x = logits.to(device.where).requires_grad_(True)
            lp, ent = response_log_probs(x, tokens, layout, with_entropy=True, invariant=invariant)
            out = torch.cat(lp + ent)
            torch.autograd.backward(out.sum())
            assert x.grad is not None
            got.append((out.detach().cpu(), x.grad.cpu()))
    return all(torch.equal(a, b) for a, b in zip(*got)) and bool(got[1][1][outside].eq(0).all())


def response_rows(device: Device, t: int = 4096, v: int = 32768, repeat: int = 5) -> bool:
    """``response_log_probs`` reads the response rows alone (``_outside_rows``, every
    backend of ``backends()``, both modes); then its time with a quarter of each sample as
    the response (8, 16, 64 samples) against all rows, ``[t, v]`` float32, the device's
    kernels (information)."""
    ok = True
    for backend in backends():
        for invariant in (False, True):
            passed = _outside_rows(device, backend, invariant)
            ok &= passed
            print(f"rows outside the responses: backend {backend} invariant={invariant} {_verdict(passed)}",
                  flush=True)
    logits = torch.randn(t, v, device=device.where).requires_grad_(True)
    base = 0.0
    with selection.using(backends()[0]):
        for samples, share in ((8, 1.0), (8, 0.25), (16, 0.25), (64, 0.25)):
            length = t // samples
            if length < 4:  # the smoke run's few rows
                continue
            lay = Layout([length] * samples, [length - 1 if share == 1.0 else length // 4] * samples)
            toks = [torch.randint(0, v, (length,), device=device.where) for _ in range(samples)]

            def step(lay: Layout = lay, toks: list[torch.Tensor] = toks) -> None:
                lp, ent = response_log_probs(logits, toks, lay, with_entropy=True)
                torch.autograd.backward(sum((a.sum() + 0.01 * h.sum() for a, h in zip(lp, ent)), logits.sum() * 0))
                logits.grad = None

            ms = device.median_ms(step, repeat)
            base = ms if share == 1.0 else base
            print(f"response rows {samples:>2} samples, {'all' if share == 1.0 else 'a quarter':<9} {ms:8.2f} ms "
                  f"({ms / base:.2f}x all)", flush=True)
    return ok


def memory(device: Device, t: int = 4096, v: int = 32768, repeat: int = 5) -> bool:
    """``log_probs_and_entropy`` (the device's kernels) against the naive recipe, forward +
    backward of ``[t, v]`` float32 logits: peak memory beyond the logits, in ``[T, V]``
    float32 buffers (cpslice: the gradient's one), and time (information)."""
    gen = torch.Generator(device=device.where).manual_seed(0)
    targets = torch.randint(0, v, (t,), device=device.where, generator=gen)
    logits = torch.randn(t, v, device=device.where, generator=gen).requires_grad_(True)

    def ours() -> None:
        lp, ent = cpslice.log_probs_and_entropy(logits, targets, with_entropy=True)
        torch.autograd.backward(lp.sum() + ent.sum())
        logits.grad = None

    def naive() -> None:
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(1, targets[:, None])[:, 0]
        torch.autograd.backward(lp.sum() - (logp.exp() * logp).sum())
        logits.grad = None

    with selection.using(backends()[0]):
        for name, step in (("cpslice", ours), ("naive", naive)):
            peak = device.peak_growth(step) / (t * v * 4)
            ms = device.median_ms(step, repeat)
            print(f"log-probs + entropy T={t} V={v} float32 {name:<8} peak beyond the logits {peak:.2f} [T, V] "
                  f"float32, {ms:.2f} ms forward + backward", flush=True)
    return True
