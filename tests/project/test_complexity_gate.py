"""The complexity gate: ruff's C901 at the threshold pyproject.toml sets, run by
``make lint``, which ``make test`` runs. A function over the threshold fails it."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def _threshold() -> int:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"\[tool\.ruff\.lint\.mccabe\][^\[]*?max-complexity = (\d+)", text)
    assert found, "pyproject.toml sets no [tool.ruff.lint.mccabe] max-complexity"
    return int(found.group(1))


def _branches(n: int) -> str:
    """A function of complexity ``n + 1``: ``n`` independent ``if``s."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n))
    return f"def f(x: int) -> int:\n{body}    return -1\n"


def test_make_test_runs_the_lint_gate() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_deps = re.search(r"^test:(.*)$", makefile, re.M)
    assert test_deps and "lint" in test_deps.group(1).split()
    assert re.search(r"^lint:.*\n\t.*ruff check src tests benchmarks examples", makefile, re.M)
    assert '"C901"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.skipif(not RUFF.exists() and shutil.which("ruff") is None, reason="ruff is a dev tool")
def test_a_function_over_the_threshold_fails_the_gate(tmp_path: Path) -> None:
    ruff = str(RUFF) if RUFF.exists() else "ruff"
    limit = _threshold()
    for n, fails in ((limit - 1, False), (limit, True)):  # complexity limit, then limit + 1
        (tmp_path / "m.py").write_text(_branches(n))
        run = subprocess.run([ruff, "check", "--config", str(ROOT / "pyproject.toml"), "--select", "C901",
                              "--no-cache", str(tmp_path / "m.py")], capture_output=True, text=True)
        assert (run.returncode != 0) == fails, (n, run.stdout)
        assert ("C901" in run.stdout) == fails
