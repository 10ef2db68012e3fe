"""``cpslice verify`` and ``cpslice bench``: one-line argument errors (exit 2), a real
small verify run (exit 0 and its table), the verifier catching an injected bug and a
rank that raises (exit 1), the timeout, and bench's adapters and its source-checkout
check. ``bench`` itself is not run here (it takes most of a minute)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpslice import _cli, _verify
from cpslice._cli import main
from cpslice._verify import Case, Config, select_cases, verify_main


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
    # argparse reports these from the top-level parser, as for plan
    code, out, err = run([command, "--frobnicate"], capsys)
    assert (code, out) == (2, "")
    assert err == "cpslice: error: unrecognized arguments: --frobnicate\n"


def test_which_layouts_each_mode_checks() -> None:
    assert select_cases(2, "all", None) == (
        Case("zigzag", "thd"), Case("zigzag", "bshd"), Case("allgather", "thd"),
        Case("allgather", "thd", 8))
    assert select_cases(1, "all", None) == (
        Case("none", "thd"), Case("none", "bshd"), Case("allgather", "thd"),
        Case("allgather", "thd", 4))
    assert select_cases(2, "all", "thd", 12) == (
        Case("zigzag", "thd"), Case("allgather", "thd"), Case("zigzag", "thd", 12),
        Case("allgather", "thd", 12))
    assert select_cases(2, "allgather", None, 3) == (
        Case("allgather", "thd"), Case("allgather", "thd", 3))
    assert Case("allgather", "thd", 8).name == "allgather thd align 8"
    assert select_cases(4, "all", "bshd") == (Case("zigzag", "bshd"),)
    assert select_cases(1, "none", "thd") == (Case("none", "thd"),)
    assert select_cases(2, "allgather", None) == (Case("allgather", "thd"),)


def test_a_small_run_passes_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["verify", "--cp-size", "2", "--tp-size", "1", "--samples", "4"],
                         capsys)
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("cpslice verify: 2 gloo processes (cp 2 x tp 1)")
    head = lines.index(next(line for line in lines if line.startswith("layout")))
    assert lines[head].split() == [
        "layout", "ranks", "(cp", "x", "tp)", "samples", "empty", "ranks", "log-prob", "err",
        "entropy", "err", "grad", "err", "result",
    ]
    rows = [line.split() for line in lines[head + 1 : head + 5]]
    # the fourth layout: allgather with every sample padded to a multiple of 4 * cp
    rows[3] = rows[3][:2] + rows[3][4:]
    assert [r[:2] for r in rows] == [["zigzag", "thd"], ["zigzag", "bshd"], ["allgather", "thd"],
                                     ["allgather", "thd"]]
    assert lines[head + 4].startswith("allgather thd align 8 ")
    for r in rows:
        assert r[2:5] == ["2", "x", "1"] and r[-1] == "pass", r
        assert int(r[6]) >= 1  # the sparse batch left a CP rank without a response
        assert all(float(e) <= _verify.TOLERANCE for e in r[7:10]), r
    assert "pass when each is <= 1e-05" in out
    assert lines[-1] == "4 layouts: all pass"
    # progress: a line per layout on stderr, as each finishes
    assert [line.split()[:3] for line in err.splitlines() if "pass" in line] == [
        ["zigzag", "thd", "pass"], ["zigzag", "bshd", "pass"], ["allgather", "thd", "pass"],
        ["allgather", "thd", "align"]]


def test_an_injected_bug_fails(capsys: pytest.CaptureFixture[str]) -> None:
    cases = select_cases(2, "all", "thd")
    code = verify_main(Config(2, 1, cases, samples=3, fault="shifted-tokens"))
    out, _ = capsys.readouterr()
    assert code == 1
    failed = [line for line in out.splitlines() if line.endswith("  FAIL")]
    # the aligned layout of the default set fails too; drop its "align 8" to read its row
    assert failed[2].startswith("allgather thd align 8 ")
    rows = [line.replace(" align 8", "").split() for line in failed]
    assert [r[:2] for r in rows] == [["zigzag", "thd"], ["allgather", "thd"], ["allgather", "thd"]]
    for r in rows:
        assert float(r[7]) > 0.1 and float(r[9]) > 0.1  # log-probs and gradient
    assert out.splitlines()[-1] == "3 of 3 layouts FAIL"


def test_a_rank_that_raises_is_reported_and_the_others_stopped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = Config(2, 1, (Case("allgather", "thd"),), samples=2, fault="rank-1-raises",
                    timeout=60.0)
    assert verify_main(config) == 1
    _, err = capsys.readouterr()
    assert "cpslice verify: rank 1 raised in layout allgather thd:" in err
    assert "RuntimeError: fault injected: rank 1 raises" in err


def test_a_hang_fails_at_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing starts within a tenth of a second: the same path as a rank that hangs.
    assert verify_main(Config(2, 1, (Case("zigzag", "thd"),), timeout=0.1)) == 1
    _, err = capsys.readouterr()
    assert "2 of 2 ranks did not start within --timeout 0.1 s" in err.splitlines()[-1]


def test_verify_and_plan_do_not_import_megatron() -> None:
    code = textwrap.dedent("""
        import sys
        import cpslice._cli, cpslice._verify
        cpslice._cli.main(["plan", "--total", "10", "--response", "4"])
        assert not [m for m in sys.modules if m.startswith("megatron")]
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_bench_needs_a_source_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cli, "_SOURCE_ROOT", tmp_path / "site-packages")
    code, out, err = run(["bench", "--quick"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("cpslice bench: error: bench needs a source checkout: no "
                          "bench_extract.py in ") and err.count("\n") == 1


FAKE = {
    "bench_extract": "def run(quick):\n    return [quick]\n"
                     "def report(rows):\n    return f'extract rows {rows}'\n",
    # bench_logprob's report prints (through a ``say`` callback) and returns None
    "bench_logprob": "def run(quick):\n    return [1, 2]\n"
                     "def report(rows, say=print):\n    say('logprob'); say(f'rows {rows}')\n",
    "bench_redistribute": "def run(quick):\n    raise RuntimeError('no gloo today')\n"
                          "def report(rows):\n    return ''\n",
}


def test_bench_sections_and_a_failing_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name, source in FAKE.items():
        (folder / f"{name}.py").write_text(source)
    monkeypatch.setattr(_cli, "_SOURCE_ROOT", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ["benchmarks", *(f"benchmarks.{n}" for n in FAKE)]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    code, out, err = run(["bench", "--quick"], capsys)
    assert code == 1
    assert "== extraction: " in out and "extract rows [True]\n(" in out
    assert "== log-probs + entropy: " in out and "logprob\nrows [1, 2]\n(" in out
    assert "== redistribute " in out and "failed; its traceback is on stderr" in out
    assert out.splitlines()[-1] == "1 of 3 benchmarks failed"
    assert "cpslice bench: bench_redistribute failed:" in err
    assert "RuntimeError: no gloo today" in err
