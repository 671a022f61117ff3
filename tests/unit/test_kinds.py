"""Server kinds have one place each (kvtrace.servers.registry): no code outside a kind's own
folders (kvtrace/servers/<kind>/, kvtrace/hook/<kind>/) compares a kind's name, so a kind that is
not handled is an error, never silently taken for another."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from kvtrace.servers import registry

REPO = Path(__file__).resolve().parents[2]
NAMES = set(registry.names())


def _own(rel: tuple[str, ...]) -> bool:
    """A kind's own folder: kvtrace/servers/<kind>/ or kvtrace/hook/<kind>/."""
    return len(rel) > 2 and rel[0] in ("servers", "hook") and rel[1] in NAMES


def _names_in(node) -> bool:
    """The node is a kind's name, or a literal collection holding one."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e) for e in node.elts)
    return False


def _prefix(node) -> bool:
    """A constant that starts with a kind's name and a colon or is one ("sglang:", "vllm")."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        any(node.value == n or node.value.startswith(n + ":") for n in NAMES)


def branches(path: Path) -> list[int]:
    """Lines of ``path`` that branch on a kind's name: compared (==, !=, in), given as a default
    (``getattr(x, "engine", "vllm")``, ``d.get(k, "vllm")``, ``x or "vllm"``) or tested as a
    prefix (``name.startswith("sglang:")``)."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Compare) and (_names_in(n.left) or any(_names_in(c) for c in n.comparators)):
            out.append(n.lineno)
        elif isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or) and _names_in(n.values[-1]):
            out.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)):
            fn = n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            if fn in ("getattr", "get", "setdefault", "pop") and len(n.args) >= 2 and _names_in(n.args[-1]):
                out.append(n.lineno)
            elif fn in ("startswith", "endswith", "removeprefix") and n.args and _prefix(n.args[0]):
                out.append(n.lineno)
    return sorted(set(out))


def offenders(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if not _own(rel):
            out += [f"kvtrace/{'/'.join(rel)}:{line}" for line in branches(path)]
    return out


def test_no_kind_name_is_compared_outside_its_own_folders():
    assert offenders(REPO / "kvtrace") == []


def test_a_planted_comparison_is_found(tmp_path):
    root = tmp_path / "kvtrace"
    shutil.copytree(REPO / "kvtrace", root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "analysis" / "planted.py").write_text(
        'def f(x, d, m):\n    a = getattr(x, "engine", "vllm")\n    b = d.get("engine") == "sglang"\n'
        '    c = m.startswith("sglang:")\n    e = x.kind in ("vllm",)\n    return x.kind or "vllm"\n')
    (root / "servers" / "sglang" / "planted.py").write_text('def f(x):\n    return x == "sglang"\n')
    planted = [o for o in offenders(root) if "planted" in o]
    assert planted == [f"kvtrace/analysis/planted.py:{n}" for n in (2, 3, 4, 5, 6)]


def test_an_unknown_kind_is_an_error_never_vllm():
    with pytest.raises(registry.UnknownServerKind) as e:
        registry.kind("tgi")
    assert e.value.exit_code == 6 and "unknown server kind 'tgi'" in str(e.value) and "\n" not in str(e.value)


def test_each_kind_recognises_only_its_own_servers():
    argv = {"vllm": ["vllm", "serve", "m"], "sglang": ["python3", "-m", "sglang.launch_server", "--model-path", "m"]}
    assert set(argv) == NAMES
    for name, kind in registry.KINDS.items():
        for other, a in argv.items():
            assert (kind.recognise(a) is not None) == (name == other), (name, a)


def test_every_descriptor_is_complete():
    for name, kind in registry.KINDS.items():
        assert kind.name == name and kind.title and kind.package and kind.hook_module.startswith("kvtrace.hook.")
        assert kind.default_port > 0 and kind.plugin_group and kind.plugins_env and kind.hooked
        assert kind.roles and kind.metrics_prefix == f"{name}:" and kind.cache_model
        assert callable(kind.support_check())
