"""The wheel and sdist ship what the tree holds and declare exactly what the code imports.

Built once per session from a clean copy of the tree (tests/packaging.py, fixture ``built_dist``).
A new subpackage, probe or import therefore needs no edit here unless it imports a new
distribution: then add it to DIST below and to pyproject.toml.
"""
from __future__ import annotations

import pytest

import ast
import configparser
import email.parser
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from tests.packaging import REPO, source_files

# import name -> distribution (None: not from PyPI).  Longest prefix wins.
DIST = {
    "bcc": None,  # Debian's python3-bpfcc, seen through --system-site-packages
    "click": "click",
    "duckdb": "duckdb",
    "grpc": "grpcio",
    "msgspec": "msgspec",
    "numpy": "numpy",
    "opentelemetry.proto": "opentelemetry-proto",
    "psutil": "psutil",
    "pyarrow": "pyarrow",
    "pyroute2": "pyroute2",
    "pyspark": "pyspark",
    "rich": "rich",
    "zmq": "pyzmq",
}
# Code that runs inside vLLM's interpreter (kvtrace installed there with --no-deps): the standard
# library, kvtrace.hook and what vLLM itself brings.  Their parents' __init__ run there too.
IN_VLLM = ["kvtrace/__init__.py", "kvtrace/hook/", "kvtrace/servers/__init__.py"]
VLLM_SIDE = {"vllm", "torch", "sglang"}
ROOT_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")


def tree() -> list[str]:
    return source_files(REPO)


def expected_wheel_files() -> set[str]:
    """kvtrace/**/*.py at the same path; probes/ (*.bpf.c, *.h, __init__.py) as kvtrace/bpf/."""
    out = {f for f in tree() if f.startswith("kvtrace/") and f.endswith(".py")}
    for f in tree():
        if re.fullmatch(r"probes/[^/]+(\.bpf\.c|\.h|\.py)", f):
            out.add("kvtrace/bpf/" + f.split("/", 1)[1])
    return out


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if not n.endswith("/")}


def wheel_text(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/" + suffix, n)]
        return z.read(name).decode()


def module_of(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def imports(rel: str):
    """(absolute module, line, at module scope) for each import in ``rel``."""
    pkg = module_of(rel) if rel.endswith("__init__.py") else module_of(rel).rpartition(".")[0]
    out = []

    def visit(node, scope: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, scope) for a in child.names)
            elif isinstance(child, ast.ImportFrom):  # each name as module.name: it may be a module
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - child.level + 1]) if child.level else ""
                mod = ".".join(p for p in (base, child.module) if p)
                out.extend((f"{mod}.{a.name}", child.lineno, scope) for a in child.names)
            visit(child, scope and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse((REPO / rel).read_text(), rel), True)
    return out


def third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top != "kvtrace"


def dist_of(module: str):
    """The distribution ``module`` comes from; KeyError when DIST does not know it."""
    keys = [k for k in DIST if module == k or module.startswith(k + ".")]
    if not keys:
        raise KeyError(module)
    return DIST[max(keys, key=len)]


def in_vllm(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in IN_VLLM)


def agent_imports():
    """{distribution: [(file:line, at module scope)]} over kvtrace/ outside the in-vLLM code."""
    found, unknown = {}, []
    for rel in tree():
        if not (rel.startswith("kvtrace/") and rel.endswith(".py")) or in_vllm(rel):
            continue
        for mod, line, scope in imports(rel):
            if not third_party(mod):
                continue
            try:
                dist = dist_of(mod)
            except KeyError:
                unknown.append(f"{mod} ({rel}:{line})")
                continue
            if dist:
                found.setdefault(dist, []).append((f"{rel}:{line}", scope))
    assert not unknown, f"imports with no entry in DIST (add the distribution here and to pyproject.toml): {unknown}"
    return found


def requires(wheel: Path) -> dict[str, str | None]:
    """Requires-Dist as {normalized name: extra or None}; the test extra left out."""
    meta = email.parser.Parser().parsestr(wheel_text(wheel, "METADATA"))
    out = {}
    for req in meta.get_all("Requires-Dist") or []:
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0).lower().replace("_", "-")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if extra and extra.group(1) == "test":
            continue
        if out.get(name, "") is not None:  # core wins over an extra that repeats it
            out[name] = extra.group(1) if extra else None
    return out


def test_wheel_ships_every_module_and_probe(built_dist):
    missing = sorted(expected_wheel_files() - wheel_files(built_dist[0]))
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the tree: {missing}"


def test_wheel_ships_nothing_else(built_dist):
    extra = sorted(f for f in wheel_files(built_dist[0]) - expected_wheel_files()
                   if not re.match(r"kvtrace-[^/]+\.dist-info/", f))
    assert not extra, f"the wheel ships files that are not kvtrace's modules or probes: {extra}"


def test_wheel_entry_points(built_dist):
    ep = configparser.ConfigParser()
    ep.read_string(wheel_text(built_dist[0], "entry_points.txt"))
    assert dict(ep["console_scripts"]) == {"kvtrace": "kvtrace.__main__:main"}
    assert dict(ep["vllm.general_plugins"]) == {"kvtrace": "kvtrace.hook.vllm.plugin:register"}
    assert dict(ep["sglang.srt.plugins"]) == {"kvtrace": "kvtrace.hook.sglang.plugin:register"}


def test_requires_dist_matches_imports(built_dist):
    declared, imported = set(requires(built_dist[0])), set(agent_imports())
    assert not imported - declared, f"imported but not declared in pyproject.toml: {sorted(imported - declared)}"
    assert not declared - imported, f"declared but never imported by kvtrace/: {sorted(declared - imported)}"


def test_module_scope_imports_are_core_dependencies(built_dist):
    """An extra's import must sit inside the function that needs it (which then says what to install)."""
    extras = {d: e for d, e in requires(built_dist[0]).items() if e}
    bad = [f"{d} [{extras[d]}] at {where}" for d, uses in agent_imports().items() if d in extras
           for where, scope in uses if scope]
    assert not bad, f"optional dependencies imported at module scope (an ImportError for every user): {bad}"


def test_in_vllm_code_imports_only_stdlib_and_hook():
    bad = [f"{rel}:{line}: {mod}" for rel in tree() if rel.endswith(".py") and in_vllm(rel)
           for mod, line, _ in imports(rel)
           if (third_party(mod) and mod.split(".")[0] not in VLLM_SIDE)
           or (mod.split(".")[0] == "kvtrace" and not mod.startswith("kvtrace.hook."))]
    assert not bad, f"code that runs inside vLLM (no kvtrace deps there) imports: {bad}"


def test_sdist_holds_the_sources(built_dist):
    with tarfile.open(built_dist[1]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    want = {f for f in tree() if f.startswith(("kvtrace/", "probes/")) or f in ROOT_FILES}
    missing = sorted(want - names)
    assert not missing, f"the sdist lacks {len(missing)} tracked file(s): {missing}"


SMOKE = r"""
import importlib, json, pkgutil
import kvtrace, kvtrace.inject, kvtrace.hook.vllm.plugin, kvtrace.hook.sglang.plugin, kvtrace.bpf
from kvtrace.capture import program
failed, skipped = {}, []
for m in pkgutil.walk_packages(kvtrace.__path__, "kvtrace."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in ("vllm", "torch"):
            skipped.append(m.name)
        else:
            failed[m.name] = repr(e)
plan = program.plan(tp=lambda *a, **k: True)  # reads every probe source from kvtrace.bpf
from kvtrace.hook import plugin, sglang_plugin, vllm_hook   # the earlier names, kept for one release
shims = (plugin.register is kvtrace.hook.vllm.plugin.register
         and sglang_plugin.register is kvtrace.hook.sglang.plugin.register
         and vllm_hook.install is importlib.import_module("kvtrace.hook.vllm.hook").install)
print(json.dumps({"file": kvtrace.__file__, "bpf": str(kvtrace.bpf.SOURCE_DIR), "failed": failed,
                  "skipped": skipped, "probes": plan.attached, "shims": shims}))
"""


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd="/", **kw)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(built_dist, tmp_path):
    venv = tmp_path / "venv"
    r = run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)])
    assert r.returncode == 0, r.stderr
    r = run([venv / "bin/pip", "install", "-q", "--disable-pip-version-check", built_dist[0]])
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    r = run([venv / "bin/python", "-c", SMOKE])
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["file"].startswith(str(venv)) and got["bpf"].startswith(str(venv)), got
    assert not got["failed"], f"modules that do not import from the installed wheel: {got['failed']}"
    # the file connector (and its shim under the earlier name) needs vLLM and torch
    assert set(got["skipped"]) <= {"kvtrace.hook.vllm.fileconnector", "kvtrace.hook.fileconnector"}, got["skipped"]
    assert "proc" in got["probes"] and got["shims"], got

    r = run([venv / "bin/kvtrace", "--help"])
    assert r.returncode == 0 and "doctor" in r.stdout, r.stdout + r.stderr
    r = run([venv / "bin/kvtrace", "doctor", "--json"])
    assert r.returncode in (0, 1), r.stderr  # 1: capture not available here (README)
    report = json.loads(r.stdout)
    assert report["capture_available"] == (r.returncode == 0) and report["checks"], report
