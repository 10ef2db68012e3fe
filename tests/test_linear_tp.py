"""linear_log_probs_and_entropy with the LM-head weight split over real gloo TP groups
(TP 4, and TP 2 twice inside the same 4 ranks): every rank's values equal the float64
full-vocabulary reference, its weight gradient the reference's rows of its shard, its
hidden gradient the *full* reference gradient; one all-gather forward, one all-reduce
backward; then test_linear_support's cases with supports."""

from typing import Any

import torch

from ._dist import tp_groups
from .reference import grad_close, linear_reference, value_atol
from .test_linear_support import tp_cases

# (T, H, V_local, temperature, with_entropy, entropy_grad, dtype, chunk_size)
Case = tuple[int, int, int, float, bool, bool, str, int | None]
CASES: list[Case] = [
    (9, 6, 7, 1.0, True, True, "float32", None),
    (9, 6, 7, 0.5, True, True, "float32", 2),
    (5, 4, 3, 1.7, True, False, "float32", 1),
    (6, 5, 5, 1.0, False, True, "float32", 4),
    (8, 8, 6, 1.7, True, True, "bfloat16", 3),
    (0, 4, 4, 1.0, True, True, "float32", None),
    (1, 3, 1, 0.5, True, True, "float32", None),
]


def _run_cases(group: Any, tp: int, tp_rank: int, calls: dict[str, int]) -> int:
    from cpslice import linear_log_probs_and_entropy

    for i, (t, h, v_local, temp, with_entropy, entropy_grad, dtype_name, chunk) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        vocab = tp * v_local
        gen = torch.Generator().manual_seed(100 + i)
        hidden = (torch.randn(t, h, generator=gen) * 2).to(dtype)
        weight = torch.randn(vocab, h, generator=gen).to(dtype)
        targets = torch.randint(0, vocab, (t,), generator=gen)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
        x = hidden.clone().requires_grad_(True)
        w = weight[rows].clone().requires_grad_(True)
        before = dict(calls)
        logp, entropy = linear_log_probs_and_entropy(
            x, w, targets, with_entropy=with_entropy, entropy_grad=entropy_grad,
            temperature=temp, tp_group=group, chunk_size=chunk,
        )
        assert calls == {**before, "all_gather": before["all_gather"] + 1}
        use_h = with_entropy and entropy_grad
        loss = (logp * g_lp).sum()
        if entropy is not None and use_h:
            loss = loss + (entropy * g_h).sum()
        torch.autograd.backward(loss)
        assert calls == {"all_gather": before["all_gather"] + 1,
                         "all_reduce": before["all_reduce"] + 1}
        ref_lp, ref_h, ref_dh, ref_dw = linear_reference(
            hidden, weight, targets, temp, g_lp, g_h if use_h else torch.zeros(t)
        )
        bf16 = dtype == torch.bfloat16
        atol = value_atol(hidden, weight, temp, 2.0**-7 if bf16 else 2.0**-18)
        torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
        if with_entropy:
            assert entropy is not None and entropy.requires_grad == entropy_grad
            torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
        else:
            assert entropy is None
        grad_close(x.grad, ref_dh, 3e-2 if bf16 else 1e-5)
        grad_close(w.grad, ref_dw[rows], 3e-2 if bf16 else 1e-5)
        assert torch.equal(x.detach(), hidden)
    return len(CASES) + tp_cases(group, tp, tp_rank)


def _worker(rank: int, world: int) -> list[tuple[int, int]]:
    import torch.distributed as dist

    from cpslice import _linear, _logprob

    calls = {"all_gather": 0, "all_reduce": 0}

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> object:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    _logprob._all_gather = counted("all_gather", _logprob._all_gather)
    _linear._all_reduce = counted("all_reduce", _linear._all_reduce)
    done = [(tp, _run_cases(group, tp, tp_rank, calls)) for group, tp, tp_rank in tp_groups(rank, world)]
    dist.barrier()
    return done


# test_logprob_tp.py runs _worker on its spawned world of 4 (TP 4, then TP 2).
