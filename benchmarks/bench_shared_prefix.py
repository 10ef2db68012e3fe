"""Shared-prefix packing through a Hugging Face Llama: each prompt once against G times.

One GRPO group: a prompt of ``P`` tokens and ``G`` responses of ``R`` tokens each, the
forward + backward of a small ``LlamaForCausalLM`` (random weights from a
``LlamaConfig``; ``sdpa`` attention) and of the log-prob and entropy of every response
token (a random upstream gradient on both) into every parameter. Methods:

- ``shared``: ``Layout(total, response, shared_prefix=[G])``, the star packed by
  ``cpslice.pack`` (``P + G * R`` rows), ``cpslice.attention_mask`` as a 4-D bool mask
  and ``cpslice.position_ids``;
- ``unshared``: the ``G`` samples as ``[G, P + R]`` rows (``G * (P + R)`` tokens), the
  model's own causal mask and positions, the same samples' ``Layout(total, response)``.

Both take the log-probs and entropy with ``cpslice.response_log_probs_from_hidden``
from the final hidden states and ``lm_head.weight`` (the ``G * R`` response rows only),
so the two differ in the model's rows alone.

Each method runs in a fresh subprocess. After one warm-up step, the allocator's free
heap is returned and the peak RSS reset (``harness.peak_growth``); peak memory is the
growth of the peak RSS (``VmHWM``) during the next step beyond the RSS before it (the
model and its inputs exist; the parameters' gradients, which the step allocates, are
included), in MiB. Time is the median of ``--repeat`` further steps (at least one),
wall and process CPU time.

Run: ``.venv/bin/python -m benchmarks.bench_shared_prefix [--quick] [--repeat N]
[--threads N]``
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

METHODS = ("shared", "unshared")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The model: hidden, layers, heads, MLP width, vocabulary.
MODEL = (256, 2, 4, 704, 4096)
QUICK_MODEL = (64, 2, 4, 128, 1024)


@dataclass
class Result:
    method: str
    p: int
    r: int
    g: int
    hidden: int
    layers: int
    vocab: int
    parameters: int
    tokens: int  # the rows the model runs on
    peak_mib: float  # peak RSS growth of a step beyond the model and inputs
    median_ms: float
    cpu_ms: float  # process CPU time of the same steps (steadier on a shared machine)


def _model(hidden: int, layers: int, heads: int, mlp: int, vocab: int, positions: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == "sdpa"  # transformers' default (where the model supports it)
    return model


def _step(method: str, p: int, r: int, g: int, model: Any) -> tuple[Callable[[], None], int]:
    """The step of ``method`` and the rows the model runs on."""
    import cpslice

    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (p,), generator=gen)
    tokens = [torch.cat([prompt, torch.randint(1, vocab, (r,), generator=gen)]) for _ in range(g)]
    up = [(torch.randn(r, generator=gen), torch.randn(r, generator=gen)) for _ in range(g)]
    total, response = [p + r] * g, [r] * g
    if method == "shared":
        layout = cpslice.Layout(total, response, shared_prefix=[g])
        ids = cpslice.pack(tokens, layout)[None]
        kwargs: dict[str, Tensor] = {"attention_mask": cpslice.attention_mask(layout)[None, None],
                                     "position_ids": cpslice.position_ids(layout)[None]}
    else:
        layout = cpslice.Layout(total, response)  # [G, P + R] rows, flattened: back to back
        ids, kwargs = torch.stack(tokens), {}

    def step() -> None:
        hidden = model.model(ids, **kwargs).last_hidden_state
        lp, ent = cpslice.response_log_probs_from_hidden(
            hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, tokens, layout,
            with_entropy=True)
        loss = sum(((a * w).sum() + (e * u).sum() for a, e, (w, u) in zip(lp, ent, up)),
                   torch.zeros(()))
        torch.autograd.backward(loss)
        model.zero_grad(set_to_none=True)

    return step, int(ids.numel())


def _child(method: str, p: int, r: int, g: int, quick: int, repeat: int, threads: int) -> Result:
    import cpslice  # noqa: F401  (imported before the baseline: its modules are not the step's memory)

    if threads:
        torch.set_num_threads(threads)
    hidden, layers, heads, mlp, vocab = QUICK_MODEL if quick else MODEL
    model = _model(hidden, layers, heads, mlp, vocab, p + r)
    step, tokens = _step(method, p, r, g, model)
    step()  # warm-up: lazy imports, the allocator's first pages
    peak = peak_growth(step)
    times = []
    for _ in range(max(repeat, 1)):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    parameters = sum(x.numel() for x in model.parameters())
    return Result(method, p, r, g, hidden, layers, vocab, parameters, tokens, peak / 2**20,
                  1e3 * statistics.median(w for w, _ in times),
                  1e3 * statistics.median(c for _, c in times))


def _in_subprocess(method: str, sizes: tuple[int, ...], repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, *map(str, sizes), str(repeat), str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(quick: bool = False, repeat: int = 1, threads: int = 0) -> list[Result]:
    """One Result per method, each measured in a fresh subprocess: ``P, R, G`` (and
    ``quick`` picks the small model)."""
    sizes = (128, 32, 4, 1) if quick else (1024, 256, 8, 0)
    return [_in_subprocess(m, sizes, repeat, threads) for m in METHODS]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"P={first.p} R={first.r} G={first.g}; LlamaForCausalLM of {first.layers} layers, "
        f"hidden {first.hidden}, vocabulary {first.vocab} ({first.parameters / 1e6:.1f}M "
        f"parameters), float32, sdpa; forward + backward of the response tokens' log-probs "
        f"and entropy into every parameter")
    say(f"{'method':<10}{'forward tokens':>16}{'peak MiB':>10}{'wall ms':>10}{'CPU ms':>10}")
    for r in results:
        say(f"{r.method:<10}{r.tokens:>16}{r.peak_mib:>10.0f}{r.median_ms:>10.0f}{r.cpu_ms:>10.0f}")
    by = {r.method: r for r in results}
    s, u = by["shared"], by["unshared"]
    expected = (s.p + s.g * s.r) / (s.g * (s.p + s.r))
    say(f"shared/unshared: tokens {s.tokens / u.tokens:.3f}x ((P + G*R) / (G*(P + R)) = "
        f"{expected:.3f}), memory {s.peak_mib / u.peak_mib:.3f}x, time {s.median_ms / u.median_ms:.2f}x "
        f"(CPU time {s.cpu_ms / u.cpu_ms:.2f}x)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed steps after the warm-up and the measured one (at least 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per method (0: torch's default)")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, *numbers = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        print(json.dumps(_child(method, *map(int, numbers)).__dict__))
        return 0
    report(run(args.quick, args.repeat, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
