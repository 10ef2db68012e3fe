"""The documentation's pages and their code blocks, for the tests that run them.

The pages are README.md and every page under docs/ (the maintainers' in docs/dev/). A
fenced block opens with a line of three backticks and a language (```python, ```text,
```sh) and closes with three backticks.
"""

import contextlib
import io
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DEV = DOCS / "dev"
PAGES = (ROOT / "README.md", *sorted(DOCS.rglob("*.md")))

_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def page_name(page: Path) -> str:
    """``README.md`` or ``docs/recipes.md``: the page's path in the repository."""
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path, language: str) -> list[str]:
    """The bodies of the page's fenced blocks in ``language``, in order."""
    return [body for lang, body in _BLOCK.findall(page.read_text()) if lang == language]


def run_block(source: str, name: str) -> dict[str, Any]:
    """Execute one block in a fresh namespace, as a reader who copies it would; its
    namespace. ``name`` is what a traceback calls the block."""
    namespace: dict[str, Any] = {"__name__": "docs"}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def block_defining(page: str, function: str) -> dict[str, Any]:
    """The namespace of the one Python block of ``page`` (e.g. ``docs/api-guide.md``)
    that defines ``function``, executed; a test then runs the functions as written there.
    """
    found = [b for b in blocks(ROOT / page, "python") if f"def {function}(" in b]
    assert len(found) == 1, f"{page}: {len(found)} Python blocks define {function}, not one"
    return run_block(found[0], f"{page} (def {function})")


_SHOWN = re.compile(r"^print\(.*\)\s+# ([\[(\d'\"-][^:]*)(?::\s.*)?$")


def shown(source: str) -> list[str]:
    """What a block says its prints print, in order: each top-level ``print(...)`` line's
    comment up to ``: ``, where that comment starts with a value (a bracket, a digit, a
    quote or a minus), e.g. ``print(x)  # [4, 4, 3]: ...`` shows ``[4, 4, 3]``."""
    return [m.group(1).rstrip() for m in map(_SHOWN.match, source.splitlines()) if m is not None]


def printed(source: str, name: str) -> list[str]:
    """The lines a block prints when it runs (``run_block``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_block(source, name)
    return out.getvalue().splitlines()
