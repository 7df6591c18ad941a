"""The shape of the package, guarded (docs/architecture.md, "Rules" and the picture).

The graph is read from the source (ast, every `import` of a zerorun module, also those inside
functions; `if TYPE_CHECKING:` blocks excluded), so a cycle or a wrong arrow fails here even
when a lazy import hides it at run time. What a package really loads is checked in a fresh
interpreter: the launcher side never loads torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "zerorun"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The module an import of `name` loads (`zerorun.launch.plan.Target` -> `zerorun.launch.plan`)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str) -> set[str]:
    """The zerorun modules `module` imports anywhere in its body (not under TYPE_CHECKING)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "zerorun")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] == "zerorun":
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else _resolve(base))
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    found.discard(module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_every_kind_of_import() -> None:
    # A lazy import inside a function, a relative import and `from package import module`.
    assert "zerorun.launch.remote" in GRAPH["zerorun.launch.job"]
    assert "zerorun.runtime.checkpoint.atomic" in GRAPH["zerorun.runtime.checkpoint.consolidate"]
    assert "zerorun.channel.events" in GRAPH["zerorun.shim"]


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "modules importing each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


# package -> packages it must never import (docs/architecture.md, Rules). The root `zerorun`
# resolves `initialize` (the runtime) lazily, so importing it counts as importing the runtime.
FORBIDDEN = {
    "zerorun.channel": {"*"},
    "zerorun.runtime": {"zerorun.launch", "zerorun.cli", "zerorun.shim"},
    "zerorun.launch": {"zerorun.runtime", "zerorun.compat", "zerorun.cli", "zerorun.shim", "zerorun"},
    "zerorun.config": {"zerorun.runtime", "zerorun.launch", "zerorun.cli", "zerorun.compat", "zerorun.channel"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_arrows_between_packages(package: str) -> None:
    wrong = []
    for module, deps in GRAPH.items():
        if _package(module) != package:
            continue
        for dep in sorted(deps):
            target = _package(dep)
            if target == package:
                continue
            if "*" in FORBIDDEN[package] or target in FORBIDDEN[package]:
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "\n".join(wrong)


def test_launcher_side_never_loads_torch() -> None:
    """Every module of launch/, channel/, config/ and cli/ imported in one fresh interpreter."""
    names = sorted(
        m for m in MODULES
        if _package(m) in ("zerorun.launch", "zerorun.channel", "zerorun.config", "zerorun.cli")
        or m in ("zerorun", "zerorun.estimate", "zerorun.errors", "zerorun.sizes", "zerorun._version")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} loaded torch'\n"
        "print(len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
