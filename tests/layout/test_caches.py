"""The module-level caches: bounded, clearable, and a step's own entries survive the
planning of a redistribute route (which reads every rank's layout); and the compiler
boundary in front of them, which calls the function itself until ``torch._dynamo`` is
imported and its ``torch.compiler.disable`` version from then on (tests/glue/test_compile.py
compiles through it)."""

import os
import sys
from pathlib import Path

import torch

import cpslice
from cpslice import Layout, extract_responses, pack, shard_responses, shifted_targets
from cpslice._cache import _CACHES, cache_info, cache_sizes
from cpslice._layout.plan import _read, selection
from cpslice._layout.redistribute import _route

from ..support import background
from ..support.background import Job


def _step(layout: Layout, tokens: list[torch.Tensor]) -> None:
    length = pack(tokens, layout).shape[0]
    shifted_targets(tokens, layout)
    extract_responses(torch.zeros(length), layout)
    shard_responses([torch.zeros(r) for r in layout.response_lengths], layout)


def test_every_cache_is_bounded_and_clear_caches_empties_them() -> None:
    assert _CACHES and all(c.cache_parameters()["maxsize"] is not None for c in _CACHES)
    assert all(c.cache_parameters()["maxsize"] <= 64 for c in _CACHES)
    layout = Layout([10, 6, 3], [4, 2, 1], cp_mode="zigzag", cp_rank=1, cp_size=2)
    _step(layout, [torch.arange(t) for t in layout.total_lengths])
    assert sum(cache_sizes().values()) > 0
    cpslice.clear_caches()
    assert set(cache_sizes().values()) == {0}


def test_a_route_miss_does_not_evict_the_steps_own_entries() -> None:
    cpslice.clear_caches()
    total, response = [10, 6, 3, 17, 9], [4, 2, 1, 9, 0]
    zig = Layout(total, response, cp_mode="zigzag", cp_rank=1, cp_size=8)
    tokens = [torch.arange(t) for t in total]
    _step(zig, tokens)
    step_entries = selection.__wrapped__.cache_info().currsize  # type: ignore[attr-defined]
    # a new route reads all 8 ranks' selections of src and of dst
    allgather = Layout(total, response, cp_mode="allgather", cp_rank=1, cp_size=8, local_length=6)
    _route(allgather, 6, zig, cpslice.pack(tokens, zig).shape[0], 8, 0)
    before, reads = cache_info(selection), cache_info(_read)
    _step(zig, tokens)
    after = cache_info(selection)
    assert after.misses == before.misses, "the step's selections were evicted by the route"
    assert after.currsize == step_entries
    # the step's resolved reads are hits of their own cache, which the route never fills
    assert cache_info(_read).misses == reads.misses and cache_info(_read).hits > reads.hits


BOUNDARY = """
import sys
import torch
from cpslice._cache import boundary, cache_info, cached

@cached(maxsize=4)
def plan(n: int) -> str:
    \"\"\"A plan.\"\"\"
    return sys._getframe(1).f_code.co_filename  # who called the cached function

assert (plan.__name__, plan.__doc__, plan.__wrapped__.__wrapped__.__name__) == (
    "plan", "A plan.", "plan")
assert plan.__annotations__ == {"n": int, "return": str}
before = plan(1)
assert "torch._dynamo" not in sys.modules, "a boundary's call imported torch._dynamo"
import torch._dynamo
plan.__wrapped__.cache_clear()  # the next call runs the function again
after = plan(1), plan(1)
print(before, after[0], cache_info(plan).hits)
"""


def _boundary() -> dict[str, Job]:
    """``BOUNDARY`` in a fresh interpreter, as a background job (tests/support/background.py)."""
    env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
    return {"boundary": Job((sys.executable, "-c", BOUNDARY), env, Path(__file__).resolve().parents[2])}


background.register("boundary", "tests/layout/test_caches.py::test_a_boundary_calls", _boundary)


def test_a_boundary_calls_the_function_until_the_compiler_is_imported() -> None:
    proc = background.result("boundary", timeout=200)["boundary"]
    assert proc.code == 0, proc.err[-4000:]
    before, after, hits = proc.out.split()
    # lru_cache is C: the cached function's caller is the wrapper, then dynamo's
    assert before.endswith(os.path.join("cpslice", "_cache.py")), before
    assert after.endswith(os.path.join("_dynamo", "eval_frame.py")), after
    assert hits == "1", "the cache is honoured through the disabled version"
