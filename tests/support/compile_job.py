"""The compiled training step of ``tests/glue/test_compile.py``, run in fresh interpreters as
background jobs (``background.py``): each compiles for about twenty seconds of CPU and
needs nothing from the session, so both run, niced, beside the other tests, and the
compile test waits for them.

Twice: with the eager step first (``torch._dynamo`` imported before cpslice, as a
program that compiles imports it), and with the compiled step first, where nothing
imports ``torch._dynamo`` before ``torch.compile``. The script prints each graph break
of the step (``break:``) and the sites where ``response_log_probs`` alone breaks
(``lp-break:``).
"""

import os
import sys
from pathlib import Path

from . import background
from .background import Done, Job

FIRSTS = ("eager", "compiled")

STEP = r"""
import sys
import torch
if sys.argv[1] == "eager":
    import torch._dynamo
import cpslice

torch.manual_seed(0)
total, response = [12, 9, 5, 3], [3, 8, 0, 2]
layout = cpslice.Layout(total, response, cp_mode="zigzag", cp_rank=1, cp_size=2)
tokens = [torch.randint(0, 50, (t,)) for t in total]
masks = [torch.rand(r) > 0.3 for r in response]
old = [torch.randn(r) for r in response]
T = 18  # zigzag at cp 2: each sample padded to a multiple of 4 (36 positions), half here

def step(logits):
    lp, ent = cpslice.response_log_probs(logits, tokens, layout, with_entropy=True,
                                         temperature=0.7)
    ratio = [(a - b).exp() for a, b in zip(lp, cpslice.shard_responses(old, layout))]
    return (cpslice.sum_of_sample_means(ratio, masks, layout)
            - 0.01 * cpslice.sum_of_tokens(ent, masks, layout))

def compiled(logits):
    logits.grad = None
    got = torch.compile(step, backend="aot_eager")(logits)
    got.backward()
    return got.detach(), logits.grad.clone()

logits = torch.randn(T, 50, requires_grad=True)
if sys.argv[1] == "compiled":
    assert "torch._dynamo" not in sys.modules, "import cpslice imported torch._dynamo"
    runs = [compiled(logits) for _ in range(2)]  # the second reuses the compiled graphs
logits.grad = None
eager = step(logits)
eager.backward()
expected = logits.grad.clone()
if sys.argv[1] == "eager":
    runs = [compiled(logits) for _ in range(2)]
assert cpslice.pack(tokens, layout).shape[0] == T
for got, grad in runs:
    torch.testing.assert_close(got, eager.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)
for reason in torch._dynamo.utils.counters["graph_break"]:
    print("break:", reason.splitlines()[0], "|", " ".join(reason.split())[:160])

# response_log_probs alone, in the same process: where its graph breaks
import re

def log_probs(x):
    lp, ent = cpslice.response_log_probs(x, tokens, layout, with_entropy=True, temperature=0.7)
    return sum(a.sum() for a in lp) + sum(h.sum() for h in ent)

torch._dynamo.reset()  # the step's compiled frames would hide the breaks they share
torch._dynamo.utils.counters.clear()
logits.grad = None
torch.compile(log_probs, backend="aot_eager")(logits).backward()
for reason in torch._dynamo.utils.counters["graph_break"]:
    site = re.search(r"<function (\w+) at", reason)
    print("lp-break:", site.group(1) if site else reason.splitlines()[0])
"""



def jobs() -> dict[str, Job]:
    """The step in a fresh interpreter per ``FIRSTS`` entry, run-time checking off."""
    env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
    cwd = Path(__file__).resolve().parents[2]
    return {first: Job((sys.executable, "-c", STEP, first), env, cwd) for first in FIRSTS}


def result(first: str, timeout: float = 200) -> Done:
    """The run of the step with ``first`` first, once it has ended."""
    return background.result("compile", timeout)[first]


background.register("compile", "tests/glue/test_compile.py", jobs)
