"""A real megatron-core GPTModel (2 layers, hidden 64, vocabulary 128, float32, on the
CPU with the shims of examples/gpt_cpu.py), on 2 gloo ranks at TP 2 and then at TP 1,
six samples packed in one row:

- ``response_log_probs`` on the model's logits equals megatron's own
  ``vocab_parallel_cross_entropy``, negated, at the response positions;
- the hidden-state path (docs/api-guide.md's ``lm_head_weight`` + ``policy_log_probs``,
  run as written there, with ``response_log_probs_from_hidden``) equals the logits path:
  log-probs, entropy and every parameter's gradient, with separate and with tied embeddings;
- three PPO/GRPO-style steps (clipped ratio, entropy bonus, ``sum_of_sample_means``)
  give the same losses at TP 1 and TP 2 from the same initial weights."""

from typing import Any

import torch

from gpt_cpu import rollout, tiny_gpt, train  # examples/gpt_cpu.py: pytest puts examples/ on the path

from ..support._dist import destroy_megatron, init_megatron, run_distributed
from ..support._docs import block_defining


def _doc_functions() -> tuple[Any, Any]:
    namespace = block_defining("docs/api-guide.md", "lm_head_weight")
    return namespace["lm_head_weight"], namespace["policy_log_probs"]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale, msg=lambda m: f"{what}: {m}")


def _weighted(lp: list[torch.Tensor], ent: list[torch.Tensor], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return sum(((torch.randn(x.shape, generator=gen) * x).sum()
                + (torch.randn(y.shape, generator=gen) * y).sum() for x, y in zip(lp, ent)),
               torch.zeros(()))


def _at_tp(tp: int) -> list[float]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from cpslice import Layout, response_log_probs, response_rows, shifted_targets

    lm_head_weight, policy_log_probs = _doc_functions()
    init_megatron(tp, 1)
    try:
        group = ps.get_tensor_model_parallel_group()
        ro = rollout(0)
        ids, pos, mask = ro.model_inputs()
        layout = Layout(ro.total, ro.response)
        rows, _ = response_rows(layout)
        for tied in (False, True):
            model = tiny_gpt(0, tied=tied)
            logits = model(ids, pos, mask)[0]  # [T, V / tp]
            lp, ent = response_log_probs(logits, ro.tokens, layout, with_entropy=True,
                                         tp_group=group)
            # megatron's loss: [s, b, V / tp] logits (overwritten in place: a clone), [s, b] targets
            targets = shifted_targets(ro.tokens, layout)
            ce = vocab_parallel_cross_entropy(logits.detach()[:, None].clone(), targets[:, None])
            _close(torch.cat(lp).detach(), -ce[rows, 0], f"tp{tp} vs megatron cross-entropy")
            torch.autograd.backward(_weighted(lp, ent, 1))
            want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)

            weight = lm_head_weight(model)
            lp2, ent2 = policy_log_probs(model, weight, ids, pos, mask, ro.tokens, layout)
            for a, b in zip(lp2 + ent2, lp + ent, strict=True):
                _close(a.detach(), b.detach(), f"tp{tp} tied={tied} hidden vs logits values")
            torch.autograd.backward(_weighted(lp2, ent2, 1))
            got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert got.keys() == want.keys() and len(want) == len(list(model.parameters()))
            for name, g in got.items():
                _close(g, want[name], f"tp{tp} tied={tied} gradient of {name}", rel=2e-5)

        model = tiny_gpt(1)
        weight = lm_head_weight(model)
        return train(
            model, lambda: policy_log_probs(model, weight, ids, pos, mask, ro.tokens, layout),
            ro, layout,
        )
    finally:
        destroy_megatron()


def _worker(rank: int, world: int) -> dict[int, list[float]]:
    return {tp: _at_tp(tp) for tp in (2, 1)}


def test_gpt_model_end_to_end_at_tp_1_and_2() -> None:
    results = run_distributed(_worker, 2, timeout=240)
    for losses in results:
        assert len(losses[1]) == len(losses[2]) == 3
        assert len(set(losses[1])) == 3, "the steps changed nothing"
        for a, b in zip(losses[1], losses[2]):
            assert abs(a - b) <= 1e-5, (losses[1], losses[2])
    assert results[0] == results[1]
