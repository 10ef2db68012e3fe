"""The instrumentation hook (``cpslice._probe``, docs/dev/instrumentation.md): inactive outside
its blocks, each watch seeing its own block's events, substitutions restored, and the
fixed set of steps."""

import pytest
import torch

from cpslice import _probe, log_probs_and_entropy
from cpslice._vocab import spec
from cpslice._vocab.backends import selection


def _on() -> bool:
    """Whether the hook is active (read afresh: no narrowing of the module's attribute)."""
    return _probe.active is not None


def _step(rows: int = 8) -> None:
    logits = torch.randn(rows, 16, requires_grad=True)
    lp, _ = log_probs_and_entropy(logits, torch.zeros(rows, dtype=torch.int64), chunk_size=4)
    lp.sum().backward()  # type: ignore[no-untyped-call]


def test_inactive_outside_its_blocks() -> None:
    assert not _on()
    with _probe.watch():
        assert _on()
        with _probe.substitute("merge_tiles", spec.merge_tiles):
            pass
        assert _on()
    assert not _on()  # each site's one check finds None again
    with pytest.raises(RuntimeError, match="inside"), _probe.substitute("merge_tiles", spec.merge_tiles):
        raise RuntimeError("inside")
    assert not _on()  # closed on an exception too


def test_each_watch_sees_its_own_block() -> None:
    with selection.using("eager"), _probe.watch() as outer:
        _step()
        with _probe.watch() as inner:
            _step(4)
        _step()
    assert [(e.name, e.rows) for e in inner.of("call")] == [("stats", 4), ("grad", 4)]
    assert inner.count("launch", backend="eager") == 2 and inner.rows("launch") == 8
    assert outer.count("call") == 6 and outer.count("launch", backend="eager") == 2 * 4 + 2
    assert outer.count("launch", backend="compiled") == outer.count("collective") == 0


def test_a_substitute_runs_in_its_block_and_the_step_is_restored() -> None:
    calls: list[str] = []

    def outer(*args: object) -> object:
        calls.append("outer")
        return spec.merge_tiles(*args)  # type: ignore[arg-type]

    def inner(*args: object) -> object:
        calls.append("inner")
        return spec.merge_tiles(*args)  # type: ignore[arg-type]

    logits = torch.randn(3, 300)
    ids = torch.zeros(3, dtype=torch.int64)
    want = log_probs_and_entropy(logits, ids, invariant=True)[0]
    with _probe.substitute("merge_tiles", outer):
        with _probe.substitute("merge_tiles", inner):
            got = log_probs_and_entropy(logits, ids, invariant=True)[0]
        assert calls and set(calls) == {"inner"}
        calls.clear()
        log_probs_and_entropy(logits, ids, invariant=True)
        assert calls and set(calls) == {"outer"}
    calls.clear()
    log_probs_and_entropy(logits, ids, invariant=True)
    assert calls == []
    assert torch.equal(got, want)  # the substitutes call the real merge


def test_the_steps_are_a_fixed_set() -> None:
    assert set(_probe.STEPS) == {"merge_tiles", "row_kernel", "host_checks", "rank_main", "triton_exp",
                                 "triton_tree", "triton_pad", "triton_scratch_rows", "block_sizes",
                                 "block_gemm"}
    # the debug wrappers' TypeError where the tests run them (the name is no Step), else the hook's
    with pytest.raises((ValueError, TypeError), match="tile_merge"):
        with _probe.substitute("tile_merge", spec.merge_tiles):  # type: ignore[arg-type]
            pass
    assert not _on()
