"""Imports point one way, down the layers of docs/design.md: a package imports only packages
below it, never one above it; an import inside a function says on its line why it is
there (``# lazy: reason``); and no modules import one another in a circle.  Relative imports
count as much as absolute ones."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Bottom to top.  The base modules (errors, phases, units, the package itself) are below all;
# cli and __main__ are the commands' layer.
LAYERS = ["hook", "dataset", "host", "fabric", "capture", "servers", "inject", "correlate", "otlp", "analysis",
          "doctor", "demo", "attach", "commands"]
BASE = {"errors", "phases", "units", "__init__", "_version"}
TOP_MODULES = {"cli": "commands", "__main__": "commands"}


def layer_of(parts: tuple[str, ...]) -> str:
    """The layer of a module given as path parts below kvtrace/ (or a dotted name's parts)."""
    head = parts[0].removesuffix(".py") if parts else "__init__"
    if head in BASE:
        return "base"
    return TOP_MODULES.get(head, head)


def rank(layer: str) -> int:
    return -1 if layer == "base" else LAYERS.index(layer)




def _absolute(node: ast.ImportFrom, rel: tuple[str, ...]) -> str | None:
    """The absolute module an ImportFrom names (relative ones resolved against the file's package)."""
    if node.level == 0:
        return node.module
    base = ["kvtrace", *rel[:-1]]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking(tree: ast.Module) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (never imported at run time)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            out.update(id(x) for b in n.body for x in ast.walk(b))
    return out


def imports(path: Path, rel: tuple[str, ...] = ()):
    """(line, imported kvtrace module parts, in a function?, the source line) of one file, relative
    imports resolved (``from . import x`` in kvtrace/a/b.py names kvtrace.a.x); imports under
    ``if TYPE_CHECKING:`` are left out."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    module_level = {id(n) for n in tree.body}
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            module_level.update(id(x) for x in ast.walk(n))
    skip = _type_checking(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(node, rel)
            if not mod:
                continue
            names = [mod + "." + a.name if mod == "kvtrace" or node.level else mod for a in node.names]
        else:
            continue
        for name in names:
            if name == "kvtrace" or name.startswith("kvtrace."):
                yield node.lineno, tuple(name.split(".")[1:]), id(node) not in module_level, lines[node.lineno - 1]


def violations(root: Path) -> list[str]:
    """Every import of a package above its own, and every unexplained lazy import."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        here = layer_of(rel)
        for line, target, lazy, text in imports(path, rel):
            if target and not ((root / target[0]).is_dir() or (root / f"{target[0]}.py").exists()):
                target = ()   # a name of the package itself (kvtrace.__version__)
            there = layer_of(target)
            where = f"kvtrace/{'/'.join(rel)}:{line}"
            if there not in LAYERS + ["base"]:
                out.append(f"{where}: imports kvtrace.{'.'.join(target)}, which is in no layer")
            elif there != here and rank(there) >= rank(here):
                out.append(f"{where}: {here} imports {there}, a layer above it")
            if lazy and "# lazy:" not in text:
                out.append(f"{where}: an import inside a function without '# lazy: <why>'")
    return out


def module_of(root: Path, parts: tuple[str, ...]) -> str | None:
    """The kvtrace module a name's parts lead to: the longest prefix that is a file or a package
    (``from kvtrace.a import f`` is kvtrace.a when f is a function), None for the package itself."""
    for n in range(len(parts), 0, -1):
        p = root.joinpath(*parts[:n])
        if p.with_suffix(".py").is_file():
            return ".".join(parts[:n])
        if (p / "__init__.py").is_file():
            return ".".join(parts[:n])
    return None


def graph(root: Path) -> dict[str, set[str]]:
    """module -> the kvtrace modules it imports, every import counted (module level, relative, in a
    function), except those under ``if TYPE_CHECKING:``."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        me = ".".join(rel).removesuffix(".py").removesuffix(".__init__")
        edges = out.setdefault(me, set())
        for _line, target, _lazy, _text in imports(path, rel):
            there = module_of(root, target)
            if there and there != me:
                edges.add(there)
    return out


def circles(root: Path) -> list[list[str]]:
    """Every set of modules that import one another in a circle (strongly connected, Tarjan), sorted."""
    g, index, low, stack, on, found = graph(root), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_package_is_in_a_layer():
    packages = {p.name for p in (REPO / "kvtrace").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))


def test_imports_point_down():
    assert violations(REPO / "kvtrace") == []


def test_no_import_circle():
    assert circles(REPO / "kvtrace") == []


def test_a_planted_circle_is_found_through_relative_and_lazy_imports(tmp_path):
    root = tmp_path / "kvtrace"
    shutil.copytree(REPO / "kvtrace", root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "dataset" / "p_one.py").write_text("from . import p_two\n")
    (root / "dataset" / "p_two.py").write_text("def f():\n    from kvtrace.dataset.p_one import x  # lazy: planted\n")
    (root / "dataset" / "p_typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from .p_one import y\n")
    (root / "dataset" / "p_solo.py").write_text("from .p_typed import z\n")
    assert [c for c in circles(root) if any(".p_" in m for m in c)] == [["dataset.p_one", "dataset.p_two"]]


def test_a_planted_upward_import_is_named(tmp_path):
    root = tmp_path / "kvtrace"
    shutil.copytree(REPO / "kvtrace", root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "dataset" / "planted.py").write_text("from kvtrace.commands import attach\n")
    (root / "capture" / "planted.py").write_text("def f():\n    from kvtrace.dataset import reader\n")
    (root / "servers" / "planted.py").write_text("import kvtrace.correlate.core\n")
    (root / "host" / "planted.py").write_text("from ..inject import stage\n")
    assert [v for v in violations(root) if "planted" in v] == [
        "kvtrace/capture/planted.py:2: an import inside a function without '# lazy: <why>'",
        "kvtrace/dataset/planted.py:1: dataset imports commands, a layer above it",
        "kvtrace/host/planted.py:1: host imports inject, a layer above it",
        "kvtrace/servers/planted.py:1: servers imports correlate, a layer above it",
    ]
