"""The direction of imports between our top-level packages (README "Layout"), read from the
source with `ast`: every `import` and `from ... import`, at module level and inside functions.

    store            imports nothing of ours
    core             the kernel the apps share: imports nothing of ours
    runners, trainer import store and core, never each other (not even through a third package)
    lightning_site   the wiring: settings, URLs, ASGI, views, /metrics; may import any of them
    examples, bench  users of the packages above; nothing of ours imports them

No cycle between packages, and no import of another package of ours inside a function: such an
import only hides a cycle, which the graph must not have.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("store", "core", "runners", "trainer", "lightning_site", "examples", "bench")
# Where the product lives (examples and bench are scripts that use it): a function-local
# import of another of our packages is refused here.
PRODUCT = ("store", "core", "runners", "trainer", "lightning_site")
OURS = (*PACKAGES, "tests")


@dataclass(frozen=True)
class Edge:
    source: str  # the file, relative to the repository root
    line: int
    target: str  # the imported module's dotted name
    function: str | None  # the enclosing function, None at module (or class) level

    @property
    def where(self) -> str:
        inside = f" (in {self.function})" if self.function else ""
        return f"{self.source}:{self.line} imports {self.target}{inside}"


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not node.level:
        return [node.module or ""]
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return [".".join([*base, *([node.module] if node.module else [])])]


def _imports(path: Path) -> list[Edge]:
    module, is_package = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: list[Edge] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, getattr(child, "name", "<lambda>"))
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                source = str(path.relative_to(ROOT))
                edges.extend(Edge(source, child.lineno, target, function)
                             for target in _targets(child, module, is_package))
            visit(child, function)

    visit(tree, None)
    return edges


def _all_edges() -> dict[tuple[str, str], list[Edge]]:
    """(importing package, imported package) -> the imports that make the arrow."""
    graph: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for edge in _imports(path):
                target = edge.target.split(".")[0]
                if target in OURS and target != package:
                    graph[(package, target)].append(edge)
    return graph


GRAPH = _all_edges()


def _explain(pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}: {e.where}" for a, b in pairs for e in GRAPH[(a, b)])


def _reachable(start: str) -> dict[str, list[tuple[str, str]]]:
    """Every package `start` reaches, with the path of arrows that reaches it."""
    paths: dict[str, list[tuple[str, str]]] = {start: []}
    frontier = [start]
    while frontier:
        here = frontier.pop()
        for a, b in sorted(GRAPH):
            if a == here and b not in paths:
                paths[b] = [*paths[here], (a, b)]
                frontier.append(b)
    return paths


def test_the_walk_sees_the_packages_and_their_arrows():
    # A guard for the walk itself: a broken walk would find no arrow and pass every rule.
    assert {p for p in PACKAGES if (ROOT / p / "__init__.py").is_file()} == set(PACKAGES)
    assert ("runners", "store") in GRAPH and ("trainer", "store") in GRAPH
    assert any(e.function for edges in GRAPH.values() for e in edges), "function-level imports"


def test_no_cycle_between_top_level_packages():
    cycles = []
    for package in PACKAGES:
        for target, path in _reachable(package).items():
            back = _reachable(target).get(package)
            if target != package and back is not None and package < target:
                cycles.append((package, target, path + back))
    assert not cycles, "cycles between packages:\n" + "\n".join(
        f"{a} <-> {b}:\n{_explain(path)}" for a, b, path in cycles)


def test_store_imports_no_package_of_ours():
    arrows = [(a, b) for a, b in GRAPH if a == "store"]
    assert not arrows, "the store imports nothing of ours:\n" + _explain(arrows)


def test_the_kernel_imports_no_app_and_no_wiring():
    arrows = [(a, b) for a, b in GRAPH if a == "core"]
    assert not arrows, "core imports nothing of ours:\n" + _explain(arrows)


def test_runners_and_trainer_never_import_each_other_even_through_another_package():
    for a, b in (("runners", "trainer"), ("trainer", "runners")):
        path = _reachable(a).get(b)
        assert path is None, f"{a} reaches {b}:\n" + _explain(path)


def test_nothing_of_ours_imports_examples_or_bench():
    arrows = [(a, b) for a, b in GRAPH if b in ("examples", "bench") and a in PRODUCT]
    assert not arrows, "examples and bench use the product, never the reverse:\n" + _explain(
        arrows)


def test_no_function_local_import_of_another_package():
    local = [e for (a, _), edges in GRAPH.items() if a in PRODUCT for e in edges if e.function]
    assert not local, ("imports of another package of ours inside a function (move them to the "
                       "top; a cycle they would make is the thing to fix):\n"
                       + "\n".join(f"  {e.where}" for e in local))
