"""Stage the hook's files where the target can import them, through /proc/PID/root so a
containerised server sees them at the same in-container path.

When the target runs the agent's Python minor version, the files are staged compiled too
(``__pycache__``, as the target would write them): the import inside the target, which holds
its main thread while it runs, then reads bytecode instead of compiling about 1,500 lines.
"""
from __future__ import annotations

import hashlib
import os
import py_compile
import shutil
import sys
from pathlib import Path

import kvtrace

# Every module the hook imports (vllm_hook.py imports state, engine, worker, targets, patch and
# install; targets the plan's needs, plan, source, support and releases; sglang_hook.py its
# sglang_needs and sglang_engine).  vllm_hook.py last: _compile stops at the first failure, so _compiled() takes its
# bytecode to mean every file's.
HOOK_FILES = ["__init__.py", "hook/__init__.py", "hook/exact.py", "hook/wire.py", "hook/transport.py", "hook/api.py",
              "hook/state.py", "hook/engine.py", "hook/worker.py", "hook/patch.py", "hook/source.py", "hook/plan.py",
              "hook/needs.py", "hook/releases.py", "hook/support.py", "hook/targets.py", "hook/install.py",
              "hook/sglang_needs.py", "hook/sglang_engine.py", "hook/sglang_hook.py", "hook/vllm_hook.py"]


def package_dir() -> Path:
    return Path(kvtrace.__file__).resolve().parent


def digest() -> str:
    h = hashlib.sha256()
    for rel in HOOK_FILES:
        h.update((package_dir() / rel).read_bytes())
    return h.hexdigest()[:12]


def target_root(pid: int) -> Path:
    """The target's filesystem root as seen from here (its mount namespace)."""
    return Path(f"/proc/{pid}/root")


def stage(pid: int, base: str = "/tmp", python: tuple[int, int] | None = None) -> tuple[str, Path]:
    """Copy the hook into <target root>/<base>/kvtrace-hook-<digest>; returns (path inside the
    target, path here).  Files are root-owned and world-readable, so the target can import them.
    ``python``: the target's (major, minor); the same as ours adds the compiled files."""
    inner = f"{base}/kvtrace-hook-{kvtrace.__version__}-{digest()}"
    here = target_root(pid) / inner.lstrip("/")
    compile_too = python == tuple(sys.version_info[:2])
    if not (here / "kvtrace" / "hook" / "vllm_hook.py").exists():
        tmp = here.parent / f".{here.name}.{os.getpid()}"
        for rel in HOOK_FILES:
            dst = tmp / "kvtrace" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package_dir() / rel, dst)
        if compile_too:
            _compile(tmp, inner)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        try:
            tmp.rename(here)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another agent staged it first
    elif compile_too and not _compiled(here):
        _compile(here, inner)   # staged by a kvtrace that did not compile (pyc writes are atomic)
    return inner, here


def _compiled(root: Path) -> bool:
    src = root / "kvtrace" / "hook" / "vllm_hook.py"
    return (src.parent / "__pycache__" / f"vllm_hook.{sys.implementation.cache_tag}.pyc").exists()


def _compile(root: Path, inner: str) -> None:
    """Write each file's bytecode where the target's import looks for it (the pyc records the
    source's size and mtime, which the rename to the final path keeps); best effort."""
    for rel in HOOK_FILES:
        src = root / "kvtrace" / rel
        try:
            py_compile.compile(str(src), dfile=f"{inner}/kvtrace/{rel}", doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        except (py_compile.PyCompileError, OSError):
            return
