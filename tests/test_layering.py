"""The import arrows of docs/architecture.md section 1, read from the source (no imports run):
server -> engine.protocol and memory_store.client/errors; engine -> memory_store.client/errors;
nothing imports server/; server/ never imports torch, transformers or faiss; and no circle of
run-time imports between the repository's own files."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "faiss")
STORE_API = ("memory_store.client", "memory_store.errors")


def imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, `from x import y` giving x.y and x."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sources(part: str) -> list[Path]:
    return sorted((ROOT / part).rglob("*.py"))


def offending(part: str, bad) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(part)
        for line, module in imports(path)
        if bad(path, module)
    ]


def test_nothing_outside_server_imports_server():
    for part in ("engine", "memory_store", "bench"):
        assert offending(part, lambda _p, m: under(m, "server")) == []


def test_server_imports_no_torch_and_only_the_engine_contract():
    def bad(path: Path, module: str) -> bool:
        if any(under(module, heavy) for heavy in HEAVY):
            return True
        return under(module, "engine") and not under(module, "engine.protocol")

    # The CLI starts the engine, importing it lazily inside the serve command.
    cli = ROOT / "server" / "cli.py"
    lazy = {line for line, _ in imports(cli)} - {line for line, _ in imports(cli, True)}
    problems = offending("server", bad)
    assert [p for p in problems if not p.startswith("server/cli.py:") or _line(p) not in lazy] == []


def _line(problem: str) -> int:
    return int(problem.split(":")[1].split()[0])


@pytest.mark.parametrize("part", ["server", "engine"])
def test_server_and_engine_reach_the_memory_store_through_its_client_only(part):
    def bad(_path: Path, module: str) -> bool:
        if not under(module, "memory_store") or module == "memory_store":
            return False
        return not any(under(module, api) for api in STORE_API)

    assert offending(part, bad) == []


def test_memory_store_imports_neither_engine_nor_server():
    assert offending("memory_store", lambda _p, m: under(m, "engine") or under(m, "server")) == []


OWN = ("engine", "server", "memory_store")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> list[list[str]]:
    """Every import that runs (at the top or inside a function; `if TYPE_CHECKING:` blocks
    aside), each as the modules it may name: `from x import y` gives [x.y, x], the first
    that is a file of ours being the one imported."""
    found: list[list[str]] = []
    stack = [tree]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, ast.If) and _type_checking(child):
                stack += child.orelse
                continue
            if isinstance(child, ast.Import):
                found += [[alias.name] for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found += [[f"{child.module}.{alias.name}", child.module] for alias in child.names]
            stack.append(child)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports at run time, each resolved to its file."""
    files = {module_name(path): path for part in OWN for path in sources(part)}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for candidates in runtime_imports(ast.parse(path.read_text(), str(path))):
            target = next((c for c in candidates if c in files), None) or resolve(candidates[-1])
            if target is not None and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) through each strongly connected group of modules."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                found.append(_circle(graph, set(group), node))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def _circle(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside `group`."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    nxt.append(target)
        frontier = nxt
    return [start]


def test_the_cycle_finder_names_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_runtime_import_circle_between_files():
    graph = import_graph()
    assert "engine.sessions.frame_backend" in graph  # the graph reads the tree
    assert [" -> ".join(circle) for circle in cycles(graph)] == []
