"""A training step that calls cpslice runs under ``torch.compile`` with the results of
eager mode, values and gradients; the planning code stays behind its boundaries, so
the graph breaks are few (docs/caches-and-compile.md lists them).

Twice: with the eager step first (``torch._dynamo`` imported before cpslice, as a
program that compiles imports it), and with the compiled step first, where nothing
imports ``torch._dynamo`` before ``torch.compile`` and the first call of every boundary
is one that dynamo meets while tracing (the boundaries decide at each call whether
``torch._dynamo`` is loaded: ``cpslice/_cache.py``)."""

import pytest

from ..support import compile_job


@pytest.mark.parametrize("first", compile_job.FIRSTS)
def test_a_compiled_step_equals_eager(first: str) -> None:
    # the step ran in the background from the session's start (tests/support/compile_job.py)
    proc = compile_job.result(first)
    assert proc.code == 0, proc.err[-4000:]
    reasons = [line for line in proc.out.splitlines() if line.startswith("break:")]
    assert reasons, "no graph break: the planning code was traced"
    # every graph break is a planning boundary of cpslice (torch.compiler.disable)
    unplanned = [r for r in reasons if "torch.compiler.disable" not in r]
    assert unplanned == [], "\n".join(unplanned)
    # a boundary traced as a frame of its own (its code shared by every boundary) would
    # also exceed dynamo's recompile limit
    assert "recompile_limit" not in proc.err, proc.err[-4000:]
    # response_log_probs alone (docs/caches-and-compile.md): the one resolution of the
    # layout, the host check of the targets' ids, the engine's index of response rows
    # (dynamo counts each once per attempt at tracing the frame around it: sites, not
    # counts)
    sites = {line.split()[1] for line in proc.out.splitlines() if line.startswith("lp-break:")}
    assert sites == {"resolve", "in_vocabulary", "index_of"}, sites
