"""The library's shape, kept by tests where a linter cannot: the ``Layout`` class is a
record: its arguments' checks live in module functions (``_layout/checks.py``), which
raise its errors.

Sizes are not capped: ruff's complexity rule (``C901``, pyproject.toml) keeps functions
simple, and modules are split by concern, not by length."""

import ast
from pathlib import Path

import cpslice

PACKAGE = Path(cpslice.__file__).resolve().parent


def _layout_class(source: str) -> ast.ClassDef:
    tree = ast.parse(source)
    (layout,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Layout"]
    return layout


def _errors_raised(node: ast.AST) -> list[str]:
    """The exceptions a class raises itself (not through the functions it calls)."""
    return [ast.unparse(n.exc.func if isinstance(n.exc, ast.Call) else n.exc)
            for n in ast.walk(node) if isinstance(n, ast.Raise) and n.exc is not None]


def test_the_layout_class_is_a_record() -> None:
    """It raises no LayoutError itself: its checks do, in their order, from
    ``_layout/checks.py``; only immutability is its own rule."""
    layout = _layout_class((PACKAGE / "_layout" / "layout.py").read_text())
    assert _errors_raised(layout) == ["AttributeError"]


def test_the_record_rules_can_fail() -> None:
    planted = ('class Layout:\n    def f(self, n):\n        if n < 0:\n            raise LayoutError("n")\n'
               '        return n\n')
    layout = _layout_class(planted)
    assert _errors_raised(layout) == ["LayoutError"]
