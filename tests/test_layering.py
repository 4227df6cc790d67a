"""The import arrows run one way (the repository's layering): no module imports, at its top or inside a function,
a module that imports it back; ``scheduler/`` imports nothing from ``dispatcher/``; ``dispatcher/plan/`` imports no
torch. Read from the source (``ast``), so an import inside a function counts as much as one at the top; imports
under ``if TYPE_CHECKING:`` are annotations only and do not count."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dispatcher", "scheduler", "models")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a ``from package import name`` counts for the submodule ``name``
    where there is one, else for the package)."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for candidate in candidates:
                while candidate and candidate not in paths:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
                    break
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
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


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50  # (the walk found the project)
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, detail


def test_the_cycle_finder_finds_a_lazy_circle():
    """The check above can fail: a circle closed by an import inside a function is one."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    from z import w\n")
    assert sorted(ast.unparse(n) for n in _runtime_imports(tree)) == ["from z import w", "import x"]


def test_scheduler_imports_nothing_from_dispatcher():
    graph = import_graph()
    wrong = {m: sorted(t for t in ts if t.startswith("dispatcher")) for m, ts in graph.items()
             if m.startswith("scheduler")}
    assert not any(wrong.values()), wrong


def test_the_plan_imports_no_torch():
    """``twogrid plan`` and ``simulate`` run where torch is not installed: dispatcher/plan/ is pure."""
    for path in (ROOT / "dispatcher" / "plan").rglob("*.py"):
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n == "torch" or n.startswith(("torch.", "triton")) for n in names), (path, names)
