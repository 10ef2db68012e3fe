"""One reading of the layout per call: every public function resolves its layout and
local length once, at its entry (``_plan.resolve``), builds no other ``Layout``, and
hands the resolved record to private workers; followed through a call, the layout's
trip (the cpslice functions it, its resolved record, or the per-sample lengths read off
it are passed to) enters each file at most once more after leaving it, on a new
layout's first call (cold caches) as on the calls that read it again. The call's
arguments are checked at its entry in one pass, a shared prefix's prompts and
temperatures included, not by checks that call back into the file that called them;
a rank's pieces are read once from the placement the Layout keeps of itself
(``Layout._placement``: an ``Order`` or a ``Closed`` form, which like the Layout's own
methods is the record, not a trip); a resolved span (``Read``) keeps what its readings
need of the layout, so no worker reads the layout again."""

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch

import cpslice
from cpslice import Layout
from cpslice import _checks as checks
from cpslice._layout import plan as _plan

PACKAGE = Path(cpslice.__file__).parent
# the functions themselves, under debug mode's wrappers (which share one code object)
RESOLVE = inspect.unwrap(_plan._resolve_length).__code__
BUILD = inspect.unwrap(Layout.__init__).__code__
_FILES: dict[tuple[CodeType, str], str | None] = {}


def _followed_file(code: CodeType) -> str | None:
    """The file, under the package, of a function whose calls the trip follows; None
    outside the package and for the Layout's own methods, which read the record (a
    property, a cache's __eq__): no trip. Read once per code object (the profile
    hook sees every call of the traced step)."""
    key = (code, code.co_filename)  # code objects of equal content compare equal whatever their file
    if key not in _FILES:
        path = Path(code.co_filename)
        own = path.name == "layout.py" and path.parent.name == "_layout" and code.co_qualname.startswith("Layout.")
        _FILES[key] = str(path.relative_to(PACKAGE)) if PACKAGE in path.parents and not own else None
    return _FILES[key]


class Trace:
    """What one call did with ``layout``: resolutions, Layouts built, and the files of
    the cpslice functions that received the layout, its resolved record, or one of the
    per-sample tuples read off it (its lengths, its shared prefix's group sizes: what
    an argument check reads of the layout)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.resolutions = 0
        self.built = 0
        self.files: list[str] = []
        read_off = (layout.total_lengths, layout.response_lengths, layout.shared_prefix)
        self._read_off = [t for t in read_off if t]  # by identity: an empty tuple is any empty tuple

    def _carries(self, frame: FrameType) -> bool:
        code = frame.f_code
        local = frame.f_locals  # a new dict at each read
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            value = local.get(name)
            if value is self.layout or (isinstance(value, _plan.Local) and value.layout is self.layout):
                return True
            if any(value is t for t in self._read_off):
                return True
        return False

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is RESOLVE:
            self.resolutions += 1
        if code is BUILD:
            self.built += 1
        file = _followed_file(code)
        if file is not None and self._carries(frame):
            if not self.files or self.files[-1] != file:
                self.files.append(file)

    def run(self, fn: Callable[[], Any]) -> Any:
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def returns(self) -> dict[str, int]:
        """Per file, how often the trip entered it again after leaving it."""
        seen: dict[str, int] = {}
        for f in self.files:
            seen[f] = seen.get(f, -1) + 1
        return seen


BATCHES = ("simple", "shared")
"""``simple``: three samples (one with no response), a temperature each. ``shared``: a
group of three branches on one prompt (``shared_prefix``) and a sample of its own, one
temperature per group: the shared prompts' and the group temperatures' checks."""


def _batch(cp_mode: str, batch: str = "simple") -> tuple[Layout, list[torch.Tensor], torch.Tensor]:
    shared = batch == "shared"
    total, response = ([5, 7, 6, 6], [2, 4, 3, 2]) if shared else ([9, 4, 7], [3, 0, 4])
    size = 2 if cp_mode != "none" else 1
    layout = Layout(total, response, cp_mode=cp_mode, cp_size=size, cp_rank=size - 1,  # type: ignore[arg-type]
                    local_length=None if cp_mode != "allgather" else 12, shared_prefix=[3, 1] if shared else None)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 6, (t,), generator=gen) for t in total]
    for branch in tokens[1:3] if shared else []:
        branch[:3] = tokens[0][:3]  # the group's one prompt
    rows = 12 if cp_mode == "allgather" else cpslice.pack(tokens, layout).shape[0]
    return layout, tokens, torch.randn(rows, 6, generator=gen, dtype=torch.float64, requires_grad=True)


def _support(layout: Layout) -> cpslice.Support:
    """Response token ``r``'s set: ids ``r`` and ``r + 1`` (one set on a shared prompt's
    row; built before the call: it resolves the layout itself)."""
    ids = [(torch.arange(r).repeat_interleave(2) + torch.arange(2).repeat(r)) % 6 for r in layout.response_lengths]
    offsets = [torch.arange(0, 2 * r + 1, 2) for r in layout.response_lengths]
    return cpslice.Support.from_responses(ids, offsets, layout)


def _calls(layout: Layout, tokens: list[torch.Tensor], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    eye = torch.eye(6, dtype=torch.float64)
    teacher = [torch.log_softmax(torch.randn(r, 6, dtype=torch.float64), -1).topk(2) for r in layout.response_lengths]
    lps, ids = [t.values for t in teacher], [t.indices for t in teacher]
    shared = layout.shared_prefix is not None
    taus = torch.tensor([0.7, 0.7, 0.7, 1.3], dtype=torch.float64) if shared else [0.7, 1.0, 1.3]
    support = _support(layout)
    calls: dict[str, Callable[[], Any]] = {
        "response_log_probs": lambda: cpslice.response_log_probs(x, tokens, layout, with_entropy=True,
                                                                 temperature=taus),
        "response_log_probs/support": lambda: cpslice.response_log_probs(
            x, tokens, layout, with_entropy=True, temperature=taus, support=support, entropy_over="support"),
        "response_log_probs_from_hidden": lambda: cpslice.response_log_probs_from_hidden(
            x, eye, tokens, layout, with_entropy=True, temperature=taus),
        "response_log_probs_from_hidden/support": lambda: cpslice.response_log_probs_from_hidden(
            x, eye, tokens, layout, temperature=taus, support=support),
        "response_distillation": lambda: cpslice.response_distillation(x, lps, ids, layout, temperature=taus),
        "response_distillation_from_hidden": lambda: cpslice.response_distillation_from_hidden(
            x, eye, lps, ids, layout, temperature=taus),
        "response_vocab_distillation": lambda: cpslice.response_vocab_distillation(
            x, x.detach().flip(1), layout, kind="jsd", temperature=taus),
        "extract_responses": lambda: cpslice.extract_responses(x[:, 0], layout, x[:, 1]),
        "pack": lambda: cpslice.pack(tokens, layout),
        "shifted_targets": lambda: cpslice.shifted_targets(tokens, layout),
        "response_rows": lambda: cpslice.response_rows(layout),
        "shard_responses": lambda: cpslice.shard_responses([torch.zeros(r) for r in layout.response_lengths],
                                                          layout),
        "sum_of_sample_means": lambda: cpslice.sum_of_sample_means(
            cpslice.extract_responses(x[:, 0], layout)[0], [torch.ones(r) for r in layout.response_lengths],
            layout),
    }
    if shared:
        del calls["shifted_targets"]  # refuses a shared prefix: one target per row
    return calls


NAMES = list(_calls(*_batch("none")))
FOLLOWED = ("response_log_probs", "response_log_probs/support", "response_log_probs_from_hidden",
            "response_log_probs_from_hidden/support", "response_distillation",
            "response_distillation_from_hidden", "response_vocab_distillation", "extract_responses", "pack")


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("cp_mode", ["none", "zigzag", "allgather"])
@pytest.mark.parametrize("name", NAMES)
def test_one_resolution_per_call_and_no_layout_built(cp_mode: str, name: str, batch: str) -> None:
    layout, tokens, x = _batch(cp_mode, batch)
    if name == "sum_of_sample_means" and cp_mode != "none":
        pytest.skip("needs a process group: tests/distributed/test_sample_means.py")
    calls = _calls(layout, tokens, x)
    if name not in calls:
        pytest.skip(f"{name} refuses a {batch} layout")
    call = calls[name]
    cpslice.clear_caches()  # a new layout's first call, then a step reading it again (warm caches)
    for _ in range(3):
        trace = Trace(layout)
        trace.run(call)
        resolutions = 2 if name == "sum_of_sample_means" else 1  # its extract_responses too
        assert trace.resolutions == resolutions, (name, trace.files)
        assert trace.built == 0, name
        if name in FOLLOWED:
            assert max(trace.returns().values()) <= 1, (name, " ".join(trace.files))


def test_the_trace_sees_what_it_counts() -> None:
    """The instrument itself: a call that resolves twice and builds a Layout is seen so."""
    layout, tokens, x = _batch("zigzag")
    trace = Trace(layout)
    trace.run(lambda: (cpslice.pack(tokens, layout), cpslice.pack(tokens, layout.for_rank(0))))
    assert trace.resolutions == 2 and trace.built == 1
    assert trace.files[0] == "_layout/pack.py" and "_layout/plan.py" in trace.files
    # what a check reads off the layout is followed as the layout: its lengths are
    trace = Trace(layout)
    trace.run(lambda: checks.lengths("response_lengths", layout.response_lengths))
    assert trace.files == ["_checks.py"] and trace.resolutions == 0
