"""A real Hugging Face ``LlamaForCausalLM`` end to end (examples/hf_grpo_step.py's
functions, on a tiny model: random weights, nothing downloaded) on a left-padded batch
of different prompt and response lengths: its final hidden states and LM-head weight
through ``response_log_probs_from_hidden`` give the log-probs, entropy and gradient of
every parameter that ``log_softmax(model(...).logits)`` sliced at the response tokens
gives, in float32 and float64; GRPO steps train with it, step for step as on the
logits. With tests/glue/test_hf_shared_prefix.py (shared-prefix stars through the same
model), the modules that import transformers (seconds)."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_grpo_step import (  # examples/: pytest puts it on the path
    Batch,
    LogProbs,
    hidden_log_probs,
    logits_log_probs,
    loss_line,
    rollout,
    tiny_llama,
    train,
)

GROUP = 3


def _loss_and_grads(
    model: LlamaForCausalLM, batch: Batch, log_probs: LogProbs
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Log-probs, entropy and every parameter's gradient of a weighted sum of both."""
    model.zero_grad(set_to_none=True)
    lp, ent = log_probs(model, batch)
    gen = torch.Generator().manual_seed(1)
    loss = sum(((torch.randn(x.shape, generator=gen, dtype=x.dtype) * x).sum()
                + (torch.randn(e.shape, generator=gen, dtype=e.dtype) * e).sum()
                for x, e in zip(lp, ent)), torch.zeros((), dtype=lp[0].dtype))
    torch.autograd.backward(loss)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.clone()
    return [x.detach() for x in lp], [e.detach() for e in ent], grads


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_hidden_states_give_the_logits_log_probs_and_gradients(
    dtype: torch.dtype, tol: float
) -> None:
    model = tiny_llama(dtype=dtype)
    batch, _ = rollout(64, [3, 9, 1], GROUP, max_response=12, seed=0)
    assert len(set(batch.layout.row_offsets)) > 2 and len(set(batch.layout.response_lengths)) > 2
    ours = _loss_and_grads(model, batch, hidden_log_probs)
    theirs = _loss_and_grads(model, batch, logits_log_probs)
    for got, want in zip(ours[:2], theirs[:2]):
        assert [x.shape for x in got] == [x.shape for x in want]
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y.to(dtype), rtol=0, atol=tol)
    assert ours[2].keys() == theirs[2].keys()
    for name, grad in ours[2].items():
        scale = float(theirs[2][name].abs().max())
        torch.testing.assert_close(grad, theirs[2][name], rtol=0, atol=tol * max(1.0, scale),
                                   msg=name)


def test_grpo_steps_train_as_on_the_logits() -> None:
    model = tiny_llama()
    batch, rewards = rollout(64, [5, 11], GROUP, max_response=10, seed=2)
    twin = copy.deepcopy(model)
    losses = train(model, batch, rewards, GROUP, steps=3)
    assert losses[-1] < losses[0] - 1e-3, losses  # the clipped surrogate improves
    want = train(twin, batch, rewards, GROUP, steps=3, log_probs=logits_log_probs)
    assert losses == pytest.approx(want, abs=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4, msg=name)
    # what the example prints of them: the on-policy step's loss, 0 up to rounding, shows
    # its digits, not a -0.00000 that reads as nothing computed
    assert abs(losses[0]) < 1e-6
    first = loss_line(0, losses[0])
    assert first.startswith(f"step 0: loss {losses[0]:+.3e} (on-policy") and "e-" in first, first
    assert float(first.split()[3]) == pytest.approx(losses[0], rel=1e-3)
    assert loss_line(1, -0.1408) == "step 1: loss -1.408e-01"
