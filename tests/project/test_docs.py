"""The documentation runs and holds together: README.md and every page under docs/.

- Every ```python block runs as written, one test per (page, block). Each block runs
  alone in a fresh namespace, on every page: a block starts with its own imports and
  builds its own data, so a reader can copy any one of them. A block that needs several
  processes (megatron-core's parallel_state, a CP group) plays one rank in one process,
  or only defines the functions a rank would call (tests/distributed/test_gpt.py and
  tests/distributed/test_sample_means.py run those on real gloo ranks).
- Every relative link of a page points at a file of the repository (and at a heading
  of it, for a ``#anchor``); no page refers to anything outside the repository.
- The README's documentation table links every user page (docs/*.md, it is the map)
  and, once, the maintainers' index (docs/dev/README.md), which links every page of
  docs/dev/; the README's API table lists exactly ``cpslice.__all__``, each name once.
- Every ```text transcript of ``$ cpslice plan ...`` is what that command prints.
"""

import inspect
import re
import shlex
from pathlib import Path

import pytest

import cpslice
from cpslice import _cli

from ..support._docs import DEV, DOCS, PAGES, ROOT, blocks, page_name, printed, run_block, shown

PYTHON = [(page, i, body) for page in PAGES for i, body in enumerate(blocks(page, "python"))]
_HEAVY = re.compile(r"^\s*(?:from|import) (?:megatron|transformers)\b", re.M)
"""A block that imports megatron-core or transformers: seconds of CPU for the import alone,
so ``slow`` (``make test-fast`` runs the others)."""
README = ROOT / "README.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    heads = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_pages_have_examples() -> None:
    assert {page.name for page, _, _ in PYTHON} >= {"README.md", "recipes.md", "api-guide.md"}


@pytest.mark.parametrize(("page", "index", "source"), [
    pytest.param(page, i, body, id=f"{page_name(page)}-{i}", marks=[pytest.mark.slow] if _HEAVY.search(body) else [])
    for page, i, body in PYTHON])
def test_python_block_runs(page: Path, index: int, source: str) -> None:
    run_block(source, f"{page_name(page)} block {index}")


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_links_resolve(page: Path) -> None:
    text = page.read_text()
    assert "shared/" not in text, f"{page_name(page)} refers outside the repository"
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_relative_to(ROOT) and file.exists(), f"{page_name(page)}: {target}"
        if anchor:
            assert anchor in _anchors(file), f"{page_name(page)}: no heading for {target}"


def test_the_readme_shows_what_its_blocks_print() -> None:
    """Each README block's prints are commented with what they print (``# [4, 4, 3]: ...``),
    and print that."""
    for i, source in enumerate(blocks(README, "python")):
        want = shown(source)
        assert want == [] or printed(source, f"README.md block {i}") == want, i
        assert want or "print(" not in source, f"README.md block {i}: a print whose comment shows no value"


def test_the_value_a_print_shows_is_read_from_its_comment() -> None:
    source = ("print(a)   # [4, 4, 3]: the shares\nprint(b)  # (16, 8)\nprint(c)  # branch 2's row\n"
              "    print(d)  # [1]\nx = 1  # [2]\nprint(e)  # -0.5: a loss\n")
    assert shown(source) == ["[4, 4, 3]", "(16, 8)", "-0.5"]


def _links(page: Path, text: str) -> list[Path]:
    """The files ``text`` (of ``page``) links, resolved, in order."""
    return [(page.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(text)
            if not re.match(r"[a-z]+:", t)]


def test_the_readme_maps_every_user_page_and_the_maintainers_index() -> None:
    text = README.read_text()
    table = text[text.index("## Documentation"):]
    linked = _links(README, table)
    user = [p.resolve() for p in sorted(DOCS.glob("*.md"))]
    assert [page_name(p) for p in user if p not in linked] == [], "README.md's table misses these"
    others = [p for p in linked if p not in user and p != (ROOT / "CHANGELOG.md").resolve()]
    assert others == [(DEV / "README.md").resolve()], "the table's one link to docs/dev/ is its index"
    index = DEV / "README.md"
    listed = _links(index, index.read_text())
    missing = [page_name(p) for p in sorted(DEV.glob("*.md")) if p != index and p.resolve() not in listed]
    assert missing == [], f"docs/dev/README.md links no {missing}"


def test_the_readme_api_table_is_the_public_api() -> None:
    text = README.read_text()
    rows = re.findall(r"^\| `(\w+)[`(]", text[text.index("## The API") :], re.M)
    assert sorted(rows) == sorted(cpslice.__all__), "one row per public name, each once"


def test_the_readme_api_table_writes_every_argument_by_its_name() -> None:
    """Each argument a row of the table writes (``name`` or ``name=...``, ``...`` for the
    rest) is a parameter of that function, in the signature's order."""
    text = README.read_text()
    calls = re.findall(r"^\| `(\w+)\(([^)`]*)\)`", text[text.index("## The API") :], re.M)
    assert len(calls) > 20
    for name, written in calls:
        target = getattr(cpslice, name)
        params = list(inspect.signature(target.__init__ if inspect.isclass(target) else target).parameters)
        names = [a.split("=")[0].strip() for a in written.split(",") if a.strip() not in ("", "...")]
        assert all(n in params for n in names), (name, names, params)
        assert names == sorted(names, key=params.index), (name, "out of the signature's order")


PLANS = [body for page in PAGES for body in blocks(page, "text") if body.startswith("$ cpslice plan ")]


def test_there_are_plan_transcripts() -> None:
    assert PLANS


@pytest.mark.parametrize("transcript", PLANS, ids=range(len(PLANS)))
def test_plan_transcript_is_what_plan_prints(
    transcript: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command, _, printed = transcript.partition("\n")
    assert _cli.main([*shlex.split(command)[2:], "--color", "never"]) == 0
    assert capsys.readouterr().out == printed
