"""Layers point one way: no import cycles between airquant's top-level parts, no underscore names
imported across modules. Read from the source with ``ast`` (every import counts, also inside functions),
as ``import_map.py`` reads it: a part is ``airquant.<first component>``, a sub-package or a module."""

from __future__ import annotations

import ast
from pathlib import Path

import airquant

PACKAGE = Path(airquant.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in the file, relative ones made absolute."""
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package[: len(package) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return out


def _part(module: str) -> str | None:
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[0] == PACKAGE.name else None


def _scan() -> tuple[dict[str, set[str]], list[str]]:
    """(part -> parts it imports, "x imports y._name" for every private cross-module import)."""
    edges: dict[str, set[str]] = {}
    private: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        src = _part(me) or "__init__"
        for module, name in _imports(path):
            dst = _part(module)
            if dst and dst != src:
                edges.setdefault(src, set()).add(dst)
            if (name and name.startswith("_") and not name.startswith("__")
                    and module.split(".")[0] == PACKAGE.name and module != me):
                private.append(f"{me} imports {module}.{name}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_package():
    edges, _ = _scan()
    assert "engine" in edges and "store" in edges["engine"], "the scan found no engine -> store import"


def test_cycle_finder_on_a_table():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_parts():
    cycles = _cycles(_scan()[0])
    assert not cycles, ("import cycles between airquant's parts (a lower layer should take a callable, not import "
                        f"a higher one): {[' <-> '.join(sorted(c)) for c in cycles]}")


def test_no_private_imports_across_modules():
    private = _scan()[1]
    assert not private, f"underscore names imported from another module (make them public or move them): {private}"

