"""The package's import graph, read from the source (every import statement, function-level ones too):
the communication core never imports the model layer or the tools, and no import cycle exists."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moe_ep"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the moe_ep modules it imports (a `from pkg import name` counts as pkg.name where that
    is a module, else as pkg)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == "moe_ep")
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve(module, path.name == "__init__.py", node.level, node.module) if node.level
                        else node.module or "")
                if base.split(".")[0] != "moe_ep":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in files else base)
        graph[module] = {e for e in edges if e in files and e != module}
    return graph


def _ancestors(module: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_comm_never_imports_the_layer_or_the_tools() -> None:
    graph = import_graph()
    bad = sorted((m, e) for m, edges in graph.items() if m.startswith("moe_ep.comm")
                 for e in edges if not e.startswith("moe_ep.comm"))
    assert not bad, f"moe_ep.comm imports outside itself: {bad}"
    assert any(e.startswith("moe_ep.comm") for e in graph["moe_ep.moe.layer"]), "the graph reader found no edges"


def test_no_import_cycle() -> None:
    graph = import_graph()
    # A package's __init__ runs before its submodules, so importing a.b also imports a: count that edge.
    full = {m: edges | {a for a in _ancestors(m) if a in graph} for m, edges in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for e in sorted(full[m]):
            if e in _ancestors(m):
                continue  # a package's own __init__ is not a cycle through its submodule
            if state.get(e) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(e):] + [e]))
            if e not in state:
                visit(e)
        stack.pop()
        state[m] = 2

    for m in sorted(full):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("edge", [("moe_ep.comm.buffer", "moe_ep.moe.layer"), ("moe_ep.moe.overlap", "moe_ep.moe.layer")])
def test_the_checks_catch_a_bad_edge(edge: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The two checks fail on an edge that breaks the rule (comm -> moe, or overlap <-> layer)."""
    graph = import_graph()
    graph[edge[0]].add(edge[1])
    monkeypatch.setattr(__import__(__name__, fromlist=["import_graph"]), "import_graph", lambda: graph)
    check = test_comm_never_imports_the_layer_or_the_tools if ".comm." in edge[0] else test_no_import_cycle
    with pytest.raises(AssertionError):
        check()


@pytest.mark.parametrize("script", sorted(p.name for p in (PACKAGE.parent / "bench").glob("*.py")))
def test_bench_scripts_import(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bench/ script still imports what it names from the package (a renamed helper broke
    bench/layer_roofline.py once, unnoticed until a GPU run)."""
    import importlib

    monkeypatch.syspath_prepend(str(PACKAGE.parent / "bench"))
    importlib.import_module(script[:-3])


def _moe_ep_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every `from moe_ep... import names` in a file, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "moe_ep":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def test_every_moe_ep_import_in_the_tests_resolves() -> None:
    """GPU tests import moe_ep names inside their workers, where a CPU run never goes: a name that moved
    (CommTimeoutError from backends.symmetric, 2026-12-04) broke a GPU file that every CPU test passed.
    Every such import in tests/ and bench/ must name a module and an attribute that exist."""
    import importlib

    roots = [PACKAGE.parent / "tests", PACKAGE.parent / "bench"]
    bad = []
    for path in sorted(p for root in roots for p in root.glob("*.py")):
        for line, module, names in _moe_ep_imports(path):
            try:
                mod = importlib.import_module(module)
            except ImportError as error:
                bad.append(f"{path.name}:{line}: {module}: {error}")
                continue
            for name in names:
                if name != "*" and not hasattr(mod, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        bad.append(f"{path.name}:{line}: {module} has no {name}")
    assert not bad, "\n".join(bad)
