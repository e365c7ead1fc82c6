"""No library function branches more than a reader can hold: cyclomatic complexity at most 20 everywhere.

Counted as radon counts it (McCabe's decision points): an ``if``, a conditional expression, an ``assert``, each loop
(and its ``else``), each ``except`` (and a ``try``'s ``else``), each extra operand of ``and``/``or``, each ``case`` but
a bare ``_``, each comprehension and its ``if``s. A nested function counts on its own, not in its parent.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("core", "heads", "data_recipes", "train", "eval", "decoding", "export", "scripts")
LIMIT = 20


def decision_points(node: ast.AST) -> int:
    """What ``node`` itself adds to its function's complexity."""
    if isinstance(node, ast.If | ast.IfExp | ast.Assert):
        return 1
    if isinstance(node, ast.For | ast.AsyncFor | ast.While):
        return 1 + bool(node.orelse)
    if isinstance(node, ast.Try):
        return len(node.handlers) + bool(node.orelse)
    if isinstance(node, ast.BoolOp):
        return len(node.values) - 1
    if isinstance(node, ast.comprehension):
        return 1 + len(node.ifs)
    if isinstance(node, ast.Match):
        wildcard = any(isinstance(case.pattern, ast.MatchAs) and case.pattern.pattern is None for case in node.cases)
        return max(0, len(node.cases) - wildcard)
    return 0


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """1 + the decision points of the function's own body (nested functions and classes left to themselves)."""
    total, pending = 1, list(function.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        total += decision_points(node)
        pending.extend(ast.iter_child_nodes(node))
    return total


def functions(path: Path) -> Iterator[tuple[str, int]]:
    """``(qualified name, complexity)`` for every function and method defined in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{path.relative_to(REPO)}:{node.lineno} {node.name}", complexity(node)


def test_the_counter_counts_each_kind_of_branch() -> None:
    source = """
def f(x, ys):
    assert x
    if x and ys or not x:
        pass
    elif x > 1:
        pass
    for y in ys:
        pass
    else:
        pass
    try:
        pass
    except ValueError:
        pass
    except KeyError:
        pass
    z = [y for y in ys if y if not y]
    w = 1 if x else 2
    match x:
        case 1:
            pass
        case _:
            pass
    def inner():
        if x:
            pass
"""
    outer, inner = (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef))
    # 1 + assert + if + (and, or) + elif + for + else + 2 excepts + comprehension + its 2 ifs + IfExp + 1 case
    assert complexity(outer) == 1 + 1 + 1 + 2 + 1 + 2 + 2 + 3 + 1 + 1
    assert complexity(inner) == 2


@pytest.mark.parametrize("folder", LIBRARY)
def test_no_library_function_is_more_complex_than_the_limit(folder: str) -> None:
    paths = sorted((REPO / folder).rglob("*.py"))
    assert paths, f"{folder}/ holds no Python files"
    tangled = [f"{name}: {value}" for path in paths for name, value in functions(path) if value > LIMIT]
    assert not tangled, f"cyclomatic complexity over {LIMIT} (split the function):\n" + "\n".join(tangled)
