"""The package's shape, as docs/architecture.md describes it: no import cycles and layers that
only import downwards. (No line cap: modules are split by responsibility, not by length.)

Imports are read with ``ast`` (function-local imports count; imports under ``if TYPE_CHECKING:``
do not, since they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "deltackpt"

# Each layer may import only itself and the layers listed for it. errors, options (the env
# knobs and option dataclasses) and cuda (what only CUDA has: pinned memory, streams) are shared
# leaves; format is pure: no store, no threads, no collectives (cuda: its fingerprints' small
# index copies to the device go through pinned memory).
LAYERS: dict[str, set[str]] = {
    "cuda": set(),  # torch only
    "format": {"errors", "cuda", "_native"},  # _native: the optional C loop of format/changes.py
    "store": {"errors", "options", "format"},
    "saving": {"errors", "options", "cuda", "format", "store"},
    "loading": {"errors", "options", "cuda", "format", "store"},
    "distributed": {"errors", "options", "cuda", "format", "store", "saving", "loading"},
    "sync": {"errors", "options", "cuda", "format"},
    "tiers": {
        "errors",
        "cuda",
        "format",
        "store",
        "loading",
        "distributed",
        "api",
        "checkpointer",
        "resume",
        "dcp",
    },
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                # a package's __init__ runs first anyway: importing a parent is not an edge
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_only_downwards(layer):
    allowed = LAYERS[layer] | {layer}
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if _layer(mod) == layer
        for dep in deps
        if _layer(dep) not in allowed
    )
    assert bad == [], f"{layer}/ may import only {sorted(allowed)}"


def test_a_cycle_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def redefined(source: str) -> list[str]:
    """Names a module body or a class body defines twice by ``def``/``class`` (the later one
    silently replaces the earlier, and every caller of the earlier gets the later: a call
    with the wrong arguments that only a rarely taken branch makes). Property setters and
    deleters (``@x.setter``) and ``@overload`` stubs are not redefinitions."""

    def plain(node: ast.AST) -> bool:
        for d in getattr(node, "decorator_list", []):
            if isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"):
                return False
            if (isinstance(d, ast.Name) and d.id == "overload") or (
                isinstance(d, ast.Attribute) and d.attr == "overload"
            ):
                return False
        return True

    out: list[str] = []
    bodies: list[tuple[str, list[ast.stmt]]] = [("", ast.parse(source).body)]
    while bodies:
        where, body = bodies.pop()
        seen: dict[str, int] = {}
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.ClassDef):
                bodies.append((f"{where}{node.name}.", node.body))
            if not plain(node):
                continue
            if node.name in seen:
                out.append(f"{where}{node.name} (lines {seen[node.name]} and {node.lineno})")
            seen[node.name] = node.lineno
    return out


def test_no_module_defines_a_function_or_class_twice():
    bad = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in sorted(PKG.rglob("*.py"))
        for name in redefined(p.read_text())
    ]
    assert bad == [], "defined twice (rename one):\n" + "\n".join(bad)


def test_a_redefinition_would_be_found():
    src = (
        "def f(): pass\n"
        "class C:\n"
        "    @property\n    def x(self): pass\n"
        "    @x.setter\n    def x(self, v): pass\n"
        "    def m(self): pass\n    def m(self, a): pass\n"
        "def f(a): pass\n"
    )
    assert redefined(src) == ["f (lines 1 and 9)", "C.m (lines 7 and 8)"]


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read the process environment (``os.environ``, ``os.getenv``,
    ``os.environb``, or those names imported from ``os``)."""
    names = {"environ", "environb", "getenv", "getenvb"}
    out: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [node.lineno for a in node.names if a.name in names]
    return sorted(out)


def test_only_options_reads_the_environment():
    """options.py reads every variable (validated, named in its errors, overridable by tests
    with ``options.overrides``): a read anywhere else would skip all three."""
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in sorted(PKG.rglob("*.py"))
        if p != PKG / "options.py"
        for line in environment_reads(p.read_text())
    ]
    assert bad == [], "read the variable through a function of deltackpt/options.py: " + str(bad)


def test_an_environment_read_would_be_found():
    src = (
        "import os\nfrom os import getenv\n"
        "a = os.environ.get('X')\nb = os.getenv('Y')\nc = 'environ'\nd = os.path.sep\n"
    )
    assert environment_reads(src) == [2, 3, 4]
