"""``vocab_divergence``'s peak memory, forward + backward with float32 logits: at most
1.15x one ``[T, V]`` float32 buffer, the student's gradient included (2.15x when the
teacher requires grad too: its gradient is the second buffer), for every kind.

Measured as the benchmarks measure it (``benchmarks/harness.py``'s ``peak_growth``: the
growth of the peak RSS during one step beyond the RSS before it, the inputs existing), in
a fresh interpreter run as a background job (tests/background.py): nothing else of the
session allocates in it. The eager kernels at 4 rows a chunk, so that a chunk's
temporaries are small beside ``[T, V]`` at this test's size (the default chunk is sized
in bytes for the cache; ``benchmarks/bench_divergence.py`` measures it at T = 4096);
a second ``[T, V]`` buffer anywhere (a gradient computed then copied, a materialized
softmax) is a full unit more."""

import json
import os
import sys
from pathlib import Path

from ..support import background
from ..support.background import Job

T, V, CHUNK = 1024, 16384, 4
CASES = (("forward", False), ("reverse", True), ("jsd", False))
"""Each kind once, ``(kind, teacher requires grad)``."""

SCRIPT = f"""
import json
import torch
from benchmarks.harness import peak_growth
from cpslice import vocab_divergence
from cpslice._vocab.backends import selection

torch.set_num_threads(1)
torch.manual_seed(0)
student = (torch.randn({T}, {V}) * 2).requires_grad_()
teacher = torch.randn({T}, {V}) * 2
unit = student.numel() * student.element_size()
peaks = {{}}
with selection.using("eager"):
    warm = torch.zeros(2, 3, requires_grad=True)  # lazy imports, outside the measured steps
    vocab_divergence(warm, torch.zeros(2, 3), kind="jsd").sum().backward()
    for kind, teacher_grad in {CASES!r}:
        teacher.requires_grad_(teacher_grad)

        def step():
            value = vocab_divergence(student, teacher, kind=kind, temperature=0.9, chunk_size={CHUNK})
            value.mean().backward()
            student.grad = teacher.grad = None

        peaks[kind] = peak_growth(step) / unit
print(json.dumps(peaks))
"""


def _jobs() -> dict[str, Job]:
    env = {k: v for k, v in os.environ.items() if k not in ("CPSLICE_DEBUG", "CPSLICE_BACKEND")}
    return {"peaks": Job((sys.executable, "-c", SCRIPT), env, Path(__file__).resolve().parents[2])}


background.register("divergence-memory", "tests/vocabulary/test_divergence_memory.py", _jobs)


def test_forward_and_backward_peak_at_most_one_buffer_and_a_seventh() -> None:
    done = background.result("divergence-memory", timeout=200)["peaks"]
    assert done.code == 0, done.err[-4000:]
    peaks = json.loads(done.out.strip().splitlines()[-1])
    for kind, teacher_grad in CASES:
        gradients = 2 if teacher_grad else 1
        # each gradient is a whole [T, V] buffer: the rest, the chunks' temporaries and
        # [T] statistics, within 0.15 of one
        assert gradients - 0.05 <= peaks[kind] <= gradients + 0.15, (kind, peaks)
