"""Layers point one way: no import cycles between airquant's top-level parts, none among the sub-packages
and modules inside any package, no underscore names imported across modules. Read from the source with
``ast`` (every import counts, also inside functions), as ``import_map.py`` reads it: a part is
``airquant.<first component>``, a sub-package or a module."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import airquant

PACKAGE = Path(airquant.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _type_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (bare or ``typing.``): imports only a type checker runs."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    name = getattr(test, "id", None) or getattr(test, "attr", None)
    return isinstance(test, (ast.Name, ast.Attribute)) and name == "TYPE_CHECKING"


def _nodes(tree: ast.AST, runtime: bool):
    """``ast.walk``; with ``runtime``, the bodies of ``if TYPE_CHECKING:`` left out (their ``else`` kept)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if runtime and _type_only(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(path: Path, runtime: bool = False) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in the file, relative ones made absolute
    (``runtime``: those a type checker alone reads left out)."""
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out: list[tuple[str, str | None]] = []
    for node in _nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), runtime):
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


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _target(module: str, name: str | None, known: dict[str, Path]) -> str | None:
    """The airquant module an import reaches: ``from pkg import mod`` is ``pkg.mod``; ``from mod import x``
    (or ``import mod.x`` of a name that is no module) the longest known prefix."""
    if name and f"{module}.{name}" in known:
        return f"{module}.{name}"
    bits = module.split(".")
    while bits and ".".join(bits) not in known:
        bits.pop()
    return ".".join(bits) or None


def _inner_edges() -> dict[str, dict[str, set[str]]]:
    """package -> (child -> children it imports): a child is a sub-package or a module directly inside,
    an import from ``a.b.x`` into ``a.c.y`` is an edge b -> c inside ``a``. A module importing its own
    ancestor or descendant package is no edge (a package's ``__init__`` lists its children)."""
    known = _modules()
    inner: dict[str, dict[str, set[str]]] = {}
    for me, path in known.items():
        for module, name in _imports(path, runtime=True):
            dst = _target(module, name, known) if module.split(".")[0] == PACKAGE.name else None
            if dst is None:
                continue
            a, b = me.split("."), dst.split(".")
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if i < len(a) and i < len(b):
                inner.setdefault(".".join(a[:i]), {}).setdefault(a[i], set()).add(b[i])
    return inner


# Cycles still to break, each with the reason it is here; the test below fails once one is gone, so the list
# only shrinks. Empty: pipeline.full <-> runner was the last (their dataclasses moved to pipeline/config.py).
KNOWN_INNER_CYCLES: set = set()


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



def test_inner_scan_reads_packages_and_from_imports():
    inner = _inner_edges()
    assert "decode" in inner["airquant.engine"]["runner"], "engine.runner's import of engine.decode was not seen"
    assert "kernels" in inner["airquant.quant"]["int2"], "from airquant.quant.kernels import ... was not seen"


def test_no_import_cycles_inside_packages():
    found = {(package, cycle) for package, edges in _inner_edges().items() for cycle in _cycles(edges)}
    new = sorted(f"{package}: {' <-> '.join(sorted(c))}" for package, c in found - KNOWN_INNER_CYCLES)
    assert not new, ("import cycles between the sub-packages/modules of one package (move what both need into a "
                     f"module below them, or take a callable): {new}")
    gone = KNOWN_INNER_CYCLES - found
    assert not gone, f"these cycles are broken now: remove them from KNOWN_INNER_CYCLES: {gone}"


def test_ruff_is_configured_and_run_by_make_test():
    """Lint and import order (issue 39): ``[tool.ruff]`` in pyproject, the pin in requirements-dev.txt, and
    ``make test`` runs ``ruff check`` before pytest."""
    root = PACKAGE.parent
    ruff = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert {"F", "I"} <= set(ruff["lint"]["select"])
    assert re.search(r"^ruff==\S+$", (root / "requirements-dev.txt").read_text(), re.M)
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", (root / "Makefile").read_text(), re.M).group(1)
    assert "ruff check" in recipe and recipe.index("ruff check") < recipe.index("pytest"), recipe


def _architecture_tree() -> set[str]:
    """The module paths (relative to airquant/) of docs/ARCHITECTURE.md's tree: the ```text block under
    "## Module tree", two spaces a level, folders ending in "/"."""
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = doc.split("## Module tree", 1)[1].split("```text\n", 1)[1].split("\n```", 1)[0]
    folders: list[str] = []
    found: set[str] = set()
    for line in block.splitlines()[1:]:  # the first line is airquant/ itself
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            found.add("/".join([*folders, name]))
    return found


def test_architecture_tree_lists_every_module():
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    tree = _architecture_tree()
    assert not modules - tree, f"modules missing from docs/ARCHITECTURE.md's tree: {sorted(modules - tree)}"
    assert not tree - modules, f"docs/ARCHITECTURE.md's tree lists modules that are gone: {sorted(tree - modules)}"


def test_architecture_tables_scan():
    """No table cell of docs/ARCHITECTURE.md over 300 characters: a longer one belongs in the tree or a list."""
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    cells = [c.strip() for line in doc.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    long = [c[:60] for c in cells if len(c) > 300]
    assert not long, f"table cells over 300 characters: {long}"


# -- issue 39 items 4 and 5: one name per function, one definition per unit, one declaration per setting --------
def _top_level_functions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(_module_name(path))
    return found


def test_no_two_public_functions_share_a_name():
    """``from x import plan_for`` must say which one: a public function's name is unique in the package
    (underscore helpers are their module's business)."""
    twice = {name: where for name, where in _top_level_functions().items() if len(where) > 1}
    assert not twice, f"public functions defined in more than one module (rename one): {twice}"


_UNIT_NAMES = {"GB", "GIB", "GIB_BYTES", "GB_BYTES"}


def _constant_value(node: ast.AST):
    """The value of an expression made only of numbers and arithmetic (``1 << 30``, ``1e9``), else None."""
    if not all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
               for n in ast.walk(node)):
        return None
    try:
        return eval(compile(ast.Expression(node), "<unit>", "eval"), {"__builtins__": {}})  # numbers only
    except Exception:  # not a plain number (e.g. a string constant)
        return None


def test_byte_units_are_defined_once():
    """GB (10^9, reports) and GiB (2^30, every memory setting) are named once, in ``airquant/units.py``: no
    other module binds a unit's name (``GB = 1e9``, ``gb = 1e9``, ``GIB = 1 << 30``) or the number 10^9.
    (A budget of 2^30 bytes, such as ``expert_compute.GROUPED_BYTES``, is a size, not a unit.)"""
    units = PACKAGE / "units.py"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None or path == units:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id.upper() for t in targets if isinstance(t, ast.Name)}
            value = _constant_value(node.value)
            if names & _UNIT_NAMES or (value == 10**9 and not isinstance(value, bool)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"a byte unit defined outside airquant/units.py (import GB or GIB from it): {found}"
    from airquant.units import GB, GIB

    assert (GB, GIB) == (10**9, 2**30)


def _engine_parser():
    import argparse

    from airquant.cli.flags import add_engine_flags, add_route_flags

    parser = argparse.ArgumentParser()
    add_route_flags(parser)
    add_engine_flags(parser)
    return parser


def test_every_engine_flag_comes_from_engine_config():
    """The parser's defaults are EngineConfig's, every field with a flag has it, and ``cli/flags.py`` spells
    no engine flag out by hand (``add_argument("--max-vram", ...)``): each setting is declared once. (Other
    commands' flags of the same name, ``shard --dtype`` or ``pipeline --profile``, are their own settings;
    argparse refuses a second ``--dtype`` in a parser that has the engine's.)"""
    from dataclasses import fields

    from airquant.cli import build_parser
    from airquant.cli.flags import engine_config
    from airquant.config import EngineConfig

    flagged = {f.metadata["cli"]["flag"]: f.name for f in fields(EngineConfig) if f.metadata["cli"]}
    parser = _engine_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    assert set(flagged) <= options, f"fields whose flag is missing: {set(flagged) - options}"
    assert engine_config(parser.parse_args([])) == EngineConfig()
    args = build_parser().parse_args(["plan", "store"])
    assert engine_config(args) == EngineConfig()
    by_hand = []
    for path in [PACKAGE / "cli" / "flags.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in flagged):
                by_hand.append(f"{path.name}:{node.lineno} {node.args[0].value}")
    assert not by_hand, f"engine flags added by hand (declare them in EngineConfig's metadata): {by_hand}"


def test_flags_set_the_fields_they_name():
    """Each flag, given, reaches its own field: ``--max-vram 6`` is ``max_vram_gb=6.0`` (GiB) and so on."""
    from airquant.cli.flags import engine_config

    argv = ["--device", "cpu", "--dtype", "float32", "--resident", "--max-vram", "6", "--max-ram", "7",
            "--resident-layers", "3", "--host-embedding", "--reserve", "1.5", "--no-kv-offload", "--readahead", "4",
            "--profile", "--verify", "--experts", "routed", "--expert-cache", "0.5", "--expert-policy", "lru",
            "--no-expert-prefetch", "--no-verify-reads", "--context", "512"]
    cfg = engine_config(_engine_parser().parse_args(argv))
    assert (cfg.device, cfg.dtype, cfg.resident, cfg.max_vram_gb, cfg.max_ram_gb, cfg.resident_layers) == \
        ("cpu", "float32", True, 6.0, 7.0, 3)
    assert (cfg.host_embedding, cfg.reserve_gb, cfg.kv_offload, cfg.readahead, cfg.profile, cfg.verify) == \
        (True, 1.5, False, 4, True, True)
    assert (cfg.experts, cfg.expert_cache_gb, cfg.expert_policy, cfg.expert_prefetch, cfg.verify_reads,
            cfg.context) == ("routed", 0.5, "lru", False, False, 512)
