"""Stage the hook's files where the target can import them, through /proc/PID/root so a
containerised server sees them at the same in-container path."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import kvtrace

HOOK_FILES = ["__init__.py", "hook/__init__.py", "hook/wire.py", "hook/transport.py", "hook/api.py", "hook/vllm_hook.py"]


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


def stage(pid: int, base: str = "/tmp") -> tuple[str, Path]:
    """Copy the hook into <target root>/<base>/kvtrace-hook-<digest>; returns (path inside the
    target, path here).  Files are root-owned and world-readable, so the target can import them."""
    inner = f"{base}/kvtrace-hook-{kvtrace.__version__}-{digest()}"
    here = target_root(pid) / inner.lstrip("/")
    if not (here / "kvtrace" / "hook" / "vllm_hook.py").exists():
        tmp = here.parent / f".{here.name}.{os.getpid()}"
        for rel in HOOK_FILES:
            dst = tmp / "kvtrace" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package_dir() / rel, dst)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        try:
            tmp.rename(here)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another agent staged it first
    return inner, here
