"""What a user installs: the wheel's and the sdist's contents and metadata (built here
with setuptools, no network), the optional extras, the version, the README's opening."""

import email.parser
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

import cpslice
from cpslice import _cli

from ..support import background
from ..support.background import Job

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


# The build and the collection of the unpacked sdist's tests take seconds of CPU and
# nothing from the session: one background job (tests/support/background.py) does both, on a
# copy of this tree in a folder of its own.
PACKAGE = r"""
import contextlib, os, shutil, subprocess, sys, tarfile
from pathlib import Path
from setuptools import build_meta

root, folder = Path(sys.argv[1]), Path(sys.argv[2])
skip = shutil.ignore_patterns(*sys.argv[3:])
tree, out, unpacked = folder / "tree", folder / "out", folder / "sdist"
shutil.copytree(root, tree, ignore=skip)
os.chdir(tree)
with contextlib.redirect_stdout(sys.stderr):  # setuptools' log: stdout is the result
    build_meta.build_sdist(str(out))
    build_meta.build_wheel(str(out))
(sdist,) = out.glob("*.tar.gz")
with tarfile.open(sdist) as tar:
    tar.extractall(unpacked, filter="data")
(top,) = unpacked.iterdir()
# pytest on the unpacked sdist collects every test (nothing fails at import); without
# the run-time checker's plugin, which would spend seconds wrapping the package
env = {**os.environ, "PYTHONPATH": str(top / "src")}
done = subprocess.run(
    [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "tests/distributed/test_end_to_end.py",
     "tests/cli/test_cli_verify.py", "tests/layout/test_pack.py", "tests/project/test_docs.py"],  # every helper
    cwd=top, env=env, capture_output=True, text=True, timeout=300, check=False,
)
print(f"collect-only exit {done.returncode}")
print(done.stdout[-3000:] + done.stderr[-3000:])
"""
SKIPPED = (".git", ".venv", "__pycache__", "*.egg-info", ".mypy_cache", ".pytest_cache", ".hypothesis",
           "build", "dist")


def _package() -> dict[str, Job]:
    folder = background.folder() / "package"
    return {"package": Job((sys.executable, "-c", PACKAGE, str(ROOT), str(folder), *SKIPPED), dict(os.environ),
                           ROOT)}


background.register("package",
                    ("tests/project/test_packaging.py::test_wheel", "tests/project/test_packaging.py::test_sdist"),
                    _package)


@pytest.fixture(scope="module")
def built() -> tuple[Path, Path, str]:
    """(wheel, sdist) of a copy of this tree, built by setuptools' PEP 517 backend, and
    what pytest's collection of the unpacked sdist's tests printed."""
    done = background.result("package", timeout=400)["package"]
    assert done.code == 0, done.err[-3000:]
    out = background.folder() / "package" / "out"
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist, done.out


def test_license_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for clause in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty",
                   "END OF TERMS AND CONDITIONS"):
        assert clause in text
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]


def test_wheel_metadata_and_contents(built: tuple[Path, Path, str]) -> None:
    wheel, _, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(info).decode())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "cpslice"}, "only the package: no tests/ or benchmarks/ at the top of site-packages"
    assert "cpslice/py.typed" in names
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["Author"] == "cpslice developers"
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in classifiers
    requires = [r.replace(" ", "") for r in meta.get_all("Requires-Dist") or []]
    base = sorted(r.split(";")[0] for r in requires if ";" not in r)
    assert [re.split("[<>=]", r)[0] for r in base] == ["jaxtyping", "numpy", "torch"]
    assert 'megatron-core>=0.12;extra=="megatron"' in requires
    assert 'beartype>=0.19;extra=="debug"' in requires
    assert sorted(meta.get_all("Provides-Extra") or []) == ["debug", "megatron"]


def test_sdist_holds_its_tests_and_what_they_need(
    built: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, sdist, collected = built
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (top,) = tmp_path.iterdir()
    for path in ("LICENSE", "CHANGELOG.md", "README.md", "Makefile", "mypy.ini",
                 "requirements-dev.txt", "pyproject.toml"):
        assert (top / path).is_file(), path
    # docs/: tests/project/test_docs.py runs every page's examples; examples/: test_gpt runs them
    for folder, files in (("tests", "*.py*"), ("typings", "*.py*"), ("benchmarks", "*.py*"),
                          ("docs", "*.md"), ("examples", "*.py*")):
        here = {p.relative_to(ROOT) for p in (ROOT / folder).rglob(files)
                if "__pycache__" not in p.parts}
        there = {p.relative_to(top) for p in (top / folder).rglob(files)}
        assert here <= there, sorted(map(str, here - there))
    # pytest on the unpacked sdist collected every test (PACKAGE: nothing failed at import)
    assert collected.startswith("collect-only exit 0\n"), collected
    assert " error" not in collected


def test_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpslice.__version__ == PROJECT["version"]
    assert "__version__ =" not in (ROOT / "src/cpslice/__init__.py").read_text().replace(
        "__version__ = _installed_version()", "")
    assert _cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"cpslice {PROJECT['version']}\n"
    assert f"## {PROJECT['version']}" in (ROOT / "CHANGELOG.md").read_text()


BLOCKED = 'import sys\nfor name in {names}:\n    sys.modules[name] = None  # not installed\n'


def _python(code: str, blocked: tuple[str, ...], debug: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CPSLICE_DEBUG": debug}
    source = BLOCKED.format(names=list(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.slow  # a fresh interpreter that imports torch and cpslice, in line
def test_without_the_extras_the_library_works_and_names_them() -> None:
    done = _python("""
        import torch, cpslice
        from cpslice._verify import cases, runner
        layout = cpslice.Layout([10, 7], [4, 3], cp_mode="zigzag", cp_rank=1, cp_size=2)
        tokens = [torch.randint(0, 9, (t,)) for t in (10, 7)]
        logits = torch.randn(cpslice.pack(tokens, layout).shape[0], 9)
        lp, _ = cpslice.response_log_probs(logits, tokens, layout)
        assert [x.shape[0] for x in lp] == [4, 3]
        for call in (lambda: cpslice.Layout.from_parallel_state([10], [4]),
                     lambda: runner.verify_main(cases.Config(2, 1, ()))):
            try:
                call()
            except ImportError as e:
                print(e)
            else:
                raise SystemExit("no ImportError")
    """, ("megatron", "beartype"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'cpslice[megatron]'" in x for x in lines)
    assert lines[0].startswith("Layout.from_parallel_state reads megatron-core's parallel_state")


def test_debug_mode_without_beartype_names_the_extra() -> None:
    done = _python("import cpslice", ("beartype",), debug="1")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ImportError: CPSLICE_DEBUG=1 checks every call with beartype, which is not "
        "installed: pip install 'cpslice[debug]' (or unset CPSLICE_DEBUG)")


def test_the_dev_install_still_has_the_extras() -> None:
    pins = (ROOT / "requirements-dev.txt").read_text()
    assert re.search(r"^megatron-core==", pins, re.M) and re.search(r"^beartype==", pins, re.M)
    assert "-e '.[megatron,debug]'" in (ROOT / "Makefile").read_text()


def test_transformers_is_a_dev_dependency_only() -> None:
    # tests/glue/test_hf.py and examples/hf_grpo_step.py need it; the library never does
    assert re.search(r"^transformers==\d", (ROOT / "requirements-dev.txt").read_text(), re.M)
    assert "transformers" not in (ROOT / "pyproject.toml").read_text()


def test_readme_opens_with_what_and_how_to_install() -> None:
    text = (ROOT / "README.md").read_text()
    heads = re.findall(r"^## (.*)$", text, re.M)
    assert heads[0] == "Install"
    opening = text[: text.index("## Install")]
    assert "make test" not in opening, "what cpslice is comes first, then how to install it"
    install = text[text.index("## Install") : text.index(f"## {heads[1]}")]
    # no release yet: the clone comes first, then its one command, then an own environment's
    commands = re.findall(r"^```sh\n(.*?)^```", install, re.S | re.M)[0].splitlines()
    assert "no release on PyPI yet" in install
    assert commands[0].startswith("git clone ") and commands[1].startswith("make test ")
    assert "make test TORCH_INDEX=https://download.pytorch.org/whl/cpu" in install
    clone, torch_cpu = install.index("git clone"), install.index("pip install torch --index-url "
                                                                  "https://download.pytorch.org/whl/cpu")
    extras = install.index("pip install -e '.[megatron,debug]'")
    assert clone < install.index("\nmake test", clone) < install.index("\nmake demo", clone) < torch_cpu < extras
    # how long the two commands take, in minutes
    assert re.search(r"first\s+`make test` takes about \d+ minutes", install), install
    assert re.search(r"`make demo` about \d+ (seconds|minutes?)", install), install


def _make_install(*assignments: str) -> list[str]:
    """The commands ``make install`` would run (``make -n -B``: printed, none run)."""
    done = subprocess.run(["make", "-n", "-B", "install", *assignments], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=60)
    return done.stdout.splitlines()


def test_make_install_takes_torch_from_the_index_given_and_says_each_stage() -> None:
    plain = _make_install()
    torch_line = [line for line in plain if "pip install" in line and "torch==" in line]
    assert len(torch_line) == 1 and "--index-url" not in torch_line[0], plain  # pip's configured index
    cpu = _make_install("TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    torch_line = [line for line in cpu if "pip install" in line and "torch==" in line]
    assert len(torch_line) == 1 and torch_line[0].endswith("--index-url https://download.pytorch.org/whl/cpu"), cpu
    assert not [line for line in cpu if "--index-url" in line and "torch==" not in line and "echo" not in line]
    stages = [line for line in plain if line.startswith('echo "make install: ')]
    assert [s.split()[3] for s in stages[:4]] == ["1/4", "2/4", "3/4", "4/4"], stages
    assert all(line.startswith("echo ") or "-q" in line for line in plain if "pip install" in line)
