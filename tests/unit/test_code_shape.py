"""The code's shape, measured from its own imports and line counts: no import cycle among the modules of common/,
worker/ and router/, nothing in common/ importing worker/ or router/, and no Python file over 600 lines outside
tests/ but the few listed in ``OVER_LIMIT`` (which may only shrink).

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` (a cycle there is still a loop
a reader follows). ``from a.b import c`` is an import of the module ``a.b.c`` when there is one, else of ``a.b``;
relative imports are resolved against the importing module's package. Nothing is imported: each module is parsed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "worker", "router")
MAX_LINES = 600

# Files still over MAX_LINES, with their line counts when listed: other work splits them. A listed file may not
# grow, and leaves the list once it is split (the test fails until it is removed, so the list only shrinks).
OVER_LIMIT: dict[str, int] = {}

# Folders whose Python files are not counted: the tests, build outputs and environments.
_SKIPPED_DIRS = {"tests", "build", "dist", "site", "node_modules", "__pycache__"}


def _modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, for its ``__init__.py``)."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """``name``, or its longest prefix, that is one of ``mods``; None for other libraries' modules."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports, anywhere in its source."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(t for a in node.names if (t := _known(a.name, mods)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    target = full if full in mods else _known(base, mods)
                    if target:
                        targets.add(target)
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    arrows = [f"    {m} -> {t}" for m in component for t in sorted(graph[m] & members)]
    return "  " + ", ".join(component) + "\n" + "\n".join(arrows)


def test_cycle_finder_finds_a_loop_and_only_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_packages_is_in_an_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (every import counts, TYPE_CHECKING ones too):\n" + "\n".join(
        _describe(c, graph) for c in found
    )


def test_common_imports_nothing_of_worker_or_router():
    graph = import_graph()
    up = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == "common"
        for t in targets
        if t.split(".")[0] in ("worker", "router")
    )
    assert not up, "common/ holds messages and stats only; these imports point back up:\n" + "\n".join(up)


def _line_counts() -> dict[str, int]:
    """Lines of every Python file outside tests/ (and outside build outputs and hidden folders such as .venv)."""
    counts = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in _SKIPPED_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        with path.open("rb") as f:
            counts[rel.as_posix()] = sum(1 for _ in f)
    return counts


def test_no_python_file_outside_tests_is_over_600_lines_but_the_listed_ones():
    counts = _line_counts()
    problems = []
    for rel, n in sorted(counts.items()):
        if n > MAX_LINES and rel not in OVER_LIMIT:
            problems.append(f"{rel}: {n} lines (over {MAX_LINES}; split it)")
    for rel, listed in sorted(OVER_LIMIT.items()):
        n = counts.get(rel)
        if n is None:
            problems.append(f"{rel}: listed in OVER_LIMIT but gone (remove it from the list)")
        elif n <= MAX_LINES:
            problems.append(f"{rel}: {n} lines now, within {MAX_LINES} (remove it from OVER_LIMIT)")
        elif n > listed:
            problems.append(f"{rel}: {n} lines, grew from the {listed} it is listed with (it may only shrink)")
    assert not problems, "\n".join(problems)
