"""The floors hold: no import cycle between kvscope's packages or between its modules
(docs/ARCHITECTURE.md), imports made for the type checker only (`if TYPE_CHECKING:`) included.
Read from the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.sources import parsed

ROOT = Path(__file__).resolve().parent.parent
# Each source folder and the package it installs as (pyproject's package-dir).
FOLDERS = {
    "kvscope": "kvscope",
    "allocator": "kvscope.allocator",
    "kernels": "kvscope.kernels",
    "probes": "kvscope.probes",
    "tui": "kvscope.tui",
}
PACKAGES = tuple(p for p in FOLDERS.values() if p != "kvscope")
# Modules compiled from C (setup.py), which import nothing of kvscope.
EXTENSIONS = {
    "kvscope.allocator._native": "allocator/_native.c",
    "kvscope._sigbus": "kvscope/csrc/sigbus.c",
    "kvscope._kvevents": "kvscope/csrc/kvevents.c",
}


def source_modules() -> dict[str, Path]:
    """Every module of the installed package and its source file."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join([package, *(p for p in parts if p != "__init__")])] = path
    for module, source in EXTENSIONS.items():
        out[module] = ROOT / source
    return out


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvscope modules `name` imports, at import time, inside a function or for the type
    checker (`if TYPE_CHECKING:`: a cycle of those is a cycle of the design all the same)."""
    if name in EXTENSIONS:
        return set()
    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name if is_package else name.rsplit(".", 1)[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rsplit(".", 1)[0]
                    base = f"{pkg}.{base}" if base else pkg
                for a in child.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            visit(child)

    visit(parsed(path))
    out = set()
    for target in found:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            out.add(target)
    return out


def package_of(module: str) -> str:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), "kvscope")


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """Each module and the kvscope modules it imports (made once: the tests only read it)."""
    modules = source_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_walker_sees_a_cycle():
    # GIVEN a graph with a loop a -> b -> c -> a beside an edge out of it
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    # WHEN its cycles are searched THEN the loop is found and nothing else
    assert cycles(graph) == [{"a", "b", "c"}]


def test_walker_reads_real_imports():
    # GIVEN the source tree WHEN the harness's imports are read
    graph = module_graph()
    # THEN known edges are there: a verb imports the analysis, the TUI the dump reader, the
    # pool's probes the handle's Protocol (for the type checker only), native.py the C core
    assert "kvscope.analysis" in graph["kvscope.verbs.analyze"]
    assert "kvscope.allocator.dumpread" in graph["kvscope.tui.source"]
    assert "kvscope.allocator.handle" in graph["kvscope.allocator.probing"]
    assert "kvscope.allocator._native" in graph["kvscope.allocator.native"]


def test_no_cycle_between_packages():
    # GIVEN every import between kvscope's packages (harness, allocator, kernels, probes, tui)
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b:
                graph.setdefault(a, set()).add(b)
    # WHEN cycles are searched THEN there is none: each floor imports only floors below it
    assert cycles(graph) == []
    assert "kvscope" not in graph.get("kvscope.tui", set()), "the TUI needs nothing of the harness"
    assert graph.get("kvscope.allocator", set()) <= {"kvscope.kernels"}


def test_no_cycle_between_modules():
    # GIVEN every import between kvscope's modules, those inside functions and for the type
    # checker too
    found = cycles(module_graph())
    # WHEN cycles are searched THEN there is none
    assert found == []


# Private names of the standard library, torch and Triton the sources use (each the documented
# or the only way to do what it does there); any other `x._name` with x not self, cls or super()
# reaches into another module's or class's private members.
FOREIGN_PRIVATE = {
    "_getframe",  # sys: the caller's frame, for sites
    "_current_frames",  # sys: a lock holder's stack
    "_exit",  # os: a process that must not run atexit handlers
    "_asdict",  # a namedtuple's documented method
    "_C",  # torch._C: the current CUDA stream's raw handle
    "_cuda_getCurrentRawStream",
    "_share_cuda_",  # torch: a CUDA storage's IPC handle
    "_new_shared_cuda",
    "_init_handles",  # Triton: load a compiled kernel before a graph capture
}


def private_reach_ins(path: Path, modules: frozenset[str] = frozenset()) -> list[str]:
    """`obj._name` in one source file, obj not self, cls or super(), the name not foreign; and
    `from kvscope... import _name` of a name that is not a module (`modules`)."""
    out = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvscope"):
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and f"{node.module}.{a.name}" not in modules:
                    out.append(f"{where}:{node.lineno} import {a.name}")
            continue
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in FOREIGN_PRIVATE:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", "") == "super":
            continue
        out.append(f"{where}:{node.lineno} .{node.attr}")
    return out


def test_walker_sees_a_reach_in(tmp_path):
    # GIVEN a module that reads another object's private member beside its own
    src = tmp_path / "m.py"
    src.write_text(
        "from kvscope.a import _m, _v\n"
        "class A:\n    def f(self, b):\n        return self._x + b._y + super()._z\n"
    )
    # WHEN its reach-ins are read, kvscope.a._m being a module THEN b._y and _v are
    got = private_reach_ins(src, frozenset({"kvscope.a._m"}))
    assert sorted(r.split(" ")[-1] for r in got) == ["._y", "_v"]


def test_no_module_reaches_into_private_members():
    # GIVEN every source module of the installed package
    modules = source_modules()
    names = frozenset(modules)
    found = [r for p in modules.values() if p.suffix == ".py" for r in private_reach_ins(p, names)]
    # THEN none reads or writes a private member of another object than its own, nor imports a
    # private name of another module (a compiled module, `_native`, is a module)
    assert found == []
