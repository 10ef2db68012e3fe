"""A Hugging Face batch of left-padded rows: the hidden-state path against the slicing recipe.

The batch as TRL, OpenRLHF and verl (without remove-padding) hold it: ``B`` rows of
``S`` columns, each prompt (random lengths) left-padded to the longest, ``P`` columns,
its response right after it, then padding up to the padded response width
``R = S - P``. Methods, both computing the log-prob of every response token and its
entropy and back-propagating a random upstream gradient on both into the final hidden
states ``[B, S, H]`` and the LM-head weight ``[V, H]``:

- ``cpslice``: ``Layout.from_attention_mask`` and
  ``response_log_probs_from_hidden(..., with_entropy=True)`` (the response rows only,
  vocabulary tiles: no ``[B, S, V]`` tensor);
- ``recipe``: the trainers' slicing on materialized float32 logits: ``logits = hidden
  @ weight.T`` (``[B, S, V]``), ``log_softmax(logits[:, -R-1:-1])``, gathered at the
  response ids, the entropy from the same, masked by the response mask.

Each method runs in a fresh subprocess. After one warm-up step, the allocator's free
heap is returned and the peak RSS reset (``harness.peak_growth``); peak memory is
the growth of the peak RSS (``VmHWM``) during the next step beyond the RSS before it,
once the inputs exist (the two gradients the step produces included), in MiB. Time is
the median of ``--repeat`` further steps (at least one), wall and process CPU time.

Run: ``.venv/bin/python -m benchmarks.bench_hf [--quick] [--repeat N]``
"""

import argparse
import json
import os
import random
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

METHODS = ("cpslice", "recipe")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    method: str
    b: int
    s: int
    h: int
    v: int
    tokens: int  # response tokens of the batch
    peak_mib: float  # peak RSS growth of a step beyond its inputs
    median_ms: float
    cpu_ms: float  # process CPU time of the same steps (steadier on a shared machine)


@dataclass
class _Batch:
    ids: Tensor  # [B, S]
    mask: Tensor  # [B, S] attention mask
    response_mask: Tensor  # [B, R]
    hidden: Tensor  # [B, S, H], requires grad
    weight: Tensor  # [V, H], requires grad
    g: tuple[Tensor, Tensor]  # upstream gradients of log-probs and entropy, [B, R]


def _batch(b: int, s: int, h: int, v: int, prompts: tuple[int, int]) -> _Batch:
    """Prompts of ``prompts[0]`` to ``prompts[1]`` tokens left-padded to the longest; each
    response half to all of the columns after it, its last column padding or not."""
    rng = random.Random(0)
    torch.manual_seed(0)
    prompt = [rng.randint(*prompts) for _ in range(b)]
    width = max(prompt)
    mask = torch.zeros(b, s, dtype=torch.int64)
    for i, p in enumerate(prompt):
        mask[i, width - p : width + rng.randint((s - width) // 2, s - width)] = 1
    ids = torch.randint(0, v, (b, s)) * mask
    hidden = torch.randn(b, s, h).requires_grad_(True)
    weight = (torch.randn(v, h) / h**0.5).requires_grad_(True)
    g = (torch.randn(b, s - width), torch.randn(b, s - width))
    return _Batch(ids, mask, mask[:, width:], hidden, weight, g)


def _cpslice(x: _Batch) -> Callable[[], None]:
    from cpslice import Layout, response_log_probs_from_hidden

    rows, width, size = x.hidden.shape
    layout = Layout.from_attention_mask(x.mask, x.response_mask.sum(1).tolist())
    tokens = [ids[m.bool()] for ids, m in zip(x.ids, x.mask)]
    keep = [m.bool() for m in x.response_mask]
    g_lp, g_ent = ([row[k] for row, k in zip(g, keep)] for g in x.g)

    def step() -> None:
        lp, ent = response_log_probs_from_hidden(
            x.hidden.reshape(rows * width, size), x.weight, tokens, layout, with_entropy=True)
        loss = sum(((a * ga).sum() + (e * ge).sum() for a, e, ga, ge in zip(lp, ent, g_lp, g_ent)),
                   torch.zeros(()))
        torch.autograd.backward(loss)

    return step


def _recipe(x: _Batch) -> Callable[[], None]:
    resp = x.response_mask.shape[1]
    targets = x.ids[:, -resp:, None]
    weights = [g * x.response_mask for g in x.g]

    def step() -> None:
        logits = x.hidden @ x.weight.T  # [B, S, V] float32
        logp = torch.log_softmax(logits[:, -resp - 1 : -1], -1)
        picked = logp.gather(2, targets)[..., 0]
        entropy = -(logp.exp() * logp).sum(-1)
        torch.autograd.backward((picked * weights[0]).sum() + (entropy * weights[1]).sum())

    return step


def _child(method: str, b: int, s: int, h: int, v: int, low: int, high: int, repeat: int) -> Result:
    import cpslice  # noqa: F401  (imported before the baseline: its modules are not the step's memory)

    x = _batch(b, s, h, v, (low, high))
    inner = (_cpslice if method == "cpslice" else _recipe)(x)

    def step() -> None:
        inner()
        x.hidden.grad = x.weight.grad = None

    step()  # warm-up: lazy imports, the allocator's first pages
    peak = peak_growth(step)
    times = []
    for _ in range(max(repeat, 1)):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return Result(method, b, s, h, v, int(x.response_mask.sum()), peak / 2**20,
                  1e3 * statistics.median(w for w, _ in times),
                  1e3 * statistics.median(c for _, c in times))


def _in_subprocess(method: str, sizes: tuple[int, ...], repeat: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, *map(str, sizes), str(repeat)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(quick: bool = False, repeat: int = 1) -> list[Result]:
    """One Result per method, each measured in a fresh subprocess (``run(quick)`` as
    the other benchmarks): ``B, S, H, V`` and the prompt lengths' range."""
    sizes = (4, 256, 256, 8192, 50, 175) if quick else (8, 1024, 1024, 32768, 200, 700)
    return [_in_subprocess(m, sizes, repeat) for m in METHODS]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    logits = first.b * first.s * first.v * 4 / 2**20
    say(f"B={first.b} S={first.s} H={first.h} V={first.v} float32, left-padded prompts, "
        f"{first.tokens} response tokens; forward + backward of log-probs and entropy "
        f"into hidden and weight (the [B, S, V] float32 logits: {logits:.0f} MiB)")
    say(f"{'method':<10}{'peak MiB beyond inputs':>24}{'wall ms':>10}{'CPU ms':>10}")
    for r in results:
        say(f"{r.method:<10}{r.peak_mib:>24.0f}{r.median_ms:>10.0f}{r.cpu_ms:>10.0f}")
    by = {r.method: r for r in results}
    c, o = by["cpslice"], by["recipe"]
    memory, wall = c.peak_mib / o.peak_mib, c.median_ms / o.median_ms
    say(f"cpslice/recipe: memory {memory:.3f}x{'' if memory <= 0.25 else '!'} (target <= 0.25x), "
        f"time {wall:.2f}x{'' if wall <= 1.3 else '!'} (target <= 1.3x; CPU time "
        f"{c.cpu_ms / o.cpu_ms:.2f}x)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed steps after the warm-up and the measured one (at least 1)")
    parser.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, *numbers = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        print(json.dumps(_child(method, *map(int, numbers)).__dict__))
        return 0
    report(run(args.quick, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
