"""On a CUDA machine: the single-process paths on the GPU against a float64 CPU
reference, then extraction speed and log-prob memory measured there.

Run: ``PYTHONPATH=src:. python3 -m benchmarks.gpu_check`` (needs torch with CUDA and
jaxtyping; no megatron, no process groups).
"""

import random
import time

import torch

import cpslice
from cpslice import Layout, pack, response_log_probs, shard_responses
from cpslice._types import CpMode, QkvFormat

from . import bench_extract


def _check_layouts(device: str) -> None:
    rng = random.Random(0)
    vocab, temp = 257, 0.9
    total = [rng.choice([1, 2, 3, rng.randint(4, 300)]) for _ in range(64)]
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
             ("zigzag-thd cp4 r1", "zigzag", "thd", 4, 1),
             ("zigzag-bshd cp4 r3", "zigzag", "bshd", 4, 3),
             ("allgather cp4 r2", "allgather", "thd", 4, 2)]
    for name, mode, fmt, cp, rank in cases:
        layout = Layout(total, response, qkv_format=fmt,
                        max_seq_len=max(total) if fmt == "bshd" else None,
                        cp_mode=mode, cp_rank=rank, cp_size=cp)
        local = pack(logits, layout)
        layout = layout.with_local_length(local.shape[0])
        x = local.to(device).requires_grad_()
        lp, _ = response_log_probs(x, [t.to(device) for t in tokens], layout, temperature=temp)
        assert all(s.device.type == device for s in lp)
        err = max((float((a.detach().cpu().double() - b).abs().max()) for a, b in
                   zip(lp, shard_responses(ref_lp, layout)) if a.numel()), default=0.0)
        torch.autograd.backward(sum((s.sum() for s in lp), x.sum() * 0))
        assert x.grad is not None
        gerr = float((x.grad.cpu().double() - pack(ref_grad, layout)).abs().max())
        print(f"{name:<20} log-prob err {err:.1e}  grad err {gerr:.1e}  "
              f"{'pass' if max(err, gerr) < 1e-4 else 'FAIL'}")


def _logprob_memory(device: str) -> None:
    t, v = 4096, 32768
    torch.manual_seed(0)
    targets = torch.randint(0, v, (t,), device=device)
    buf = t * v * 4
    for name in ("cpslice", "naive"):
        logits = torch.randn(t, v, device=device, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(5):
            logits.grad = None
            if name == "cpslice":
                lp, ent = cpslice.log_probs_and_entropy(logits, targets, with_entropy=True)
            else:
                logp = torch.log_softmax(logits, -1)
                lp = logp.gather(1, targets[:, None])[:, 0]
                ent = -(logp.exp() * logp).sum(-1)
            torch.autograd.backward(lp.sum() + ent.sum())
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / 5 * 1e3
        peak = (torch.cuda.max_memory_allocated() - base) / buf
        print(f"log-probs+entropy T={t} V={v} {name:<8} peak beyond logits {peak:.2f}x "
              f"[T,V] f32, {ms:.2f} ms fwd+bwd")
        del logits


def main() -> int:
    device = "cuda"
    print(torch.__version__, torch.cuda.get_device_name())
    _check_layouts(device)
    print(bench_extract.report(bench_extract.run(False, device)))
    _logprob_memory(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
