"""Staging the hook for injection: for a target on our Python minor version the files come
compiled, and that target's import reads the bytecode (the part of an injection that holds
the server's main thread).  No root: staged into a temp dir of this process's own root."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtrace.inject import stage


def _imports(inner: str, module: str) -> str:
    p = subprocess.run([sys.executable, "-v", "-c", f"import sys; sys.path.insert(0, {inner!r}); import {module}"],
                       capture_output=True, text=True, cwd="/", env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr


def test_same_python_target_gets_bytecode(tmp_path):
    inner, here = stage.stage(os.getpid(), base=str(tmp_path), python=sys.version_info[:2])
    assert here == Path(f"/proc/{os.getpid()}/root{inner}") and here.resolve() == Path(inner)
    tag = sys.implementation.cache_tag
    for rel in stage.HOOK_FILES:
        src = Path(inner) / "kvtrace" / rel
        pyc = src.parent / "__pycache__" / f"{src.stem}.{tag}.pyc"
        assert pyc.is_file() and oct(pyc.stat().st_mode & 0o777) == "0o644", pyc
    log = _imports(inner, "kvtrace.hook.wire")
    wire_pyc = f"{inner}/kvtrace/hook/__pycache__/wire.{tag}.pyc"
    assert f"# {wire_pyc} matches {inner}/kvtrace/hook/wire.py" in log, log[-3000:]
    assert f"code object from '{wire_pyc}'" in log


def test_other_python_target_gets_sources_only(tmp_path):
    inner, _ = stage.stage(os.getpid(), base=str(tmp_path), python=(3, sys.version_info[1] + 1))
    assert not list(Path(inner).rglob("__pycache__"))
    log = _imports(inner, "kvtrace.hook.wire")
    assert f"# code object from {inner}/kvtrace/hook/wire.py\n" in log, log[-3000:]   # compiled from source


def test_an_earlier_staging_without_bytecode_gets_it(tmp_path):
    inner, _ = stage.stage(os.getpid(), base=str(tmp_path), python=None)
    assert not list(Path(inner).rglob("*.pyc"))
    again, _ = stage.stage(os.getpid(), base=str(tmp_path), python=sys.version_info[:2])
    assert again == inner and len(list(Path(inner).rglob("*.pyc"))) == len(stage.HOOK_FILES)
    assert f"code object from '{inner}/kvtrace/hook/__pycache__/wire." in _imports(inner, "kvtrace.hook.wire")
