"""Imports point one way, down the layers of docs/design.md: a package imports only packages
below it, never one above it; an import inside a function says on its line why it is
there (``# lazy: reason``)."""
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


def imports(path: Path):
    """(line, imported kvtrace module parts, in a function?, the source line) of one file."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    module_level = {id(n) for n in tree.body}
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            module_level.update(id(x) for x in ast.walk(n))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module + "." + a.name if node.module == "kvtrace" else node.module for a in node.names]
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
        for line, target, lazy, text in imports(path):
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


def test_every_package_is_in_a_layer():
    packages = {p.name for p in (REPO / "kvtrace").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))


def test_imports_point_down():
    assert violations(REPO / "kvtrace") == []


def test_a_planted_upward_import_is_named(tmp_path):
    root = tmp_path / "kvtrace"
    shutil.copytree(REPO / "kvtrace", root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "dataset" / "planted.py").write_text("from kvtrace.commands import attach\n")
    (root / "capture" / "planted.py").write_text("def f():\n    from kvtrace.dataset import reader\n")
    (root / "servers" / "planted.py").write_text("import kvtrace.correlate.core\n")
    assert violations(root) == [
        "kvtrace/capture/planted.py:2: an import inside a function without '# lazy: <why>'",
        "kvtrace/dataset/planted.py:1: dataset imports commands, a layer above it",
        "kvtrace/servers/planted.py:1: servers imports correlate, a layer above it",
    ]
