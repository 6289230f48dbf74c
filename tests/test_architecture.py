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



# -- issue 39 item 8: imports at the top of the file unless lazy for a measured reason --------------------------
# The dependencies a function may import on first use, each with why (figures: a fresh interpreter on the 2-core
# CPU box, ``python -X importtime``; "after torch" is the cost once torch is loaded, as it is by every airquant
# command). An airquant module that imports one of these at its top may itself be imported lazily by a module
# that does not already load it; any other function-level import needs a ``# lazy: <reason>`` comment on its line.
LAZY_MODULES = {
    "transformers": "0.66 s after torch (cache_utils 0.9 s, modeling_utils 3.5 s); airquant --help, the store, "
                    "quant, layout, models and kv packages import without it",
    "triton": "0.11 s; runs only on a CUDA GPU, and a CPU install may lack it",
    "gguf": "0.17 s (0.05 s after torch); airquant.models is on airquant --help's path",
    "huggingface_hub": "huggingface_hub.errors 81 ms (31 ms after torch), snapshot_download more; only downloads",
    "accelerate": "81 ms after torch; only meta_model needs it, layout is on airquant --help's path",
    "bitsandbytes": "optional (extra 'quant'); 4.6 s",
    "gradio": "optional (extra 'ui'); 3.8 s",
    "fastapi": "optional (extra 'serve'); 0.36 s",
    "datasets": "optional (not a dependency); hub datasets only",
    "matplotlib": "optional (extra 'eval'); 0.24 s, matplotlib.figure 0.56 s",
    "rouge_score": "optional (extra 'eval')",
    "papermill": "optional (extra 'eval'); 0.72 s",
    "nbclient": "optional (extra 'eval'); nbclient.exceptions 0.24 s",
    "jupyter_client": "optional (extra 'eval'); kernelspec 0.19 s, manager 0.15 s",
    "ray": "optional (not a dependency); 0.46 s",
    "pyarrow": "comes with ray; 0.16 s",
    "turboquant": "optional (KV backend 'turboquant'); 2.6 s",
}

_LAZY_MARK = re.compile(r"#\s*lazy:\s*\S")


def _top_imports(path: Path) -> list[tuple[str, str | None]]:
    """The imports a module runs when it is imported: outside functions and ``if TYPE_CHECKING:``."""
    out = []
    todo = list(ast.iter_child_nodes(ast.parse(path.read_text(encoding="utf-8"))))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += _resolved(node, path)
        todo.extend(node.orelse if _type_only(node) else ast.iter_child_nodes(node))
    return out


def _module_getattr(path: Path) -> tuple[set[str], list[tuple[str, str | None]]]:
    """(names bound at the top of the module, imports of its module-level ``__getattr__``): ``from pkg import
    Name`` of a name the module does not bind runs ``pkg.__getattr__`` and what it imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: set[str] = set()
    lazy: list[tuple[str, str | None]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            found = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
            lazy = [i for n in found for i in _resolved(n, path)]
    return bound, lazy


def _resolved(node: ast.AST, path: Path) -> list[tuple[str, str | None]]:
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = node.module or ""
    if node.level:
        here = package[: len(package) - node.level + 1]
        base = ".".join(here + ([base] if base else []))
    return [(base, a.name) for a in node.names]


def _loaded_by() -> dict[str, set[str]]:
    """airquant module -> every module (airquant's and others', dotted, with their parents) that importing it
    runs, read statically from the top-level imports (and the ``__getattr__`` a ``from pkg import Name`` runs)."""
    known = _modules()
    getattrs = {me: _module_getattr(path) for me, path in known.items()}
    direct: dict[str, set[str]] = {}
    for me, path in known.items():
        reached = {".".join(me.split(".")[:i]) for i in range(1, len(me.split(".")))}
        pending, todo = dict(getattrs), _top_imports(path)
        while todo:
            module, name = todo.pop()
            ours = module.split(".")[0] == PACKAGE.name
            target = (_target(module, name, known) if ours else None) or module
            if ours and name and target == module and target in pending and name not in pending[target][0]:
                todo += pending.pop(target)[1]  # once: ``__getattr__`` may import from its own package
            bits = target.split(".")
            reached |= {".".join(bits[:i]) for i in range(1, len(bits) + 1)}
        direct[me] = reached - {me}
    closed: dict[str, set[str]] = {}
    for me in known:
        seen, todo = set(), [me]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(direct.get(m, ()))
        closed[me] = seen - {me}
    return closed


def _lazy_key(module: str) -> str | None:
    return next((k for k in LAZY_MODULES if module == k or module.startswith(k + ".")), None)


def _unjustified_lazy_imports() -> tuple[list[tuple[str, str, int]], set[str]]:
    """([(file, module, line)] of function-level imports with no reason, allowlist keys that gave one)."""
    known, loaded = _modules(), _loaded_by()
    getattrs = {me: _module_getattr(path) for me, path in known.items()}
    bad, used = [], set()
    for me, path in known.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if _LAZY_MARK.search(lines[node.lineno - 1]):
                    continue
                for module, name in _resolved(node, path):
                    ours = module.split(".")[0] == PACKAGE.name
                    target = _target(module, name, known) if ours else module
                    targets = [target]
                    if ours and name and target == module and name not in getattrs[target][0]:
                        targets += [_target(m, n, known) or m for m, n in getattrs[target][1]]
                    brings = set().union(*({t} | loaded.get(t, set()) for t in targets)) - loaded[me]
                    keys = {_lazy_key(m) for m in brings} - {None}
                    used |= keys
                    if not keys:
                        bad.append((path.relative_to(PACKAGE).as_posix(), target, node.lineno))
    return sorted(set(bad)), used


def test_function_level_imports_have_a_reason():
    """A function imports a module only when importing it at the top would load something ``LAZY_MODULES``
    names that the file does not load already (an optional package, a measured cost), or when its line says
    why (``# lazy: cycle (quant <-> quant.swap)``). Everything else goes at the top of the file."""
    bad, used = _unjustified_lazy_imports()
    new = [f"{f}:{line} {m}" for f, m, line in bad]
    assert not new, ("function-level imports with no reason (move them to the top of the file, or add the "
                     f"module and its measured cost to LAZY_MODULES, or mark the line '# lazy: <why>'): {new}")
    stale = set(LAZY_MODULES) - used
    assert not stale, f"no function imports these lazily any more: remove them from LAZY_MODULES: {stale}"


def test_lazy_rule_reads_a_table():
    assert _lazy_key("transformers.cache_utils") == "transformers" and _lazy_key("transformersx") is None
    assert "transformers" in _loaded_by()["airquant.engine.runner"], "runner's transformers import was not seen"
    assert "transformers" not in _loaded_by()["airquant.store.manifest"]
    assert ("airquant.ui.mount", "UiMount") in _module_getattr(PACKAGE / "ui" / "__init__.py")[1]


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
