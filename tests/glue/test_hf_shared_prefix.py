"""Shared-prefix packing through a real Hugging Face ``LlamaForCausalLM``
(examples/shared_prefix_grpo.py's functions, on a tiny model: random weights, nothing
downloaded): two prompts of ``G = 4`` responses of different lengths, packed as stars
(``Layout(..., shared_prefix=[4, 4])``, ``attention_mask`` and ``position_ids`` into the
model), give each sample the log-probs and entropy, and every parameter the gradient,
that the same samples give packed without sharing and as right-padded rows with Hugging
Face's own mask (no cpslice), in float32 and float64; from the hidden states and from
the logits. And the comparison can fail: a causal mask over each star, or positions counted
along the pack, over the same stars give other numbers (seconds)."""

from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import cpslice
from hf_grpo_step import tiny_llama  # examples/: pytest puts it on the path
from shared_prefix_grpo import (
    METHODS,
    Rollout,
    Step,
    forward_tokens,
    rollout,
    shared_log_probs_from_logits,
    step,
)

PROMPTS, GROUP = [5, 9], 4


def _float64_norm(self: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward computing in the input's dtype (transformers' casts to float32)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def batch() -> Rollout:
    b = rollout(64, PROMPTS, GROUP, max_response=6, seed=0)
    assert len(set(b.response_lengths[:GROUP])) == GROUP  # different lengths in a group
    return b


def _assert_same(got: Step, want: Step, values: float, grads: float) -> None:
    """The same log-probs and entropy within ``values``; every parameter's gradient
    within ``grads`` of its largest magnitude (at least 1)."""
    for a, b in ((got.log_probs, want.log_probs), (got.entropy, want.entropy)):
        assert [x.shape for x in a] == [x.shape for x in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y.to(x.dtype), rtol=0, atol=values)
    assert got.grads.keys() == want.grads.keys()
    for name, g in got.grads.items():
        scale = max(1.0, float(want.grads[name].abs().max()))
        torch.testing.assert_close(g, want.grads[name], rtol=0, atol=grads * scale, msg=name)


# (dtype, LlamaRMSNorm computes in float64, tolerance of the values, of the gradients).
# transformers' LlamaRMSNorm casts its input to float32 (and its gradient back through
# that cast), so a float64 model is float64 except at every norm. The forward rounds the
# same rows' values the same way whatever the packing (1e-12 holds), but a shared prompt
# row's gradient is the sum over its G branches, rounded to float32 once at the norm,
# where the unshared copies are rounded one by one and summed after: measured ~5e-8 of
# the gradients' scale in float64, hence 1e-6. With the norm computing in float64 the
# gradients agree to 1e-12 too: the norm's float32 is all of that difference.
CASES = [(torch.float32, False, 1e-5, 1e-5), (torch.float64, False, 1e-12, 1e-6),
         (torch.float64, True, 1e-12, 1e-12)]


@pytest.mark.parametrize(("dtype", "norm64", "values", "grads"), CASES,
                         ids=["float32", "float64", "float64-norm"])
def test_shared_prefix_gives_the_unshared_log_probs_and_gradients(
    batch: Rollout, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, norm64: bool,
    values: float, grads: float,
) -> None:
    if norm64:
        monkeypatch.setattr(LlamaRMSNorm, "forward", _float64_norm)
    model = tiny_llama(dtype=dtype)
    prompts, responses = sum(PROMPTS), sum(batch.response_lengths)
    assert forward_tokens(batch, "shared") == prompts + responses
    assert forward_tokens(batch, "packed") == GROUP * prompts + responses
    shared = step(model, batch, METHODS["shared"])
    assert shared.log_probs[0].dtype == dtype
    packed = step(model, batch, METHODS["packed"])
    _assert_same(shared, packed, values, grads)
    if norm64:  # the float64 norm's case shows the tolerance's cause: packed suffices
        return
    for other in (METHODS["padded"], shared_log_probs_from_logits):
        _assert_same(shared, step(model, batch, other), values, grads)
    if dtype == torch.float64:  # the tolerance is needed: the norm rounds
        assert any(not torch.equal(g, packed.grads[k]) for k, g in shared.grads.items())


def _star_forward(
    model: LlamaForCausalLM, batch: Rollout, mask: torch.Tensor, positions: torch.Tensor
) -> list[torch.Tensor]:
    layout = batch.shared
    ids = cpslice.pack(batch.tokens, layout)
    hidden = model.model(ids[None], attention_mask=mask[None, None],
                         position_ids=positions[None]).last_hidden_state[0]
    lp, _ = cpslice.response_log_probs_from_hidden(hidden, model.lm_head.weight, batch.tokens,
                                                   layout)
    return [x.detach() for x in lp]


def _variants(batch: Rollout) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    mask, positions = cpslice.attention_mask(batch.shared), cpslice.position_ids(batch.shared)
    stars = [p + sum(batch.response_lengths[j * GROUP : (j + 1) * GROUP])
             for j, p in enumerate(PROMPTS)]
    yield "tree mask", mask, positions
    star = torch.repeat_interleave(torch.arange(len(stars)), torch.tensor(stars))
    causal = (star[:, None] == star[None, :]) & torch.ones(len(star), len(star)).tril().bool()
    yield "causal in each star", causal, positions
    yield "pack positions", mask, torch.arange(positions.numel())


def test_the_tree_mask_and_the_branch_positions_are_what_make_it_equal(batch: Rollout) -> None:
    model = tiny_llama()
    want = step(model, batch, METHODS["packed"]).log_probs
    differs = {}  # per variant, per sample: its log-probs are not the unshared ones
    for name, mask, positions in _variants(batch):
        got = _star_forward(model, batch, mask, positions)
        differs[name] = [not torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(got, want)]
    # A group's first branch follows its prompt in the pack either way, and a branch of
    # one response token is predicted by the prompt's last row alone: every other branch
    # sees the star's earlier branches under a causal mask, and sits at a gap from its
    # prompt with the pack's positions (RoPE reads only the gap: a star shifted whole
    # gives the same numbers).
    later = [i % GROUP > 0 and r > 1 for i, r in enumerate(batch.response_lengths)]
    assert sum(later) >= 4
    assert differs == {"tree mask": [False] * len(later), "causal in each star": later,
                       "pack positions": later}
