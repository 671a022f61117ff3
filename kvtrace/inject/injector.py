"""Inject (or remove) the hook in one process and report what the loader said."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

from kvtrace import phases
from kvtrace.errors import TargetError
from kvtrace.inject import loader, ptrace, stage


def python_version(pid: int) -> tuple[int, int]:
    """CPython version of a process, from the libpython or executable it maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        raise TargetError(f"process {pid} exited or cannot be read") from None
    m = re.search(r"libpython3\.(\d+)", maps) or re.search(r"python3\.(\d+)", exe)
    if not m:
        raise TargetError(f"process {pid} ({exe}) is not a CPython 3 process")
    return 3, int(m.group(1))


def run(pid: int, code: str, timeout: float = 10.0) -> dict:
    """Run ``code`` (which must write JSON to RESULT_PATH) in pid; return that JSON."""
    major, minor = python_version(pid)
    if (major, minor) < (3, 11):
        raise TargetError(f"process {pid} runs Python {major}.{minor}; live injection supports 3.11+")
    token = uuid.uuid4().hex[:8]
    inner_code = f"/tmp/kvtrace-inject-{pid}-{token}.py"
    inner_result = f"/tmp/kvtrace-inject-{pid}-{token}.json"
    root = stage.target_root(pid)
    code_here = root / inner_code.lstrip("/")
    result_here = root / inner_result.lstrip("/")
    code_here.write_text(code.replace("RESULT_PATH", json.dumps(inner_result)))
    code_here.chmod(0o644)
    try:
        if minor >= 14:
            _remote_exec(pid, inner_code, timeout)
        else:
            ptrace.run_code(pid, f"exec(open({inner_code!r}).read())", timeout)
        deadline = time.monotonic() + timeout
        while not result_here.exists():
            if time.monotonic() > deadline:
                raise TargetError(f"process {pid} did not run the injected code within {timeout:.0f}s")
            if not Path(f"/proc/{pid}").exists():
                raise TargetError(f"process {pid} exited during injection")
            time.sleep(0.05)
        return json.loads(result_here.read_text())
    finally:
        for p in (code_here, result_here):
            try:
                p.unlink()
            except OSError:
                pass


def _remote_exec(pid: int, inner_path: str, timeout: float) -> None:
    """Python 3.14+: the target's own interpreter calls sys.remote_exec (PEP 768); the code
    runs at the target's next safe point."""
    exe = f"/proc/{pid}/exe"
    p = subprocess.run([exe, "-c", f"import sys; sys.remote_exec({pid}, {inner_path!r})"],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise TargetError(f"sys.remote_exec into {pid} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")


def hook(pid: int, action: str = "install", timeout: float = 10.0, checked: dict | None = None,
         engine: str = "vllm", owned: bool = True) -> dict:
    """Install or uninstall the hook of ``engine`` ("vllm", "sglang") in pid; returns the loader's
    report.  ``checked``: the verdict on the target's source (kvtrace.hook.support.check), which
    the hook uses instead of reading that source again while the target waits.  ``owned``: a
    hook this call installs leaves when this process exits (attach); else it stays until removed."""
    phases.mark("inject_start", action, pid)
    try:
        inner_dir, _ = stage.stage(pid, python=python_version(pid))
        code = loader.render(inner_dir, "__RESULT__", action, owner=os.getpid() if owned else 0, checked=checked,
                             engine=engine).replace('"__RESULT__"', "RESULT_PATH")
        return run(pid, code, timeout)
    finally:
        phases.mark("inject_end", action, pid)
