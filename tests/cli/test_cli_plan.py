"""``cpslice plan``: the picture, the printed offsets, and one-line errors."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch

from cpslice import Layout, extract_responses
from cpslice._cli import main
from cpslice._types import CpMode, QkvFormat

from ..support import background
from ..support.background import Job

ZIGZAG_EXAMPLE = ["plan", "--total", "10", "--response", "4", "--cp-size", "2", "--mode", "zigzag"]

# docs/layouts.md's example: c = 2, L = 10, R = 4, so W = 12 and C = 3.
ZIGZAG_EXAMPLE_OUT = """\
cpslice plan: 1 sample, cp_mode zigzag, cp_size 2, qkv_format thd, strategy zigzag, local length T = 6 (the least that fits)
sample 0: L 10 = prompt 6 + response 4; prompt tokens [0, 6), response tokens [6, 10), response span [5, 9)
legend: p prompt token, r response token, . padding; P, R: that token's logit is in the response span, so that rank extracts it
        (response span of sample i: the logits [P_i - 1, L_i - 1) that predict its response); '|' separates samples, ' ' a sample's runs

rank 0 of 2: T = 6, strategy zigzag
  ppp r..
  sample 0: holds positions [0, 3) at local [0, 3) + positions [9, 10) at local [3, 4) + padding [10, 12) at local [4, 6)
  sample 0: response share none

rank 1 of 2: T = 6, strategy zigzag
  ppP RRR
  sample 0: holds positions [3, 6) at local [0, 3) + positions [6, 9) at local [3, 6)
  sample 0: response share local [2, 3) + [3, 6), positions [5, 6) + [6, 9) (4 of 4)
"""

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_layouts_md_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(ZIGZAG_EXAMPLE, capsys)
    assert (code, err) == (0, "")
    assert out == ZIGZAG_EXAMPLE_OUT


def test_piped_output_is_plain(capsys: pytest.CaptureFixture[str]) -> None:
    # capsys's stdout is no terminal, as in a pipe.
    code, out, _ = run(ZIGZAG_EXAMPLE + ["--format", "thd"], capsys)
    assert code == 0
    assert "\x1b" not in out


def test_terminal_gets_colour_unless_no_color(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, _ = run(ZIGZAG_EXAMPLE, capsys)
    assert code == 0
    assert "\x1b[" in out
    assert ANSI.sub("", out) == ZIGZAG_EXAMPLE_OUT
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert run(ZIGZAG_EXAMPLE, capsys)[1] == ZIGZAG_EXAMPLE_OUT


def test_colour_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(ZIGZAG_EXAMPLE + ["--color", "always"], capsys)
    assert code == 0
    assert "\x1b[" in out
    assert ANSI.sub("", out) == ZIGZAG_EXAMPLE_OUT


def test_allgather_takes_the_least_length(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "10,7,13", "--response", "4,6,3", "--cp-size", "2",
         "--mode", "allgather"],
        capsys,
    )
    assert code == 0
    assert "strategy allgather, local length T = 15 (the least that fits)" in out
    rank1 = out[out.index("rank 1 of 2") :]
    assert rank1 == """\
rank 1 of 2: T = 15, strategy allgather
  Rr|pppppppppPRRr
  sample 0: holds nothing
  sample 0: response share none
  sample 1: holds positions [5, 7) at local [0, 2)
  sample 1: response share local [0, 1), positions [5, 6) (1 of 6)
  sample 2: holds positions [0, 13) at local [2, 15)
  sample 2: response share local [11, 14), positions [9, 12) (3 of 3)
"""


def test_allgather_given_length_pads_the_stream(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "10,7,13", "--response", "4,6,3", "--cp-size", "2",
         "--mode", "allgather", "--local-length", "16"],
        capsys,
    )
    assert code == 0
    assert "local length T = 16 (given)" in out
    assert "\n  r|pppppppppPRRr|..\n" in out
    assert out.endswith("  padding at local [14, 16)\n")


def test_bshd_zigzag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "10,7,13", "--response", "4,6,0", "--cp-size", "2",
         "--mode", "zigzag", "--format", "bshd", "--max-seq-len", "16"],
        capsys,
    )
    assert code == 0
    assert "qkv_format bshd, max_seq_len 16, strategy zigzag, local length T = 24" in out
    assert "response tokens none, response span empty" in out
    rank1 = out[out.index("rank 1 of 2") :]
    assert rank1 == """\
rank 1 of 2: T = 24, strategy zigzag
  pPRR Rr..|RRr. ....|pppp pppp
  sample 0: holds positions [4, 8) at local [0, 4) + positions [8, 10) at local [4, 6) + padding [10, 12) at local [6, 8)
  sample 0: response share local [1, 4) + [4, 5), positions [5, 8) + [8, 9) (4 of 4)
  sample 1: holds positions [4, 7) at local [8, 11) + padding [7, 8) at local [11, 12) + padding [8, 12) at local [12, 16)
  sample 1: response share local [8, 10), positions [4, 6) (2 of 6)
  sample 2: holds positions [4, 8) at local [16, 20) + positions [8, 12) at local [20, 24)
  sample 2: response share none
"""


# docs/layouts.md's verl example: tp = 2, cp = 2, align = tp * cp * 2 = 8, L = 10, 7.
ALIGNED_RANKS = """\
rank 0 of 2: T = 12, strategy zigzag
  pppp ....|pp r.
  sample 0: holds positions [0, 4) at local [0, 4) + padding [12, 16) at local [4, 8)
  sample 0: response share none
  sample 1: holds positions [0, 2) at local [8, 10) + positions [6, 7) at local [10, 11) + padding [7, 8) at local [11, 12)
  sample 1: response share none

rank 1 of 2: T = 12, strategy zigzag
  pPRR Rr..|pP RR
  sample 0: holds positions [4, 8) at local [0, 4) + positions [8, 10) at local [4, 6) + padding [10, 12) at local [6, 8)
  sample 0: response share local [1, 4) + [4, 5), positions [5, 8) + [8, 9) (4 of 4)
  sample 1: holds positions [2, 4) at local [8, 10) + positions [4, 6) at local [10, 12)
  sample 1: response share local [9, 10) + [10, 12), positions [3, 4) + [4, 6) (3 of 3)
"""


@pytest.mark.parametrize("padding", [["--align", "8"], ["--padded-lengths", "16,8"]])
def test_padded_samples_are_drawn(padding: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        ["plan", "--total", "10,7", "--response", "4,3", "--cp-size", "2", "--mode", "zigzag",
         *padding],
        capsys,
    )
    assert (code, err) == (0, "")
    given = "align 8" if padding[0] == "--align" else "padded lengths given"
    assert f"qkv_format thd, {given}, strategy zigzag, local length T = 12" in out
    assert "sample 0: L 10 = prompt 6 + response 4, padded to W 16; prompt tokens [0, 6)" in out
    assert "sample 1: L 7 = prompt 4 + response 3, padded to W 8; prompt tokens [0, 4)" in out
    assert out[out.index("rank 0 of 2") :] == ALIGNED_RANKS


def test_allgather_padding_crosses_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "10,7", "--response", "4,3", "--cp-size", "2", "--mode", "allgather",
         "--padded-lengths", "12,20"],
        capsys,
    )
    assert code == 0
    rank1 = out[out.index("rank 1 of 2") :]
    assert rank1 == """\
rank 1 of 2: T = 16, strategy allgather
  RRr.............
  sample 0: holds nothing
  sample 0: response share none
  sample 1: holds positions [4, 7) at local [0, 3) + padding [7, 20) at local [3, 16)
  sample 1: response share local [0, 2), positions [4, 6) (2 of 3)
"""


def test_bshd_none_with_trailing_padding(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "10,7", "--response", "4,6", "--format", "bshd",
         "--max-seq-len", "12", "--local-length", "26"],
        capsys,
    )
    assert code == 0
    assert "\n  pppppPRRRr..|PRRRRRr.....|..\n" in out
    assert "  sample 1: holds positions [0, 7) at local [12, 19) + padding [7, 12) at local [19, 24)\n" in out
    assert out.endswith("  padding at local [24, 26)\n")


def test_left_padded_rows(capsys: pytest.CaptureFixture[str]) -> None:
    # docs/layouts.md's left-padded example: S = 12, o = 0, 4, zigzag over 2 ranks
    code, out, _ = run(
        ["plan", "--total", "10,7", "--response", "4,5", "--format", "bshd", "--max-seq-len",
         "12", "--row-offsets", "0,4", "--cp-size", "2", "--mode", "zigzag"],
        capsys,
    )
    assert code == 0
    assert "max_seq_len 12, row offsets given, strategy zigzag" in out
    assert "sample 1: L 7 = prompt 2 + response 5, at columns [4, 11) of its row;" in out
    rank0, rank1 = (block + "\n" for block in out.rstrip("\n").split("\n\n")[1:])
    assert "\n  ppp r..|... Rr.\n" in rank0
    assert ("  sample 1: holds left padding at local [6, 9) + positions [5, 7) at local [9, 11) "
            "+ padding [7, 8) at local [11, 12)\n") in rank0
    assert "  sample 1: response share local [9, 10), positions [5, 6) (1 of 5)\n" in rank0
    assert "\n  ppP RRR|.pP RRR\n" in rank1
    assert ("  sample 1: holds left padding at local [6, 7) + positions [0, 2) at local [7, 9) "
            "+ positions [2, 5) at local [9, 12)\n") in rank1


def test_long_pictures_are_run_length_coded(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "--total", "3000,500", "--response", "1000,0", "--cp-size", "4",
         "--mode", "zigzag"],
        capsys,
    )
    assert code == 0
    assert "pictures over 120 rows are run-length coded" in out
    assert "\n  p375 R374r1|p63 p59.4\n" in out


LAYOUTS = [
    ["--total", "10", "--response", "4"],
    ["--total", "10,7,13", "--response", "4,6,3", "--cp-size", "3", "--mode", "zigzag"],
    ["--total", "10,7,1", "--response", "4,6,0", "--cp-size", "2", "--mode", "zigzag",
     "--format", "bshd", "--max-seq-len", "11"],
    ["--total", "10,7,13", "--response", "4,6,3", "--format", "bshd", "--max-seq-len", "13"],
    ["--total", "10,7,13", "--response", "4,6,3", "--cp-size", "4", "--mode", "allgather"],
    ["--total", "10,7,13", "--response", "9,6,3", "--cp-size", "3", "--mode", "allgather",
     "--local-length", "11"],
    ["--total", "10,7,13", "--response", "4,6,3", "--cp-size", "3", "--mode", "zigzag",
     "--align", "12"],
    ["--total", "10,7,13", "--response", "9,6,3", "--cp-size", "3", "--mode", "allgather",
     "--padded-lengths", "10,16,40"],
    ["--total", "10,7,13", "--response", "4,6,3", "--padded-lengths", "12,7,20"],
    ["--total", "10,7,3", "--response", "4,5,1", "--cp-size", "2", "--mode", "zigzag",
     "--format", "bshd", "--max-seq-len", "12", "--row-offsets", "0,4,9"],
    ["--total", "10,7", "--response", "4,5", "--format", "bshd", "--max-seq-len", "13",
     "--row-offsets", "3,6", "--local-length", "30"],
]


@pytest.mark.parametrize("flags", LAYOUTS)
def test_printed_shares_are_what_extraction_returns(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["plan", *flags], capsys)
    assert code == 0
    opts = dict(zip(flags[::2], flags[1::2]))
    found = re.search(r"local length T = (\d+)", out)
    assert found is not None
    length = int(found.group(1))
    max_seq = opts.get("--max-seq-len")
    cp_size = int(opts.get("--cp-size", "1"))
    align = opts.get("--align")
    padded = opts.get("--padded-lengths")
    offsets = opts.get("--row-offsets")
    for rank, block in enumerate(out.split("\n\n")[1:]):
        layout = Layout(
            [int(v) for v in opts["--total"].split(",")],
            [int(v) for v in opts["--response"].split(",")],
            qkv_format=cast(QkvFormat, opts.get("--format", "thd")),
            max_seq_len=int(max_seq) if max_seq else None,
            cp_mode=cast(CpMode, opts.get("--mode", "none")),
            cp_rank=rank,
            cp_size=cp_size,
            local_length=length,
            padded_lengths=[int(v) for v in padded.split(",")] if padded else None,
            align=int(align) if align else None,
            row_offsets=[int(v) for v in offsets.split(",")] if offsets else None,
        )
        _shares_are_extracted(block, layout, length)
    assert len(out.split("\n\n")) == cp_size + 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--total", "10,x", "--response", "4"],
         "cpslice plan: error: argument --total: '10,x' is not a comma-separated list of ints"),
        (["plan", "--total", "", "--response", "4"], "argument --total: '' is not a comma"),
        (["plan", "--response", "4"],
         "cpslice plan: error: the following arguments are required: --total"),
        (["plan", "--total", "10", "--response", "4", "--mode", "ring"],
         "cpslice plan: error: argument --mode: invalid choice: 'ring'"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "two"],
         "argument --cp-size: invalid int value: 'two'"),
        (["plan", "--total", "10", "--response", "10"],
         "cpslice plan: error: sample 0: response_length 10 > total_length - 1 = 9"),
        (["plan", "--total", "10,3", "--response", "4"],
         "--total has 2 samples but --response has 1"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "2"],
         "--mode 'none' with --cp-size 2"),
        (["plan", "--total", "10", "--response", "4", "--mode", "zigzag"],
         "cpslice plan: error: --mode 'zigzag' with --cp-size 1: zigzag needs --cp-size 2 or more"),
        (["plan", "--total", "10", "--response", "4", "--format", "bshd"],
         "--format 'bshd' needs --max-seq-len"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "2", "--mode", "allgather",
          "--local-length", "4"],
         "--cp-size * T = 2 * 4 = 8 < sum(--total) = 10"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "0"], "--cp-size"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "4096", "--mode", "zigzag"],
         "cpslice plan: error: --cp-size 4096 > 1024: plan draws every rank"),
        (["plan", "--bogus"], "cpslice plan: error: "),  # not cpslice's top level
        (["plan", "--total", "10", "--response", "4", "--bogus", "1"],
         "cpslice plan: error: unrecognized arguments: --bogus 1"),
        (["plan", "--total", "10", "--response", "4", "--local-length", "9"],
         "too short: the layout needs at least 10 positions"),
        (["plan", "--total", "10", "--response", "4", "--cp-size", "2", "--mode", "zigzag",
          "--align", "6"],
         "cpslice plan: error: --align 6 is not a multiple of 2 * --cp-size = 4"),
        (["plan", "--total", "10,7", "--response", "4,3", "--padded-lengths", "12,6"],
         "cpslice plan: error: sample 1: padded_length 6 < total_length 7"),
        (["plan", "--total", "10", "--response", "4", "--padded-lengths", "12,x"],
         "argument --padded-lengths: '12,x' is not a comma-separated list of ints"),
        (["plan", "--total", "10", "--response", "4", "--padded-lengths", "12", "--align", "4"],
         "--padded-lengths and --align 4 are both given"),
        (["plan", "--total", "10", "--response", "4", "--format", "bshd", "--max-seq-len", "12",
          "--align", "4"],
         "--align is given with --format 'bshd'"),
        (["plan", "--total", "10", "--response", "4", "--row-offsets", "2"],
         "cpslice plan: error: --row-offsets is given with --format 'thd', whose samples start "
         "where the previous one ends; pass --format bshd for left-padded rows, or drop it"),
        (["plan", "--total", "10", "--response", "4", "--format", "bshd", "--max-seq-len", "12",
          "--row-offsets", "3"],
         "sample 0: row_offset 3 + total_length 10 = 13 > --max-seq-len 12"),
        (["plan", "--total", "10,2", "--response", "4,1", "--format", "bshd", "--max-seq-len",
          "12", "--row-offsets", "0,-1"], "sample 1: row_offset -1 < 0"),
        (["plan", "--total", "10,2", "--response", "4,1", "--format", "bshd", "--max-seq-len",
          "12", "--row-offsets", "0"], "--row-offsets has 1 samples but --total has 2"),
        (["plan", "--total", "10", "--response", "4", "--row-offsets", "1.5"],
         "argument --row-offsets: '1.5' is not a comma-separated list of ints"),
        ([], "cpslice: error: the following arguments are required: COMMAND"),
        (["frob"], "cpslice: error: argument COMMAND: invalid choice: 'frob'"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert re.match(r"cpslice( plan)?: error: ", err)
    assert message in err
    assert "Traceback" not in err
    # the flags' names, never the API's arguments
    assert not re.search(r"\b(cp_size|cp_mode|qkv_format|max_seq_len|local_length|total_lengths|"
                         r"response_lengths)\b", err), err
    assert not re.search(r"--[a-z-]+=", err), "advice in the flags' own form: --mode zigzag"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["--version"], capsys)
    assert (code, err) == (0, "")
    assert re.fullmatch(r"cpslice \d+\.\d+\.\d+\S*\n", out), out


@pytest.mark.parametrize("how", [["-m", "cpslice"], ["script"]])
def test_an_invalid_cpslice_debug_is_one_line_from_the_command_line(
    how: list[str], tmp_path: Path
) -> None:
    if how == ["script"]:  # what pip's console script does
        script = tmp_path / "cpslice"
        script.write_text("import sys\nfrom cpslice._cli import main\nsys.exit(main())\n")
        how = [str(script)]
    env = {**os.environ, "CPSLICE_DEBUG": "yes"}
    done = subprocess.run([sys.executable, *how, *ZIGZAG_EXAMPLE], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "cpslice: error: CPSLICE_DEBUG='yes' is not valid; use one of: unset or '' or '0' "
        "(no checking), '1' (jaxtyping + beartype checks on every cpslice function)\n")


_BAD_BACKEND = """
import contextlib, io, torch, cpslice
from cpslice._cli import main
layout = cpslice.Layout([3], [1])  # what needs no backend works
print(cpslice.pack([torch.arange(3)], layout).tolist())
for dtype in (torch.float32, torch.float64):  # float64 would fall back from Triton: refused first
    try:
        cpslice.log_probs_and_entropy(torch.randn(2, 5, dtype=dtype), torch.tensor([0, 1]))
    except ValueError as error:
        print(f"ValueError: {error}")
for argv in (["plan", "--total", "3", "--response", "1"], ["verify"], ["bench", "--checkout", "/nowhere"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    print(argv[0], code, len(out.getvalue().splitlines()), err.getvalue().splitlines())
"""


def _bad_backend() -> dict[str, Job]:
    """A fresh interpreter with ``CPSLICE_BACKEND=gpu`` (read when cpslice is imported):
    the library and the command line, a background job (tests/support/background.py)."""
    env = {**os.environ, "CPSLICE_BACKEND": "gpu"}
    return {"gpu": Job((sys.executable, "-c", _BAD_BACKEND), env, background.folder())}


background.register("bad-backend", "tests/cli/test_cli_plan.py::test_an_invalid_cpslice_backend", _bad_backend)


def test_an_invalid_cpslice_backend_is_refused_in_one_line_where_a_backend_is_needed() -> None:
    """``import cpslice`` and what needs no backend (a ``Layout``, ``cpslice plan``) work;
    the first vocabulary call raises one ``ValueError`` line naming the setting and its
    values, and ``cpslice verify`` and ``bench`` (the subcommands that compute) say it in
    one line and exit 2 before they start."""
    done = background.result("bad-backend", timeout=200)["gpu"]
    assert done.code == 0, done.err[-3000:]
    said = ("CPSLICE_BACKEND='gpu' is not valid; use one of: unset or '' or 'auto' (Triton kernels for CUDA "
            "tensors, compiled kernels on the CPU where they pay, else eager), 'eager' (torch operations), "
            "'compiled' (torch.compile; an error if it fails), 'triton' (Triton kernels; an error for a tensor "
            "they cannot run on)")
    assert done.out.splitlines() == [
        "[0, 1, 2]", f"ValueError: {said}", f"ValueError: {said}",
        "plan 0 9 []",
        f"verify 2 0 {[f'cpslice verify: error: {said}']}",
        f"bench 2 0 {[f'cpslice bench: error: {said}']}",
    ], done.out
    assert done.err == ""


@pytest.mark.parametrize(
    ("env", "tty", "colour"),
    [
        ({"TERM": "dumb"}, True, False),
        ({"TERM": "xterm-256color"}, True, True),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"FORCE_COLOR": "1", "TERM": "dumb"}, True, True),
        ({"FORCE_COLOR": ""}, False, False),
        ({"FORCE_COLOR": "1", "NO_COLOR": "1"}, True, False),
    ],
)
def test_colour_follows_term_and_force_color(
    env: dict[str, str], tty: bool, colour: bool, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    code, out, _ = run(ZIGZAG_EXAMPLE, capsys)
    assert code == 0
    assert ("\x1b[" in out) == colour
    assert ANSI.sub("", out) == ZIGZAG_EXAMPLE_OUT


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--help"], capsys)
    assert code == 0
    assert "--total" in out and "--local-length" in out


def test_broken_pipe_is_quiet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def closed(text: str) -> int:
        raise BrokenPipeError

    monkeypatch.setattr(sys.stdout, "write", closed)
    assert main(ZIGZAG_EXAMPLE) == 1
    assert capsys.readouterr().err == ""


def _script() -> str | None:
    """The installed ``cpslice`` console script, if any."""
    beside = Path(sys.executable).parent / "cpslice"
    return str(beside) if beside.exists() else shutil.which("cpslice")


def _command_lines() -> dict[str, Job]:
    """``python -m cpslice plan`` (timing its imports) and the console script given a
    mistake, in a folder of their own: background jobs (tests/support/background.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "CPSLICE_DEBUG")}
    here = background.folder()
    jobs = {"module": Job((sys.executable, "-X", "importtime", "-m", "cpslice", *ZIGZAG_EXAMPLE), env, here)}
    script = _script()
    if script is not None:
        jobs["script"] = Job((script, "plan", "--total", "3", "--response", "3"), env, here)
    return jobs


background.register("plan-command-line", "tests/cli/test_cli_plan.py::test_command_line_without", _command_lines)


def test_command_line_without_megatron() -> None:
    """``python -m cpslice`` (which imports no megatron) and the console script."""
    done = background.result("plan-command-line", timeout=200)
    module = done["module"]
    assert module.code == 0, module.err[-2000:]
    assert module.out == ZIGZAG_EXAMPLE_OUT
    imported = [line.rsplit("|", 1)[-1].strip() for line in module.err.splitlines()]
    assert "cpslice._cli" in imported
    assert not [name for name in imported if name.split(".")[0] == "megatron"]
    if "script" not in done:
        pytest.skip("the cpslice console script is not installed (pip install -e .)")
    # the console script, with a mistake: one line and exit 2 (the good output is -m's)
    bad = done["script"]
    assert (bad.code, bad.out) == (2, "")
    assert bad.err == (
        "cpslice plan: error: sample 0: response_length 3 > total_length - 1 = 2 "
        "(a response needs at least one prompt token before it)\n"
    )


# torch's _PerDocumentHeadTailLoadBalancer for two documents of 8 at cp 2: document after
# document, each rank's head and tail chunks; as a rearrange index, rank 0 holds document 0
# (its chunks 0, 3, 1, 2) and rank 1 document 1.
PER_DOCUMENT = ["plan", "--total", "8,8", "--response", "4,3", "--cp-size", "2",
                "--balancer", "per-document-head-tail"]
PER_DOCUMENT_INDEX = "0,1,6,7,2,3,4,5,8,9,14,15,10,11,12,13"
PER_DOCUMENT_OUT = """\
cpslice plan: 2 samples, cp_mode order (--balancer per-document-head-tail: torch's _PerDocumentHeadTailLoadBalancer), cp_size 2, qkv_format thd, strategy order, local length T = 8 (the least that fits)
sample 0: L 8 = prompt 4 + response 4; prompt tokens [0, 4), response tokens [4, 8), response span [3, 7)
sample 1: L 8 = prompt 5 + response 3; prompt tokens [0, 5), response tokens [5, 8), response span [4, 7)
order 0,1,6,7,2,3,4,5,8,9,14,15,10,11,12,13 (rank r holds stream positions order[r*T:(r+1)*T])
legend: p prompt token, r response token, . padding; P, R: that token's logit is in the response span, so that rank extracts it
        (response span of sample i: the logits [P_i - 1, L_i - 1) that predict its response); '|' separates samples, ' ' a sample's runs
        an order's runs: in row order in the picture, in position order in the lines below

rank 0 of 2: T = 8, strategy order
  pp Rr pPRR
  sample 0: holds positions [0, 2) at local [0, 2) + positions [2, 6) at local [4, 8) + positions [6, 8) at local [2, 4)
  sample 0: response share local [5, 8) + [2, 3), positions [3, 6) + [6, 7) (4 of 4)
  sample 1: holds nothing
  sample 1: response share none

rank 1 of 2: T = 8, strategy order
  pp Rr ppPR
  sample 0: holds nothing
  sample 0: response share none
  sample 1: holds positions [0, 2) at local [0, 2) + positions [2, 6) at local [4, 8) + positions [6, 8) at local [2, 4)
  sample 1: response share local [6, 8) + [2, 3), positions [4, 6) + [6, 7) (3 of 3)
"""


def _header_source(out: str, source: str) -> str:
    """``out`` with its header's order source replaced by ``source``."""
    head, _, rest = out.partition("\n")
    return re.sub(r"cp_mode (\w+) \((.*?)(, which places|\), cp_size)",
                  lambda m: f"cp_mode {m.group(1)} ({source}{m.group(3)}", head, count=1) + "\n" + rest


def test_torch_per_document_head_tail(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(PER_DOCUMENT, capsys)
    assert (code, err) == (0, "")
    assert out == PER_DOCUMENT_OUT
    # the same index given: the same plan, the header naming --order
    code, given, _ = run([*PER_DOCUMENT[:-2], "--order", PER_DOCUMENT_INDEX], capsys)
    assert code == 0
    assert given == _header_source(PER_DOCUMENT_OUT, "--order")
    assert "cp_mode order (--order), cp_size 2" in given


def test_an_order_a_closed_form_places_alike_is_that_closed_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # torch's head-tail of a bshd row is zigzag; so is the zigzag index given as --order
    flags = ["--total", "10,7", "--response", "4,3", "--format", "bshd", "--max-seq-len", "12",
             "--cp-size", "2"]
    _, closed, _ = run(["plan", *flags, "--mode", "zigzag"], capsys)
    code, out, err = run(["plan", *flags, "--balancer", "head-tail"], capsys)
    assert (code, err) == (0, "")
    lines = out.split("\n")
    assert out.startswith(
        "cpslice plan: 2 samples, cp_mode zigzag (--balancer head-tail: torch's _HeadTailLoadBalancer, "
        "which places every position as zigzag does), cp_size 2, qkv_format bshd, max_seq_len 12, "
        "strategy zigzag, local length T = 12 (the least that fits)\n")
    assert lines[3] == "order 0,1,2,9,10,11,3,4,5,6,7,8 (rank r holds stream positions order[r*T:(r+1)*T])"
    assert lines[1:3] + lines[4:] == closed.split("\n")[1:]  # but the order line
    index = Layout([10, 7], [4, 3], qkv_format="bshd", max_seq_len=12, cp_mode="zigzag",
                   cp_size=2).order()
    rows = ";".join(",".join(str(v) for v in row) for row in index.tolist())
    code, given, _ = run(["plan", *flags, "--order", rows], capsys)
    assert code == 0
    assert "cp_mode zigzag (--order, which places every position as zigzag does)" in given
    assert given.split("\n")[4:] == out.split("\n")[4:]


@pytest.mark.parametrize("kind", ["pt", "pt-int32", "json", "json-rows", "text"])
def test_an_order_from_a_file(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = [int(v) for v in PER_DOCUMENT_INDEX.split(",")]
    path = tmp_path / ("order.pt" if kind.startswith("pt") else "order.txt")
    if kind == "pt":
        torch.save(torch.tensor(index), path)
    elif kind == "pt-int32":  # what torch's balancers return: [1, N] torch.int
        torch.save(torch.tensor([index], dtype=torch.int32), path)
    elif kind == "json":
        path.write_text(str(index) + "\n")
    elif kind == "json-rows":
        path.write_text(str([index]) + "\n")
    else:
        path.write_text(" ".join(map(str, index[:8])) + "\n" + ", ".join(map(str, index[8:])) + "\n")
    code, out, err = run([*PER_DOCUMENT[:-2], "--order", str(path)], capsys)
    assert (code, err) == (0, "")
    assert out == _header_source(PER_DOCUMENT_OUT, "--order")


ORDER_LAYOUTS = [
    ["--total", "10,7", "--response", "4,3", "--cp-size", "2", "--balancer", "random",
     "--padded-lengths", "10,8"],
    ["--total", "10,7,4", "--response", "4,6,2", "--cp-size", "3", "--balancer", "random",
     "--seed", "5", "--local-length", "9"],
    ["--total", "10,7", "--response", "4,3", "--cp-size", "2", "--balancer", "block",
     "--block-size", "3", "--seed", "1", "--padded-lengths", "10,8"],
    ["--total", "10,7", "--response", "9,6", "--cp-size", "4", "--balancer", "per-document-head-tail",
     "--align", "8"],
    ["--total", "10,7", "--response", "4,3", "--cp-size", "2", "--balancer", "head-tail",
     "--align", "4"],
    ["--total", "10,7,3", "--response", "4,3,1", "--format", "bshd", "--max-seq-len", "12",
     "--cp-size", "2", "--balancer", "random", "--seed", "3"],
    ["--total", "10,7", "--response", "4,5", "--format", "bshd", "--max-seq-len", "12",
     "--row-offsets", "0,4", "--cp-size", "3", "--balancer", "block", "--block-size", "5"],
]


@pytest.mark.parametrize("flags", ORDER_LAYOUTS)
def test_an_order_plan_prints_what_extraction_returns(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["plan", *flags], capsys)
    assert (code, err) == (0, ""), err
    found = re.search(r"^order (\S+) \(rank r holds", out, re.M)
    assert found is not None
    length_found = re.search(r"local length T = (\d+)", out)
    assert length_found is not None
    length = int(length_found.group(1))
    # the printed order, given back, is the same plan
    balancer = flags.index("--balancer")
    given = [f for i, f in enumerate(flags) if i not in (balancer, balancer + 1)]
    given = [f for i, f in enumerate(given) if f not in ("--seed", "--block-size")
             and (i == 0 or given[i - 1] not in ("--seed", "--block-size"))]
    code, again, _ = run(["plan", *given, "--order", found.group(1)], capsys)
    assert code == 0
    assert again.split("\n")[1:] == out.split("\n")[1:]
    opts = dict(zip(flags[::2], flags[1::2]))
    index = torch.tensor([[int(v) for v in row.split(",")] for row in found.group(1).split(";")])
    max_seq, align = opts.get("--max-seq-len"), opts.get("--align")
    padded, offsets = opts.get("--padded-lengths"), opts.get("--row-offsets")
    cp_size = int(opts["--cp-size"])
    blocks = out.split("\n\n")[1:]
    assert len(blocks) == cp_size
    for rank, block in enumerate(blocks):
        layout = Layout.from_order(
            index, [int(v) for v in opts["--total"].split(",")],
            [int(v) for v in opts["--response"].split(",")], cp_rank=rank, cp_size=cp_size,
            qkv_format=cast(QkvFormat, opts.get("--format", "thd")),
            max_seq_len=int(max_seq) if max_seq else None,
            padded_lengths=[int(v) for v in padded.split(",")] if padded else None,
            align=int(align) if align else None,
            row_offsets=[int(v) for v in offsets.split(",")] if offsets else None,
        ).with_local_length(length)
        _shares_are_extracted(block, layout, length)


def test_a_long_order_is_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--total", "300,200", "--response", "100,50", "--cp-size", "2",
                        "--balancer", "block", "--block-size", "64"], capsys)
    assert code == 0
    assert "\norder " not in out
    assert "pictures over 120 rows are run-length coded" in out
    assert "cp_mode order (--balancer block, --block-size 64, --seed 0), cp_size 2" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--order", "0,1,1,2"],
         "cpslice plan: error: order[2] = 1 repeats order[1] (a thd order must be a permutation "
         "of range(4): each position once)\n"),
        (["--order", "0,1,2"],
         "cpslice plan: error: a thd order has 3 entries but must have 4 (a permutation of range(4))\n"),
        (["--order", "0,1,4,2"],
         "cpslice plan: error: order[2] = 4 is outside [0, 4) (a thd order must be a permutation "
         "of range(4))\n"),
        (["--order", "0,-1,3,2"],
         "cpslice plan: error: order[1] = -1 is outside [0, 4) (a thd order must be a permutation "
         "of range(4))\n"),
        (["--order", "0,1,2,3", "--cp-size", "3"],
         "cpslice plan: error: --cp-size 3 does not divide the order's 4 positions (each rank "
         "holds N / --cp-size of them)\n"),
        (["--order", "0,1;2,3"],
         "cpslice plan: error: a thd order has shape [N] or [1, N], got [2, 2]\n"),
        (["--order", "0,1,3", "--format", "bshd", "--max-seq-len", "4"],
         "cpslice plan: error: a bshd order's rows have 3 columns but --max-seq-len is 4\n"),
        (["--order", "0,1,x"],
         "cpslice plan: error: argument --order: '0,1,x' is neither ints separated by commas "
         "(e.g. 0,3,1,2; ';' between bshd rows) nor a file that can be read (No such file or "
         "directory)\n"),
        (["--order", "0,1;2"],
         "cpslice plan: error: argument --order: '0,1;2' has rows of [1, 2] entries (one row of "
         "ints for thd (or for every bshd row), rows of equal length for bshd)\n"),
        (["--order", "0,1,3,2", "--mode", "zigzag"],
         "cpslice plan: error: --order places every position itself, so --mode is not taken with "
         "it; drop --mode (the plan says which closed form, if any, places alike)\n"),
        (["--balancer", "random", "--mode", "none"],
         "cpslice plan: error: --balancer places every position itself, so --mode is not taken "
         "with it; drop --mode (the plan says which closed form, if any, places alike)\n"),
        (["--order", "0,1,3,2", "--balancer", "random"],
         "cpslice plan: error: argument --balancer: not allowed with argument --order\n"),
        (["--balancer", "ptrr"], "cpslice plan: error: argument --balancer: invalid choice: 'ptrr'"),
        (["--order", "0,1,3,2", "--seed", "2"],
         "cpslice plan: error: --seed is for --balancer random or block\n"),
        (["--balancer", "random", "--block-size", "2"],
         "cpslice plan: error: --block-size is for --balancer block\n"),
        (["--balancer", "block", "--block-size", "0"], "cpslice plan: error: --block-size 0 < 1\n"),
        (["--balancer", "per-document-head-tail", "--total", "10", "--response", "4"],
         "cpslice plan: error: torch's per-document head-tail balancer cuts every sample into "
         "2 * --cp-size = 4 chunks, but sample 0 has 10 positions; pad the samples to a multiple "
         "(--align 4)\n"),
        (["--balancer", "head-tail", "--total", "10", "--response", "4", "--align", "5"],
         "cpslice plan: error: torch's head-tail balancer cuts the 10 positions into 2 * --cp-size "
         "= 4 chunks, and 4 does not divide 10; pad the samples\n"),
        (["--balancer", "per-document-head-tail", "--format", "bshd", "--max-seq-len", "4"],
         "cpslice plan: error: per-document head-tail balances the documents packed in a thd "
         "stream; a bshd row is one document: use head-tail\n"),
        (["--balancer", "random", "--total", "10,7", "--response", "4,3"],
         "cpslice plan: error: --cp-size 2 does not divide the order's 17 positions (each rank "
         "holds N / --cp-size of them)\n"),
    ],
)
def test_bad_orders_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole line where ``message`` ends the line, else its start."""
    base = {"--total": "4", "--response": "2", "--cp-size": "2"}
    for flag in [a for a in argv if a in base]:
        del base[flag]
    code, out, err = run(["plan", *(x for kv in base.items() for x in kv), *argv], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err == message if message.endswith("\n") else err.startswith(message), err


def test_a_bad_order_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["plan", "--total", "4", "--response", "2", "--cp-size", "2", "--order"]
    floats = tmp_path / "floats.pt"
    torch.save(torch.tensor([0.0, 1.0, 3.0, 2.0]), floats)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[0, 1, 3.5, 2]")
    missing = tmp_path / "missing.pt"
    for path, said in [(floats, f"the order in '{floats}' is not an integer tensor (got torch.float32)"),
                       (bad_json, f"the order in '{bad_json}' is not a JSON list of ints, nor a list "
                                  "of such lists"),
                       (missing, f"'{missing}' is neither ints separated by commas")]:
        code, out, err = run([*flags, str(path)], capsys)
        assert (code, out) == (2, "")
        assert err.startswith(f"cpslice plan: error: argument --order: {said}"), err
        assert err.count("\n") == 1


def test_a_moved_torch_balancer_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cpslice._cli.balancers import TORCH_BALANCERS

    # a torch whose private module moved: importing it fails (the environment, not cpslice)
    monkeypatch.setitem(sys.modules, TORCH_BALANCERS, None)
    code, out, err = run(PER_DOCUMENT, capsys)
    assert (code, out) == (1, "")  # not a usage error: this torch lacks it
    assert err.startswith(
        f"cpslice plan: error: torch {torch.__version__} has no _PerDocumentHeadTailLoadBalancer in "
        f"{TORCH_BALANCERS} (import of {TORCH_BALANCERS} halted; None in sys.modules): "
        "torch's load balancers live in a private module, which moved; pass the index itself")
    assert err.count("\n") == 1
    # random and block need no torch balancer
    assert run([*PER_DOCUMENT[:-1], "random"], capsys)[0] == 0


def _shares_are_extracted(block: str, layout: Layout, length: int, depth: int = 0) -> None:
    """The rows a rank's block prints as each sample's response share are the rows
    ``extract_responses`` returns for it (at ``depth``)."""
    shares, _ = extract_responses(torch.arange(length, dtype=torch.float32), layout, depth=depth)
    printed = re.findall(r"response share (?:none|local (.*?), positions)", block)
    assert len(printed) == layout.num_samples
    for share, ranges in zip(shares, printed):
        rows: list[int] = []
        for lo, hi in re.findall(r"\[(\d+), (\d+)\)", ranges):
            rows += range(int(lo), int(hi))
        assert share.tolist() == rows


# docs/layouts.md's star: one group of 3, P = 3, R = 2, 4, 3 (L* = 12), zigzag over 2 ranks
STAR = ["plan", "--total", "5,7,6", "--response", "2,4,3", "--shared-prefix", "3", "--cp-size", "2",
        "--mode", "zigzag"]


def _strips(block: str) -> dict[int, str]:
    """A rank block's line per sample under the picture: one glyph per local row."""
    found = re.findall(r"^  (\S.*?)  sample (\d+)$", block, re.M)
    return {int(i): strip.replace("|", "").replace(" ", "") for strip, i in found}


def _rows(ranges: str) -> list[int]:
    rows: list[int] = []
    for lo, hi in re.findall(r"\[(\d+), (\d+)\)", ranges):
        rows += range(int(lo), int(hi))
    return rows


def test_a_star_s_shares_are_layouts_md_s(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(STAR, capsys)
    assert (code, err) == (0, "")
    assert ", shared prefix 3, strategy zigzag, local length T = 6 " in out.splitlines()[0]
    assert ("star 0: samples 0-2, L* 12 = prompt 3 + responses 2 + 4 + 3; star positions: prompt "
            "[0, 3) once, then sample 0's [3, 5), sample 1's [5, 9), sample 2's [9, 12)") in out
    blocks = out.split("\n\n")[1:]
    want = [{0: [2], 1: [2], 2: [2, 3, 4]}, {0: [0], 1: [2, 3, 4], 2: []}]
    pictures = ["ppP RRr", "RrR RRr"]
    strips = [{0: "ppP---", 1: "ppP---", 2: "ppPRRr"}, {0: "Rr----", 1: "--RRRr", 2: "------"}]
    for rank, block in enumerate(blocks):
        shares = re.findall(r"sample (\d+): response share (?:none|local (.*?), positions)", block)
        assert {int(i): _rows(r) for i, r in shares} == want[rank]
        assert block.splitlines()[1] == "  " + pictures[rank]
        assert _strips(block) == strips[rank]
    # rank 0 holds star positions 0-2 and 9-11, rank 1 3-5 and 6-8
    assert "star 0: holds star positions [0, 3) at local [0, 3) + star positions [9, 12) at local [3, 6)" in blocks[0]
    assert "star 0: holds star positions [3, 6) at local [0, 3) + star positions [6, 9) at local [3, 6)" in blocks[1]


SHARED_LAYOUTS = [
    ["--total", "5,7,6", "--response", "2,4,3", "--shared-prefix", "3"],
    ["--total", "5,7,3,4,3", "--response", "2,4,0,1,2", "--shared-prefix", "3,1,1", "--cp-size", "2",
     "--mode", "zigzag", "--align", "8"],
    ["--total", "2,2,9,4,5", "--response", "1,1,8,1,2", "--shared-prefix", "2,1,2", "--cp-size", "3",
     "--mode", "zigzag", "--depth", "1"],
    ["--total", "5,7,6,4", "--response", "2,4,3,3", "--shared-prefix", "3,1", "--cp-size", "2",
     "--mode", "allgather", "--local-length", "9", "--depth", "2"],
    ["--total", "5,7,6,4", "--response", "2,4,3,3", "--shared-prefix", "3,1", "--cp-size", "2",
     "--mode", "zigzag", "--padded-lengths", "16,8", "--depth", "3"],
    ["--total", "5,7,6,4", "--response", "2,4,3,3", "--shared-prefix", "3,1", "--cp-size", "2",
     "--order", "12,2,3,13,14,4,10,11,8,6,0,15,9,5,1,7"],
]


@pytest.mark.parametrize("flags", SHARED_LAYOUTS)
def test_a_shared_or_deep_plan_prints_what_extraction_returns(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each sample's printed share is what ``extract_responses(..., depth=d)`` returns, and
    with a shared prefix its line under the picture marks those rows upper case, and the
    rows it holds (any case) are the ones its "holds" line lists."""
    code, out, err = run(["plan", *flags], capsys)
    assert (code, err) == (0, ""), err
    opts = dict(zip(flags[::2], flags[1::2]))
    found = re.search(r"local length T = (\d+)", out)
    assert found is not None
    length, d = int(found.group(1)), int(opts.get("--depth", "0"))
    assert (f", depth {d}," in out.splitlines()[0]) == (d > 0)
    cp_size = int(opts.get("--cp-size", "1"))
    groups = opts.get("--shared-prefix")
    padded, align = opts.get("--padded-lengths"), opts.get("--align")
    total = [int(v) for v in opts["--total"].split(",")]
    response = [int(v) for v in opts["--response"].split(",")]
    blocks = out.split("\n\n")[1:]
    assert len(blocks) == cp_size
    for rank, block in enumerate(blocks):
        widths = [int(v) for v in padded.split(",")] if padded else None
        sizes = [int(v) for v in groups.split(",")] if groups else None
        if "--order" in opts:
            index = torch.tensor([int(v) for v in opts["--order"].split(",")])
            layout = Layout.from_order(index, total, response, cp_rank=rank, cp_size=cp_size,
                                       padded_lengths=widths, shared_prefix=sizes)
        else:
            layout = Layout(total, response, cp_mode=cast(CpMode, opts.get("--mode", "none")),
                            cp_rank=rank, cp_size=cp_size, padded_lengths=widths,
                            align=int(align) if align else None, shared_prefix=sizes)
        layout = layout.with_local_length(length)
        _shares_are_extracted(block, layout, length, d)
        strips = _strips(block)
        if groups is None:
            assert strips == {}
            continue
        shares, _ = extract_responses(torch.arange(length, dtype=torch.float32), layout, depth=d)
        holds = dict(re.findall(r"sample (\d+): holds (.*)", block))
        assert sorted(strips) == list(range(len(total)))
        for i, strip in strips.items():
            assert len(strip) == length
            assert [j for j, g in enumerate(strip) if g in "PR"] == sorted(shares[i].long().tolist())
            mine = [j for j, g in enumerate(strip) if g in "prPR"]
            listed = [] if holds[str(i)] == "nothing" else sorted(
                _rows(" ".join(part.split(" at local ")[1] for part in holds[str(i)].split(" + "))))
            assert mine == listed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shared-prefix", "2"],
         "cpslice plan: error: --shared-prefix sums to 2 but there are 3 samples (the group sizes "
         "G_0 + G_1 + ... count every sample once, groups of consecutive samples)\n"),
        (["--shared-prefix", "1,0,2"], "cpslice plan: error: group 1: --shared-prefix size 0 < 1 "
         "(a group holds a sample)\n"),
        (["--shared-prefix", "3", "--format", "bshd", "--max-seq-len", "8"],
         "cpslice plan: error: --shared-prefix is given with --format 'bshd', whose rows hold one "
         "sample each; pass --format thd to pack each group's prompt once with its responses\n"),
        (["--response", "2,4,1", "--shared-prefix", "3"],
         "cpslice plan: error: group 0: sample 2 has prompt length 5 (total_length 6 - "
         "response_length 1) but sample 0, the group's first, has 3"),
        (["--shared-prefix", "3,x"], "cpslice plan: error: argument --shared-prefix: '3,x' is not a "
         "comma-separated list of ints, one size per group (e.g. 4,1,3: the samples 0-3, 4 and 5-7)\n"),
        (["--shared-prefix", "3", "--padded-lengths", "12,12,12"],
         "cpslice plan: error: --padded-lengths has 3 entries but --shared-prefix has 1 groups (a "
         "--shared-prefix layout pads each group's star: one entry per group)\n"),
        (["--shared-prefix", "3", "--cp-size", "2", "--mode", "zigzag", "--padded-lengths", "14"],
         "cpslice plan: error: "),
        (["--depth", "-1"], "cpslice plan: error: --depth -1 < 0 (at depth d the logit at position p "
         "predicts token p + 1 + d; 0 is the next token)\n"),
        (["--depth", "one"], "cpslice plan: error: argument --depth: invalid int value: 'one'\n"),
    ],
)
def test_bad_shared_prefix_or_depth_is_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--total": "5,7,6", "--response": "2,4,3"}
    for flag in [a for a in flags if a in base]:
        del base[flag]
    code, out, err = run(["plan", *(x for kv in base.items() for x in kv), *flags], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err == message if message.endswith("\n") else err.startswith(message), err
    assert not re.search(r"\b(shared_prefix|padded_lengths|qkv_format)\b", err), err
