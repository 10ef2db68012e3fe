"""The library's size limits, kept by a test: no module of src/cpslice over 550 lines,
no function over 80 (its docstring included), the ``Layout`` class at most 250 (its
validation lives in module functions)."""

import ast
from pathlib import Path

import cpslice

PACKAGE = Path(cpslice.__file__).resolve().parent
MODULE_LINES, FUNCTION_LINES, LAYOUT_LINES = 550, 80, 250


def _span(node: ast.AST) -> int:
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_modules_and_functions_are_small() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if text.count("\n") > MODULE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > FUNCTION_LINES:
                too_long.append(f"{name}: {node.name} is {_span(node)} lines")
    assert too_long == []


def test_the_layout_class_is_a_record() -> None:
    tree = ast.parse((PACKAGE / "_layout" / "layout.py").read_text())
    (layout,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Layout"]
    assert _span(layout) <= LAYOUT_LINES, _span(layout)
