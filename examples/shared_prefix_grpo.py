"""A shared-prefix GRPO batch through a Hugging Face ``LlamaForCausalLM``: each prompt once.

A GRPO step samples ``G`` responses per prompt. Packed with
``cpslice.Layout(total, response, shared_prefix=[G, G, ...])``, each group is one
*star*: its prompt once, then its ``G`` responses back to back, ``P + G * R`` forward
tokens instead of ``G * (P + R)``. The model needs two things beside
``cpslice.pack(tokens, layout)``: the tree mask ``cpslice.attention_mask(layout)`` (a
branch attends its prompt and itself, never another branch) and
``cpslice.position_ids(layout)`` (a branch continues from ``P``, whichever branch it
is). ``cpslice.response_log_probs_from_hidden`` then gives each sample's log-probs and
entropy from the final hidden states and the LM-head weight (a prompt's last row, which
predicts every branch's first token, goes through the head once).

The same samples three ways, on one small ``LlamaForCausalLM`` (random weights from a
``LlamaConfig``: nothing is downloaded), two prompts of ``G = 4`` responses each, of
different lengths:

- ``shared``: the stars above;
- ``packed``: the same samples back to back without sharing
  (``Layout(total, response)``, the same mask and position helpers, the same call);
- ``padded``: one right-padded row per sample, Hugging Face's own 2-D attention mask
  and default positions, ``log_softmax`` of its logits gathered at the response tokens
  (no cpslice at all).

Printed: each method's forward tokens and the wall time (wall and CPU) of one forward + backward (of a
loss of the log-probs and entropy), and per sample the largest difference of its
log-probs and entropy from ``shared``'s. Exit status 1 when they differ beyond the
tolerance. tests/glue/test_hf_shared_prefix.py runs these functions on a tiny model and
compares every parameter's gradient too, in float32 and float64.

Run from the repository root: ``.venv/bin/python examples/shared_prefix_grpo.py
[--prompts 48 80] [--group 4] [--max-response 24]``
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "examples")]  # this checkout's cpslice

import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import cpslice  # noqa: E402
from hf_grpo_step import tiny_llama  # noqa: E402

PAD = 0
TOLERANCE = 1e-4  # float32 log-probs and entropy of the three methods (measured: ~1e-6)

# A method: per sample, the log-probs and entropy [R_i] of its response tokens.
LogProbs = Callable[[LlamaForCausalLM, "Rollout"], tuple[list[Tensor], list[Tensor]]]


@dataclass(frozen=True)
class Rollout:
    """Each sample's tokens ``[L_i]`` (prompt + response; the ``G`` samples of a group
    share their prompt), its response length, the group size ``G``, and the two layouts
    of the same samples: ``shared`` (one star per group) and ``packed`` (back to back)."""

    tokens: list[Tensor]
    response_lengths: list[int]
    group: int
    shared: cpslice.Layout
    packed: cpslice.Layout


def rollout(
    vocab: int, prompt_lengths: Sequence[int], group: int, max_response: int, seed: int
) -> Rollout:
    """Random prompts, ``group`` responses per prompt of random lengths (1 to
    ``max_response``, the group's all different where ``max_response >= group``)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, responses = [], []
    for p in prompt_lengths:
        prompt = torch.randint(1, vocab, (p,), generator=gen)
        lengths = torch.randperm(max_response, generator=gen)[:group] + 1
        if len(lengths) < group:  # fewer lengths than responses: repeats
            lengths = torch.randint(1, max_response + 1, (group,), generator=gen)
        for r in lengths.tolist():
            tokens.append(torch.cat([prompt, torch.randint(1, vocab, (r,), generator=gen)]))
            responses.append(r)
    total = [len(t) for t in tokens]
    shared = cpslice.Layout(total, responses, shared_prefix=[group] * len(prompt_lengths))
    return Rollout(tokens, responses, group, shared, cpslice.Layout(total, responses))


def forward_tokens(batch: Rollout, method: str) -> int:
    """The rows the model runs on: ``T`` of the layout, or ``B * S`` of the padded rows."""
    if method == "padded":
        return len(batch.tokens) * max(len(t) for t in batch.tokens)
    layout = batch.shared if method == "shared" else batch.packed
    return int(cpslice.position_ids(layout).numel())


def _packed_hidden(model: LlamaForCausalLM, batch: Rollout, layout: cpslice.Layout) -> Tensor:
    """The final hidden states ``[T, H]`` of the packed tokens under the layout's mask.

    transformers (5.x) passes a 4-D mask to the attention as it is. With
    ``attn_implementation="sdpa"`` (transformers' default, which tiny_llama keeps) a bool
    mask is what ``scaled_dot_product_attention`` takes (True: attend). The "eager"
    attention adds the mask to the scores: there a bool mask is silently read as 0 / +1
    (checked: the branches' log-probs then differ by ~1e-2), so it needs
    ``torch.zeros(T, T).masked_fill(~mask, float("-inf"))`` instead (checked: equal,
    to eager's float32 softmax).
    """
    assert model.config._attn_implementation == "sdpa", "a bool mask is sdpa's"
    ids = cpslice.pack(batch.tokens, layout, fill=PAD)
    mask = cpslice.attention_mask(layout)
    out = model.model(ids[None], attention_mask=mask[None, None],
                      position_ids=cpslice.position_ids(layout)[None])
    hidden: Tensor = out.last_hidden_state[0]
    return hidden


def _hidden_method(which: str) -> LogProbs:
    def log_probs(model: LlamaForCausalLM, batch: Rollout) -> tuple[list[Tensor], list[Tensor]]:
        layout = batch.shared if which == "shared" else batch.packed
        hidden = _packed_hidden(model, batch, layout)
        return cpslice.response_log_probs_from_hidden(
            hidden, model.lm_head.weight, batch.tokens, layout, with_entropy=True)

    log_probs.__doc__ = f"cpslice from the hidden states of the {which} layout's tokens."
    return log_probs


shared_log_probs = _hidden_method("shared")
packed_log_probs = _hidden_method("packed")


def shared_log_probs_from_logits(
    model: LlamaForCausalLM, batch: Rollout
) -> tuple[list[Tensor], list[Tensor]]:
    """``shared_log_probs`` through the model's ``[T, V]`` logits and
    ``cpslice.response_log_probs`` instead of the hidden states."""
    hidden = _packed_hidden(model, batch, batch.shared)
    logits = model.lm_head(hidden)
    return cpslice.response_log_probs(logits, batch.tokens, batch.shared, with_entropy=True)


def padded_log_probs(model: LlamaForCausalLM, batch: Rollout) -> tuple[list[Tensor], list[Tensor]]:
    """The textbook way, no cpslice: one right-padded row per sample, Hugging Face's
    2-D attention mask and default position ids, the ``[B, S, V]`` logits'
    ``log_softmax`` (in at least float32) gathered at each response token."""
    width = max(len(t) for t in batch.tokens)
    ids = torch.full((len(batch.tokens), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(batch.tokens):
        ids[i, : len(t)], mask[i, : len(t)] = t, 1
    logits = model(ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    lps, ents = [], []
    for i, (t, r) in enumerate(zip(batch.tokens, batch.response_lengths)):
        rows = logp[i, len(t) - r - 1 : len(t) - 1]  # the rows that predict the response
        lps.append(rows.gather(1, t[-r:, None])[:, 0])
        ents.append(-(rows.exp() * rows).sum(-1))
    return lps, ents


METHODS: dict[str, LogProbs] = {
    "shared": shared_log_probs, "packed": packed_log_probs, "padded": padded_log_probs,
}


@dataclass
class Step:
    """One forward + backward: the log-probs and entropy (detached), every parameter's
    gradient by name, and the wall and process CPU seconds it took (CPU time is the
    steadier on a shared machine)."""

    log_probs: list[Tensor]
    entropy: list[Tensor]
    grads: dict[str, Tensor]
    seconds: float
    cpu_seconds: float


def step(model: LlamaForCausalLM, batch: Rollout, method: LogProbs, seed: int = 1) -> Step:
    """Forward + backward of ``sum(w * log_probs) + sum(u * entropy)``, ``w`` and ``u``
    random per token (from ``seed``: the same for every method), into every parameter."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(r, generator=gen), torch.randn(r, generator=gen))
               for r in batch.response_lengths]
    start, cpu = time.perf_counter(), time.process_time()
    lp, ent = method(model, batch)
    loss = sum(((w.to(x.dtype) * x).sum() + (u.to(e.dtype) * e).sum()
                for x, e, (w, u) in zip(lp, ent, weights)), torch.zeros((), dtype=lp[0].dtype))
    torch.autograd.backward(loss)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.clone()
    return Step([x.detach() for x in lp], [e.detach() for e in ent], grads, seconds, cpu)


def largest_differences(got: Step, want: Step) -> list[tuple[float, float]]:
    """Per sample, the largest ``|got - want|`` of its log-probs and of its entropy."""
    def most(x: Tensor, y: Tensor) -> float:
        return float((x - y.to(x.dtype)).abs().max()) if x.numel() else 0.0

    return [(most(a, b), most(c, d)) for a, b, c, d in
            zip(got.log_probs, want.log_probs, got.entropy, want.entropy)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, nargs="+", default=[48, 80],
                        help="prompt lengths, one group per prompt")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (G)")
    parser.add_argument("--max-response", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    batch = rollout(args.vocab, args.prompts, args.group, args.max_response, seed=0)
    longest = max(len(t) for t in batch.tokens)
    model = tiny_llama(vocab=args.vocab, hidden=args.hidden, positions=max(64, longest))
    print(f"LlamaForCausalLM: 2 layers, hidden {args.hidden}, vocabulary {args.vocab}, sdpa; "
          f"{len(args.prompts)} prompts {args.prompts} x G = {args.group} responses of "
          f"lengths {batch.response_lengths}")
    step(model, batch, shared_log_probs)  # warm-up: lazy imports, first allocations
    steps = {name: step(model, batch, fn) for name, fn in METHODS.items()}
    print(f"{'method':<8}{'forward tokens':>16}{'fwd + bwd wall ms':>19}{'CPU ms':>8}")
    for name, s in steps.items():
        print(f"{name:<8}{forward_tokens(batch, name):>16}{1e3 * s.seconds:>19.0f}"
              f"{1e3 * s.cpu_seconds:>8.0f}")
    worst = 0.0
    for name in ("packed", "padded"):
        diffs = largest_differences(steps["shared"], steps[name])
        print(f"shared against {name}, per sample max |log-prob diff| / max |entropy diff|:")
        print("  " + "  ".join(f"{a:.1e}/{b:.1e}" for a, b in diffs))
        worst = max(worst, *(max(a, b) for a, b in diffs))
    if worst > TOLERANCE:
        print(f"FAIL: the methods differ by {worst:.2e} > {TOLERANCE:g}")
        return 1
    print(f"the same log-probs and entropy within {TOLERANCE:g} (largest difference {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
