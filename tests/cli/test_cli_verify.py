"""``cpslice verify`` and ``cpslice bench``: one-line argument errors (exit 2), which
layouts each mode checks, a real small verify run (exit 0 and its table), the error
measure's NaN (the planted bugs verify must catch: test_verify_planted.py), a rank that raises (its
layout FAIL, the rest not run), the start-up timeout apart from a hang, Ctrl-C, a
missing megatron-core, and bench's discovery of benchmarks/, its adapters, its
source-checkout check and its target marks. ``bench`` itself is not run here (it takes minutes). Faults are injected
from tests/support/_verify_ranks.py: the library carries none."""

import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cpslice import _probe
from cpslice._cli import main
from cpslice._types import CpMode
from cpslice._verify.batches import make_batch
from cpslice._verify.cases import ORDER_CASES, TOLERANCE, Case, Config, select_cases
from cpslice._verify.check import Errors, max_error, row_length
from cpslice._verify.rank import join_store
from cpslice._verify.report import CaseResult, progress_line
from cpslice._verify.runner import host_store, verify_main

from ..support import _verify_ranks, planted


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp-size", "0"], "argument --cp-size: '0' is not an int >= 1"),
        (["--cp-size", "two"], "argument --cp-size: 'two' is not an int >= 1"),
        (["--tp-size", "-1"], "argument --tp-size: '-1' is not an int >= 1"),
        (["--samples", "0"], "argument --samples: '0' is not an int >= 1"),
        (["--seed", "-3"], "argument --seed: '-3' is not an int >= 0"),
        (["--timeout", "0"], "argument --timeout: '0' is not a number of seconds > 0"),
        (["--timeout", "nan"], "argument --timeout: 'nan' is not a number of seconds > 0"),
        (["--mode", "ring"], "argument --mode: invalid choice: 'ring'"),
        (["--format", "sbhd"], "argument --format: invalid choice: 'sbhd'"),
        (["--mode", "none"], "--mode none is the layout without context parallelism, but "
                             "--cp-size is 2; pass --cp-size 1"),
        (["--mode", "zigzag", "--cp-size", "1"], "--mode zigzag needs --cp-size 2 or more"),
        (["--mode", "allgather", "--format", "bshd"], "--mode allgather splits the packed "
                                                      "stream, so it has no bshd layout"),
        (["--cp-size", "8", "--tp-size", "8"], "--cp-size 8 x --tp-size 8 = 64 processes; "
                                               "verify spawns them all on this machine, at "
                                               "most 32"),
        (["--align", "0"], "argument --align: '0' is not an int >= 1"),
        (["--align", "6"], "--align 6 is not a multiple of 2 * --cp-size = 4"),
        (["--align", "8", "--format", "bshd"], "--align 8 pads packed thd samples, but "
                                               "--format is bshd"),
        (["--mode", "order", "--align", "8"], "--align 8 pads the closed forms' samples, and "
                                              "--mode order has none"),
        (["--mode", "ptrr"], "argument --mode: invalid choice: 'ptrr'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["verify", *argv], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("cpslice verify: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_unknown_options_are_one_line_and_exit_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # said by the subcommand, as for plan
    code, out, err = run([command, "--frobnicate"], capsys)
    assert (code, out) == (2, "")
    assert err == f"cpslice {command}: error: unrecognized arguments: --frobnicate\n"


def test_which_layouts_each_mode_checks() -> None:
    shared = Case("zigzag", "thd", shared=True)
    padded = (shared, Case("zigzag", "thd", padded=True), Case("allgather", "thd", padded=True))
    left = Case("zigzag", "bshd", left_padded=True)
    orders = (Case("order", "thd", order="random"), Case("order", "thd", order="block"),
              Case("order", "bshd", order="random"),
              Case("order", "thd", order="per-document head-tail"))
    thd_orders = tuple(c for c in orders if c.fmt == "thd")
    assert ORDER_CASES == orders
    # torch's order last: where its private balancer moved, only it fails and stops the run
    assert select_cases(2, "all", None) == (
        Case("zigzag", "thd"), Case("zigzag", "bshd"), Case("allgather", "thd"),
        Case("allgather", "thd", 8), *padded, left, *orders[:3], Case("none", "bshd"), orders[3])
    assert select_cases(1, "all", None) == (
        Case("none", "thd"), Case("none", "bshd"), Case("allgather", "thd"),
        Case("allgather", "thd", 4), Case("none", "thd", shared=True), Case("none", "thd", padded=True),
        Case("allgather", "thd", padded=True), Case("none", "bshd", left_padded=True), *orders)
    assert select_cases(2, "all", "thd", 12) == (
        Case("zigzag", "thd"), Case("allgather", "thd"), Case("zigzag", "thd", 12),
        Case("allgather", "thd", 12), *padded, *thd_orders)
    assert select_cases(2, "allgather", None, 3) == (
        Case("allgather", "thd"), Case("allgather", "thd", 3))
    assert Case("allgather", "thd", 8).name == "allgather thd align 8"
    assert shared.name == "zigzag thd shared-prefix"
    assert padded[1].name == "zigzag thd padded"
    assert left.name == "zigzag bshd left-padded"
    assert [c.name for c in orders] == ["order random thd", "order block thd", "order random bshd",
                                        "order per-document head-tail thd"]
    assert select_cases(4, "all", "bshd") == (
        Case("zigzag", "bshd"), Case("zigzag", "bshd", left_padded=True),
        Case("order", "bshd", order="random"), Case("none", "bshd"))
    assert select_cases(1, "none", "thd") == (Case("none", "thd"),)
    assert select_cases(2, "allgather", None) == (Case("allgather", "thd"),)
    assert select_cases(2, "zigzag", None) == (Case("zigzag", "thd"), Case("zigzag", "bshd"))
    assert select_cases(2, "order", None) == select_cases(1, "order", None) == orders
    assert select_cases(4, "order", "thd") == thd_orders


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_order_cases_build_permutations_that_leave_ranks_empty(cp: int) -> None:
    """Each order case's batches: a permutation of the stream (thd) or of every row
    (bshd) whose length cp divides; per-document head-tail is torch's balancer's index;
    the sparse batch holds one response token, so cp - 1 ranks hold none."""
    from cpslice._verify.batches import batches_for

    for case in ORDER_CASES:
        batches = batches_for(case, Config(cp, 1, (case,), samples=8))
        assert len(batches) == (2 if cp > 1 else 1)
        for batch in batches:
            assert batch.order is not None
            rows = [list(r) for r in batch.order]
            if case.fmt == "thd":
                assert batch.padded is not None and len(rows) == 1
                assert all(w >= t for w, t in zip(batch.padded, batch.total))
                assert sorted(rows[0]) == list(range(sum(batch.padded)))
            else:
                assert len(rows) == len(batch.total) and len(rows[0]) > max(batch.total)
                assert all(sorted(r) == list(range(len(rows[0]))) for r in rows)
            assert len(rows[0]) % cp == 0
        if cp > 1:
            assert sum(batches[1].response) == 1
        if case.order == "per-document head-tail":
            from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
                _PerDocumentHeadTailLoadBalancer,
            )

            for batch in batches:
                assert batch.padded is not None and all(w % (2 * cp) == 0 for w in batch.padded)
                index = _PerDocumentHeadTailLoadBalancer([list(batch.padded)], cp, "cpu")._generate_indices()
                assert batch.order == tuple(tuple(r) for r in index.tolist())


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_left_padded_rows_come_from_an_attention_mask_filled_to_the_last_column(cp: int) -> None:
    """verify's left-padded rows: a sample ends exactly at its row's last column (a
    layout refusing one would fail verify), under zigzag at a length it can split, and
    ``Layout.from_attention_mask`` of the batch's mask gives parallel_state's layout."""
    from cpslice import Layout
    from cpslice._verify.batches import batches_for
    from cpslice._verify.check import attention_mask

    mode: CpMode = "zigzag" if cp > 1 else "none"
    case = Case(mode, "bshd", left_padded=True)
    for batch in batches_for(case, Config(cp, 1, (case,))):
        assert batch.offsets is not None
        seq = row_length(case, batch)
        assert seq is not None and seq % (2 * cp if cp > 1 else 1) == 0
        ends = [o + t for o, t in zip(batch.offsets, batch.total)]
        assert max(ends) == seq and min(batch.offsets) >= 0
        mask = attention_mask(batch, seq)
        for rank in range(cp):
            rows = Layout.from_attention_mask(mask, batch.response, cp_mode=mode, cp_rank=rank, cp_size=cp)
            assert rows == Layout(batch.total, batch.response, qkv_format="bshd", max_seq_len=seq,
                                  cp_mode=mode, cp_rank=rank, cp_size=cp, row_offsets=batch.offsets)


@pytest.mark.parametrize("cp", [1, 3])
def test_the_shared_batches_share_their_prompts_and_their_first_sets(cp: int) -> None:
    """verify's shared-prefix batches: each group's samples have equal prompt tokens and
    prompt logits (pack refuses others) and one top-p set at the prompt's last row
    (Support refuses others); the random batch holds a star shorter than 2 * cp, an empty
    and a single-token response, a lone sample; the sparse batch leaves every CP rank but
    0 without a response (read by the oracle)."""
    from cpslice import Layout, Support, pack
    from cpslice._verify import oracle
    from cpslice._verify.batches import batches_for, response_sets

    mode: CpMode = "zigzag" if cp > 1 else "none"
    case = Case(mode, "thd", shared=True)
    batches = batches_for(case, Config(cp, 1, (case,), samples=10))
    assert len(batches) == (2 if cp > 1 else 1)
    for batch in batches:
        assert batch.groups is not None and sum(batch.groups) == len(batch.total)
        stars = oracle.star_totals(batch.total, batch.response, batch.groups)
        first = 0
        for g in batch.groups:
            p = batch.total[first] - batch.response[first]
            for i in range(first, first + g):
                assert batch.total[i] - batch.response[i] == p
                assert torch.equal(batch.tokens[i][:p], batch.tokens[first][:p])
                assert torch.equal(batch.logits[i][:p], batch.logits[first][:p])
            first += g
        sets = response_sets(batch, 8, 101)
        ids = [[j for kept in sample for j in kept] for sample in sets]
        offsets = [[0, *torch.tensor([len(k) for k in sample], dtype=torch.int64).cumsum(0).tolist()]
                   for sample in sets]
        for rank in range(cp):
            layout = Layout(batch.total, batch.response, cp_mode=mode, cp_rank=rank, cp_size=cp,
                            shared_prefix=batch.groups)
            pack(batch.logits, layout)  # equal prompts, or a LayoutError
            Support.from_responses(ids, offsets, layout)  # one set per shared row, or a LayoutError
        if batch is batches[0]:
            assert (min(stars) < 2 * cp or cp == 1) and 0 in batch.response and 1 in batch.response
            assert 1 in batch.groups and max(batch.groups) >= 3
        else:
            for rank in range(cp):
                view = oracle.RankView(batch.total, batch.response, mode, "thd", None, rank, cp,
                                       oracle.least_length(stars, mode, "thd", None, cp),
                                       groups=batch.groups)
                held = sum(len(s) for s in oracle.share_offsets(view))
                assert (held > 0) == (rank == 0), (rank, held)


@pytest.mark.distributed  # cpslice verify's 2 gloo ranks, through the command line
def test_a_small_run_passes_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    # in line, not in the background: its start-up needs the cores the session holds
    code, out, err = run(["verify", "--cp-size", "2", "--tp-size", "1", "--samples", "4"],
                         capsys)
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("cpslice verify: 2 gloo processes (cp 2 x tp 1)")
    assert "  padded: each sample its own width W_i >= L_i (Layout.from_cu_seqlens)" in out
    assert "  none bshd: rows of odd length, without CP on every CP rank" in out
    assert "  left-padded: bshd rows as Hugging Face trainers hold them" in out
    assert ("  shared-prefix: groups of samples with one prompt, each packed once as a star with its "
            "responses after it (shared_prefix=)") in out
    assert ("  order: Layout.from_order of a random permutation, shuffled blocks of 3 positions and "
            "torch's per-document head-tail index (its private _PerDocumentHeadTailLoadBalancer), "
            "the shares redistributed to zigzag;") in out
    head = lines.index(next(line for line in lines if line.startswith("layout")))
    assert lines[head].split() == [
        "layout", "ranks", "(cp", "x", "tp)", "samples", "empty", "ranks", "log-prob", "err",
        "entropy", "err", "grad", "err", "distill", "err", "invariance", "result",
    ]
    rows = planted.rows(out)
    names = ["zigzag thd", "zigzag bshd", "allgather thd", "allgather thd align 8",
             "zigzag thd shared-prefix", "zigzag thd padded", "allgather thd padded", "zigzag bshd left-padded",
             "order random thd", "order block thd", "order random bshd", "none bshd",
             "order per-document head-tail thd"]
    assert list(rows) == names, out
    for name, r in rows.items():
        assert r[0] == "2 x 1" and r[-1] == "pass", (name, r)
        if name == "none bshd":  # no CP: every rank holds every response; no sparse batch
            assert r[1:3] == ["4", "0"], (name, r)
        elif name == "zigzag thd shared-prefix":  # 4 samples in 2 stars, 3 in the sparse one
            assert r[1:3] == ["7", "1"], (name, r)
        else:  # the sparse batch left a CP rank without a response
            assert int(r[2]) >= 1, (name, r)
        assert all(float(e) <= TOLERANCE for e in r[3:7]), (name, r)
        assert r[7] == "0", (name, r)  # invariance: the same bits as decode time
    assert "pass when each is <= 1e-05" in out
    assert lines[-1] == "13 layouts: all pass"
    # progress: a line per layout on stderr, as each finishes, the verdicts in one column
    assert [line.split(" pass ")[0].strip() for line in err.splitlines()
            if " pass " in line] == names
    assert len({line.index(" pass ") for line in err.splitlines() if " pass " in line}) == 1, err


def test_progress_lines_keep_the_verdicts_in_one_column() -> None:
    cases = (Case("none", "thd"), *ORDER_CASES)
    width = max(len(c.name) for c in cases)
    lines = [progress_line(CaseResult(c, 2, 1, 4, 0, Errors(0.0, 0.0, 0.0, 0.0, 0.0), TOLERANCE, 0.25), width)
             for c in cases]
    assert {line.index(" pass ") for line in lines} == {2 + width}, lines
    assert lines[0] == f"  {'none thd':<{width}} pass  (0.25 s)"


def test_the_error_measure_turns_nan_into_a_failure() -> None:
    # a library that returns NaN fails every layout through this measure (a mutant that
    # reports NaN as 0, or drops a non-finite error, fails here)
    nan, want = float("nan"), [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([])]
    assert max_error(want, want) == 0.0
    for bad in ([nan, -2.0, -3.0], [-1.0, -2.5, nan], [nan, nan, nan]):
        got = [torch.tensor(bad), torch.tensor([])]
        assert max_error(got, want) == math.inf, bad  # NaN first, after an error, all
        assert max_error(want, got) == math.inf, bad
    assert max_error([torch.tensor([-1.0, -2.0, math.inf])], want[:1]) == math.inf
    # and the layout fails: inf is worse than every error, and above the tolerance
    errors = Errors(1e-6, 0.0, 0.0, 0.0, 0.0).worst(Errors(math.inf, 0.0, 0.0, 0.0, 0.0))
    result = CaseResult(Case("none", "thd"), 1, 1, 4, 0, errors, TOLERANCE, 0.1)
    assert (errors.log_prob, result.passed, result.verdict) == (math.inf, False, "FAIL")
    # the invariance column passes at 0 only: one last bit off fails, however small
    off = CaseResult(Case("none", "thd"), 1, 1, 4, 0, Errors(0.0, 0.0, 0.0, 0.0, 1e-9), TOLERANCE, 0.1)
    assert (off.passed, off.verdict) == (False, "FAIL")
    assert CaseResult(Case("none", "thd"), 1, 1, 4, 0, Errors(1e-6, 0.0, 0.0, 0.0, 0.0), TOLERANCE, 0.1).passed


def test_bshd_rows_without_cp_are_odd() -> None:
    # an even row would hide a rounding of no-CP rows to even (the planted bug above)
    even, odd = make_batch([3, 7], [1, 2], 8, 0), make_batch([3, 6], [1, 2], 8, 0)
    assert [row_length(Case("none", "bshd"), b) for b in (even, odd)] == [9, 7]
    assert [row_length(Case("zigzag", "bshd"), b) for b in (even, odd)] == [8, 7]
    assert row_length(Case("none", "thd"), even) is None


def test_a_rank_that_raises_is_reported_and_the_others_stopped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # rank 1 raises in the second layout: the first is reported, the second FAILs with
    # the error's last line, the third is not run
    cases = (Case("zigzag", "thd"), Case("zigzag", "bshd"), Case("allgather", "thd"))
    config = Config(2, 1, cases, samples=2, timeout=60.0)
    with _probe.substitute("rank_main", _verify_ranks.rank_1_raises_on_bshd):
        assert verify_main(config) == 1
    out, err = capsys.readouterr()
    assert "cpslice verify: rank 1 raised in layout zigzag bshd:" in err
    assert "Traceback" in err and "RuntimeError: fault injected: rank 1 raises" in err
    rows = planted.rows(out)
    assert list(rows) == ["zigzag thd", "zigzag bshd", "allgather thd"], out
    assert rows["zigzag thd"][-1] == "pass"
    assert rows["zigzag bshd"][2:] == [
        "-", "-", "-", "-", "-", "-", "FAIL  rank 1 raised: RuntimeError: fault injected: rank 1 raises"]
    assert rows["allgather thd"][2:] == ["-", "-", "-", "-", "-", "-", "not run"]
    assert out.splitlines()[-1] == "1 of 3 layouts FAIL, 1 not run"


def test_a_slow_start_is_not_called_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    config = Config(2, 1, (Case("zigzag", "thd"),), startup_timeout=1.0, timeout=0.1)
    with _probe.substitute("rank_main", _verify_ranks.never_start):
        assert verify_main(config) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert "2 of 2 ranks did not start within --startup-timeout 1 s" in last
    assert "hang" not in last


def test_started_ranks_without_progress_are_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    # a generous start-up, a short wait for progress: once every rank is ready and one
    # layout is half done, nothing more comes
    cases = (Case("zigzag", "thd"), Case("zigzag", "bshd"))
    config = Config(2, 1, cases, startup_timeout=120.0, timeout=2.0)
    start = time.monotonic()
    with _probe.substitute("rank_main", _verify_ranks.ready_then_stall):
        assert verify_main(config) == 1
    out, err = capsys.readouterr()
    last = err.splitlines()[-1]
    assert ("1 of 2 ranks made no progress on layout zigzag thd for --timeout 2 s (a hang"
            in last), last
    verdicts = {name: r[-1] for name, r in planted.rows(out).items()}
    assert verdicts == {"zigzag thd": "FAIL  hang: no progress for --timeout 2 s",
                        "zigzag bshd": "not run"}, out
    assert time.monotonic() - start < 100


def _spawned_ranks(parent: int) -> list[int]:
    """The pids of ``parent``'s multiprocessing ranks (children running spawn_main)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.distributed  # cpslice verify's ranks, spawned by a command line
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_during_start_up_stops_the_ranks_quietly() -> None:
    # a terminal's Ctrl-C goes to the whole process group: the parent and its ranks.
    # SIGINT back to its default in the child: a background job starts with it ignored.
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpslice", "verify", "--cp-size", "2", "--tp-size", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while len(_spawned_ranks(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = _spawned_ranks(proc.pid)
        assert len(ranks) == 2, "the ranks did not spawn"
        # they ignore SIGINT from their first instruction (while they import torch):
        # otherwise each prints a KeyboardInterrupt traceback, if the parent's kill
        # does not happen to come first
        for pid in ranks:
            status = Path(f"/proc/{pid}/status").read_text()
            ignored = int(status.split("SigIgn:")[1].split()[0], 16)
            assert ignored & (1 << (signal.SIGINT - 1)), f"rank {pid} takes SIGINT"
        time.sleep(1.0)  # they are importing torch now, far from ready
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "cpslice verify: interrupted", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "ready" not in err  # it was start-up that was interrupted


def test_verify_without_megatron_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["megatron"] = None  # as if megatron-core were not installed
        from cpslice._cli import main
        raise SystemExit(main(["verify", "--cp-size", "2", "--tp-size", "1"]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.startswith("cpslice verify: error: megatron-core is not installed")
    assert "pip install 'cpslice[megatron]'" in done.stderr and done.stderr.count("\n") == 1


def test_the_store_holds_its_port() -> None:
    # the ranks' rendezvous port is taken by the parent's store from the start, so
    # nothing can take it between choosing it and binding it (free_port's race)
    store = host_store()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    store.set("k", "v")
    assert join_store(store.port).get("k") == b"v"


def test_verify_and_plan_do_not_import_megatron() -> None:
    code = textwrap.dedent("""
        import sys
        import cpslice._cli, cpslice._verify.runner
        cpslice._cli.main(["plan", "--total", "10", "--response", "4"])
        assert not [m for m in sys.modules if m.startswith("megatron")]
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_bench_needs_a_source_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["bench", "--quick", "--checkout", str(tmp_path / "site-packages")], capsys)
    assert (code, out) == (1, "")  # not a usage error: nothing to run in this installation
    assert err.startswith("cpslice bench: error: bench needs a source checkout: no "
                          "bench_*.py in ") and err.count("\n") == 1


FAKE = {
    "bench_extract": '"""Extraction: fake.\n\nMore."""\ndef run(quick):\n    return [quick]\n'
                     "def report(rows):\n    return f'extract rows {rows}'\n",
    # bench_logprob's report prints (through a ``say`` callback) and returns None
    "bench_logprob": '"""Log-probs: fake:\ncontinued."""\ndef run(quick):\n    return [1, 2]\n'
                     "def report(rows, say=print):\n    say('logprob'); say(f'rows {rows}')\n",
    "bench_redistribute": '"""Redistribute."""\n'
                          "def run(quick):\n    raise RuntimeError('no gloo today')\n"
                          "def report(rows):\n    return ''\n",
    "bench_sample_means": "def run(quick=False, device='cpu'):\n    return 7\n"
                          "def report(rows):\n    return f'means {rows}'\n",
    "bench_unreported": '"""No report."""\ndef run(quick):\n    return 1\n',
    "bench_unquick": '"""No quick."""\ndef run():\n    return 1\n'
                     "def report(rows):\n    return ''\n",
}


def test_bench_runs_every_benchmark_of_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    before = set(sys.modules)

    def forget_the_fakes() -> None:  # monkeypatch restores only the modules it removed
        for name in [n for n in sys.modules if n.split(".")[0] == "benchmarks" and n not in before]:
            del sys.modules[name]

    request.addfinalizer(forget_the_fakes)
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "harness.py").write_text("raise RuntimeError('not a benchmark')\n")
    for name, source in FAKE.items():
        (folder / f"{name}.py").write_text(source)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ["benchmarks", *(f"benchmarks.{n}" for n in FAKE)]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    code, out, err = run(["bench", "--quick", "--checkout", str(tmp_path)], capsys)
    assert code == 1
    assert out.splitlines()[0].startswith("cpslice bench --quick: 6 benchmarks from ")
    titles = [line for line in out.splitlines() if line.startswith("== ")]
    assert titles == [  # in name order, each titled by its docstring's first line
        "== Extraction: fake (bench_extract) ==", "== Log-probs: fake (bench_logprob) ==",
        "== Redistribute (bench_redistribute) ==", "== bench_sample_means (bench_sample_means) ==",
        "== No quick (bench_unquick) ==", "== No report (bench_unreported) ==",
    ]
    assert "extract rows [True]\n(" in out and "logprob\nrows [1, 2]\n(" in out
    assert "means 7\n(" in out
    assert out.count("failed; its traceback is on stderr") == 3
    assert out.splitlines()[-1] == "3 of 6 benchmarks failed"
    assert "cpslice bench: bench_redistribute failed:" in err
    assert "RuntimeError: no gloo today" in err
    for name in ("bench_unquick", "bench_unreported"):
        assert f"cpslice bench: {name} failed:" in err
        assert f"benchmarks.{name} has no module-level run(quick) and report(rows)" in err


def test_every_real_benchmark_has_run_and_report() -> None:
    # in a fresh process: another test leaves fake benchmarks in sys.modules
    root = Path(__file__).resolve().parents[2]
    code = textwrap.dedent("""
        import importlib
        from pathlib import Path
        from cpslice._cli.bench import discover, entry_point
        found = discover(Path("benchmarks"))
        for b in found:
            module = importlib.import_module(f"benchmarks.{b.name}")
            entry_point(module, "run", True), entry_point(module, "report", None)
        print(" ".join(b.name for b in found))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    files = sorted(p.stem for p in (root / "benchmarks").glob("bench_*.py"))
    assert done.stdout.split() == files and "bench_hidden" in files and "bench_support" in files


def test_bench_extract_marks_a_ratio_that_misses_its_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the real file (another test leaves fake benchmarks in sys.modules)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_extract.py"
    spec = importlib.util.spec_from_file_location("_real_bench_extract", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    Row, report = module.Row, module.report

    good = Row("none-thd", 8, 64, loop_ms=300.0, floor_ms=10.0, warm_ms=11.0, cold_ms=12.0)
    slow = Row("zigzag-thd cp4", 8, 64, loop_ms=100.0, floor_ms=10.0, warm_ms=20.0,
               cold_ms=25.0)  # loop/cold 4x < 20x, cold/floor 2.5x > 2x
    lines = report([good, slow]).splitlines()
    assert "!" not in lines[1]
    assert "4.0x!" in lines[2] and "2.50x!" in lines[2]
    assert lines[-1] == "MISSED: 2 ratios (marked !) miss the target"
    assert report([good]).splitlines()[-1] == "every ratio meets its target"


def test_verify_compile_option_reaches_the_config() -> None:
    """``cpslice verify --compile`` selects CPSLICE_BACKEND=compiled on the ranks (a real compiled
    run: ``cpslice verify --compile``, minutes here, not part of the suite)."""
    from cpslice._cli import _parser
    from cpslice._cli.verify import config_of
    from cpslice._verify import report

    parser, _ = _parser()
    argv = ["verify", "--cp-size", "1", "--tp-size", "1", "--mode", "none"]
    seen = [config_of(parser.parse_args([*argv, "--compile"])), config_of(parser.parse_args(argv))]
    assert [c.compile for c in seen] == [True, False]
    assert "compiled by torch.compile (CPSLICE_BACKEND=compiled)" in report.header(seen[0])
    assert "torch.compile" not in report.header(seen[1])
