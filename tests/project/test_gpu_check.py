"""The one prepared GPU command (``benchmarks/gpu_check.py``, ``make gpu-check``), kept from
rotting where no GPU is: its smoke run (every stage on the CPU at tiny sizes, cpslice's
Triton kernels through the interpreter, the CUDA tests run and skipped) in a fresh
interpreter, a background job (tests/support/background.py); and its list of CUDA tests, which
must name every test of the suite that runs on CUDA alone."""

import ast
import os
import re
import sys
from pathlib import Path

from benchmarks.gpu_check import CUDA_TESTS
from benchmarks.gpu_peers import methods

from ..support import background
from ..support.background import Job

ROOT = Path(__file__).resolve().parents[2]


def _smoke() -> dict[str, Job]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT)))}
    return {"smoke": Job((sys.executable, "-m", "benchmarks.gpu_check", "--smoke"), env, ROOT)}


background.register("gpu-check", "tests/project/test_gpu_check.py::test_the_smoke_run", _smoke)


def test_the_smoke_run_runs_every_stage_and_passes() -> None:
    done = background.result("gpu-check", timeout=240)["smoke"]
    shown = f"\nstdout:\n{done.out[-4000:]}\nstderr:\n{done.err[-4000:]}"
    assert done.code == 0 and "Traceback" not in done.out + done.err, shown
    tests = re.search(r"^CUDA tests: (\d+) passed, (\d+) failed, (\d+) skipped", done.out, re.M)
    assert tests is not None and int(tests[1]) >= 1 and int(tests[2]) == 0, shown  # run, not only collected
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in done.out.splitlines() if line.startswith("| ")}
    for method in methods():
        line = lines[method.name]
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if method.needs_cuda:  # Liger, cut-cross-entropy: never on the CPU
            assert cells[-1].startswith("skipped:"), line
        else:  # a time against the floor, a peak, errors against float64
            assert all(cells[1:5]) and cells[-1] == "", line
        if method.cpslice:  # through the Triton interpreter
            assert ("invariant_tiles" if method.invariant else "default.stats") in cells[8], line
    for goal in ("log-prob + entropy, forward + backward", "forward-only (log-prob + entropy)",
                 "peak beyond the inputs and their gradients", "invariant mode against the default"):
        assert "unmeasured" not in lines[goal] and "(smoke: not the goal's device or size)" in lines[goal], shown
    for check in ("cpslice's values and gradients against float64", "cpslice's Triton kernels ran",
                  "the logits path's checks"):
        assert lines[check].endswith("| PASS |"), lines[check]
    assert "6 of 6 checks ran" in lines["the logits path's checks"]
    assert done.out.rstrip().splitlines()[-1].endswith("; no check failed"), shown  # and none unmeasured


def _device_cases(tree: ast.Module) -> list[str]:
    """The tests parametrized over ``host_reads.DEVICES`` (a CUDA case each)."""
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("DEVICES" in ast.unparse(d) for d in node.decorator_list)]


def _skips_without_cuda(tree: ast.Module) -> bool:
    """Whether a module calls ``on_cuda`` or ``torch.cuda.is_available`` (a skip mark)."""
    return any(isinstance(node, ast.Call) and ast.unparse(node.func) in ("on_cuda", "torch.cuda.is_available")
               for node in ast.walk(tree))


def test_the_command_runs_every_cuda_test() -> None:
    """A test module that skips without CUDA (``triton_cases.on_cuda``, a
    ``torch.cuda.is_available()`` mark) is in ``CUDA_TESTS`` whole, and the CUDA case of a
    test over ``host_reads.DEVICES`` by its node id."""
    wanted = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree, name = ast.parse(path.read_text()), path.relative_to(ROOT).as_posix()
        if _skips_without_cuda(tree):
            wanted.append(name)
        wanted += [f"{name}::{case}[cuda]" for case in _device_cases(tree)]
    assert {"tests/vocabulary/test_hidden_cuda.py", "tests/vocabulary/test_triton_cuda.py"} <= set(wanted)
    assert sorted(wanted) == sorted(CUDA_TESTS)
