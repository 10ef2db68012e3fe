"""``benchmarks/against.py``'s summary: it pairs the lines of two runs of a benchmark
that read the same once their numbers are masked, and gives each changed number's
ratio (the run itself, two benchmark runs, is the tool's, not the suite's)."""

from benchmarks.against import summary

BASE = """T=2048 V=16384 float32
method      peak   wall ms
cpslice     0.250     3573
naive       2.000     9000
"""
THIS = """T=2048 V=16384 float32
method      peak   wall ms
cpslice     0.250     1786
other       1.000      100
"""


def test_the_summary_pairs_lines_and_gives_ratios() -> None:
    assert summary(BASE, THIS) == ["cpslice     0.250     1786" + " " * 34 + " | 3573 -> 1786 (0.50x)"]


def test_a_line_that_did_not_change_is_left_out() -> None:
    assert summary(BASE, BASE) == []
