"""The import arrows of ARCHITECTURE.md section 1, read from the source (no imports run):
server -> engine.protocol and memory_store.client/errors; engine -> memory_store.client/errors;
nothing imports server/; server/ never imports torch, transformers or faiss."""

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
