"""The package's shape, read from its source: parts import downward only, no module over 400
lines, no function over 60, no two modules with one name. docs/architecture.md draws the same
graph; this keeps the drawing true."""
from __future__ import annotations

import ast
import collections
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "inflight"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _part(module: str) -> str:
    """``inflight.bench.limit`` -> ``bench``; ``inflight.config`` -> ``config``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else pieces[0]


def _imported(module: str, path: pathlib.Path) -> set[str]:
    """Modules of the package that ``module`` imports (absolute or relative), any depth."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("inflight")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == "inflight":  # `from inflight import x`: x is the part
                found |= {f"inflight.{a.name}" for a in node.names}
            elif base.startswith("inflight"):
                found.add(base)
    return found


def part_graph() -> dict[str, set[str]]:
    """Part -> parts it imports (itself left out)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in _modules().items():
        for target in _imported(module, path):
            if _part(target) != _part(module) and _part(module) != "inflight":
                graph[_part(module)].add(_part(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_parts_import_downward_only():
    assert cycles(part_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_400_lines():
    big = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
           if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert big == {}


def test_no_function_over_60_lines():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    assert long == {}


def test_module_names_are_unique():
    seen = collections.defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen[path.stem].append(str(path.relative_to(PACKAGE.parent)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
