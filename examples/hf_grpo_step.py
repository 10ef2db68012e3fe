"""GRPO steps of a Hugging Face ``LlamaForCausalLM``, log-probs from its hidden states.

A small ``LlamaForCausalLM`` (random weights from a ``LlamaConfig``: nothing is
downloaded) on a batch as Hugging Face trainers hold it: the prompts left-padded to the
longest, a group of responses per prompt right after them, then padding, with an
``attention_mask`` and position ids from its cumulative sum (as verl passes them).
Each step: ``model.model(...)``'s final hidden states and ``model.lm_head.weight`` ->
``cpslice.Layout.from_attention_mask`` -> ``cpslice.response_log_probs_from_hidden``
(the response rows only: the ``[B, S, V]`` logits are never built) -> a clipped-ratio
loss with group-normalized advantages (``cpslice.sum_of_sample_means``) -> Adam.

Printed: each step's loss (in scientific notation: the first, on-policy, is 0 up to
rounding), and the peak memory of one step (forward + backward) against
the recipe it replaces, ``log_softmax(model(...).logits[:, -R-1:-1])`` gathered at the
response tokens (verl; TRL's ``logits_to_keep=R + 1`` builds ``[B, R + 1, V]`` of them
instead of ``[B, S, V]``): the growth of the peak RSS (VmHWM) during the step beyond the
RSS before it, as the benchmarks measure it (benchmarks/harness.py).

tests/glue/test_hf.py runs these functions on a tiny model: the same log-probs, entropy and
gradient of every parameter on both paths, and training steps.

Run from the repository root: ``.venv/bin/python examples/hf_grpo_step.py``
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's cpslice, and benchmarks/ for the peak-memory measure.
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import torch  # noqa: E402
from benchmarks.harness import peak_growth  # noqa: E402
from torch import Tensor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cpslice  # noqa: E402

PAD = 0
CLIP = 0.2


def tiny_llama(
    vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, positions: int = 64,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialized ``LlamaForCausalLM`` (no dropout, an untied LM head)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=positions, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    torch.nn.Module.to(model, dtype)  # in place (PreTrainedModel.to's typing hides the dtype)
    return model


@dataclass(frozen=True)
class Batch:
    """``[B, S]`` rows: ``input_ids``, ``attention_mask`` and ``position_ids``; the
    response mask ``[B, R]`` of the last ``R`` columns; the rows' cpslice ``layout``
    and each sample's tokens ``[L_i]``."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    layout: cpslice.Layout
    tokens: list[Tensor]


def left_padded_batch(prompts: Sequence[Tensor], responses: Sequence[Tensor]) -> Batch:
    """The batch a trainer builds from a tokenizer's left-padded prompts and the
    generated responses, right-padded to the longest."""
    width = max(len(p) for p in prompts)
    resp = max(len(r) for r in responses)
    rows = len(prompts)
    ids = torch.full((rows, width + resp), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width - len(p) : width + len(r)] = torch.cat([p, r])
        mask[i, width - len(p) : width + len(r)] = 1
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    response_mask = mask[:, width:]
    layout = cpslice.Layout.from_attention_mask(mask, response_mask.sum(1).tolist())
    tokens = [row[m.bool()] for row, m in zip(ids, mask)]
    return Batch(ids, mask, position_ids, response_mask, layout, tokens)


def rollout(
    vocab: int, prompt_lengths: Sequence[int], group: int, max_response: int, seed: int
) -> tuple[Batch, Tensor]:
    """Random prompts, ``group`` random responses of random lengths (1 to
    ``max_response``) per prompt, and a reward per response."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> Tensor:
        return torch.randint(1, vocab, (n,), generator=gen)

    prompts = [ids(n) for n in prompt_lengths for _ in range(group)]
    responses = [ids(int(torch.randint(1, max_response + 1, (), generator=gen))) for _ in prompts]
    rewards = torch.randn(len(prompts), generator=gen)
    return left_padded_batch(prompts, responses), rewards


def _forward(model: LlamaForCausalLM, batch: Batch) -> Tensor:
    """The final hidden states ``[B, S, H]`` (after the final norm)."""
    out = model.model(batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids)
    hidden: Tensor = out.last_hidden_state
    return hidden


LogProbs = Callable[[LlamaForCausalLM, Batch], tuple[list[Tensor], list[Tensor]]]


def hidden_log_probs(model: LlamaForCausalLM, batch: Batch) -> tuple[list[Tensor], list[Tensor]]:
    """Per sample, the log-probs and entropy ``[R_i]`` of its response tokens: cpslice
    from the hidden states and the LM-head weight, on the response rows only."""
    hidden = _forward(model, batch)
    rows, width, size = hidden.shape
    return cpslice.response_log_probs_from_hidden(
        hidden.reshape(rows * width, size), model.lm_head.weight, batch.tokens, batch.layout,
        with_entropy=True,
    )


def logits_log_probs(model: LlamaForCausalLM, batch: Batch) -> tuple[list[Tensor], list[Tensor]]:
    """The same, as TRL and verl compute it: the ``[B, S, V]`` logits, sliced at
    ``[:, -R-1:-1]``, ``log_softmax`` in float32 (or float64), gathered at the response
    ids, masked."""
    out = model(batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids)
    resp = batch.response_mask.shape[1]
    logits = out.logits[:, -resp - 1 : -1]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    picked = logp.gather(2, batch.input_ids[:, -resp:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    keep = [m.bool() for m in batch.response_mask]
    return [x[k] for x, k in zip(picked, keep)], [x[k] for x, k in zip(entropy, keep)]


def advantages(rewards: Tensor, group: int) -> Tensor:
    """GRPO's: each reward less its group's mean, over the group's standard deviation."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).reshape(-1)


def grpo_loss(
    log_probs: Sequence[Tensor], old: Sequence[Tensor], adv: Tensor, batch: Batch
) -> Tensor:
    """The clipped-ratio loss, each response's token mean, averaged over the responses."""
    pg = []
    for lp, o, a in zip(log_probs, old, adv):
        ratio = (lp - o).exp()
        pg.append(-torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a))
    masks = [torch.ones(r) for r in batch.layout.response_lengths]
    return cpslice.sum_of_sample_means(pg, masks, batch.layout) / len(pg)


def train(
    model: LlamaForCausalLM, batch: Batch, rewards: Tensor, group: int, steps: int,
    log_probs: LogProbs = hidden_log_probs, lr: float = 1e-2,
) -> list[float]:
    """``steps`` GRPO steps on one rollout (old log-probs from the first policy); the
    loss of each."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    with torch.no_grad():
        old = [x.detach() for x in log_probs(model, batch)[0]]
    adv = advantages(rewards, group)
    losses = []
    for _ in range(steps):
        lp, _ = log_probs(model, batch)
        loss = grpo_loss(lp, old, adv, batch)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def loss_line(step: int, loss: float) -> str:
    """What ``main`` prints of a step's loss: four significant digits, whatever its size.
    Step 0 is on-policy (every ratio 1): its loss is minus the mean of advantages centred
    per group, 0 but for rounding; Adam's steps move the policy after it."""
    why = " (on-policy: minus the mean advantage, 0 up to rounding)" if step == 0 else ""
    return f"step {step}: loss {loss:+.3e}{why}"


def step_peak_bytes(model: LlamaForCausalLM, batch: Batch, log_probs: LogProbs) -> int:
    """Peak RSS growth of one forward + backward of ``log_probs``' loss."""
    def step() -> None:
        lp, ent = log_probs(model, batch)
        loss = sum((x.sum() - 0.01 * e.sum() for x, e in zip(lp, ent)), torch.zeros(()))
        torch.autograd.backward(loss)
        model.zero_grad(set_to_none=False)

    step()  # warm-up: lazy imports, the gradient buffers
    return peak_growth(step)


def main() -> None:
    vocab, group = 16384, 4
    model = tiny_llama(vocab=vocab, hidden=64, positions=512)
    batch, rewards = rollout(vocab, [24, 80], group, max_response=120, seed=0)
    rows, width = batch.input_ids.shape
    print(f"LlamaForCausalLM: 2 layers, hidden 64, vocabulary {vocab}; {rows} responses "
          f"({rows // group} prompts x {group}), rows of S = {width} columns, "
          f"{sum(batch.layout.response_lengths)} response tokens")
    for i, loss in enumerate(train(model, batch, rewards, group, steps=3)):
        print(loss_line(i, loss))
    mib = 2**20
    ours = step_peak_bytes(model, batch, hidden_log_probs)
    theirs = step_peak_bytes(model, batch, logits_log_probs)
    logits = rows * width * vocab * 4
    print(f"peak memory of one step (forward + backward): hidden states + cpslice "
          f"{ours / mib:.0f} MiB, logits[:, -R-1:-1] + log_softmax {theirs / mib:.0f} MiB "
          f"({ours / theirs:.2f}x; the float32 [B, S, V] logits alone are {logits / mib:.0f} MiB)")


if __name__ == "__main__":
    main()
