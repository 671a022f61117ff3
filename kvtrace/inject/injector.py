"""Inject (or remove) the hook in one process and report what the loader said."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from kvtrace import phases
from kvtrace.errors import TargetError
from kvtrace.host import confined
from kvtrace.inject import loader, ptrace, stage

RESULT = "result.json"


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


def run(pid: int, st: stage.Staged, code: str, minor: int, timeout: float = 10.0) -> dict:
    """Run the loader ``code`` in pid from the staging ``st``; return the JSON it wrote."""
    body = code.encode()
    confined.write_exclusive(st.dir_fd, "loader.py", body, 0o644, shown=f"{st.inner}/loader.py")
    line = loader.bootstrap(f"{st.inner}/loader.py", body)
    if minor >= 14:
        confined.write_exclusive(st.dir_fd, "boot.py", line.encode(), 0o644, shown=f"{st.inner}/boot.py")
        _remote_exec(pid, f"{st.inner}/boot.py", timeout)
    else:
        ptrace.run_code(pid, line, timeout)
    return _result(pid, st, timeout)


def _result(pid: int, st: stage.Staged, timeout: float) -> dict:
    """The loader's report, read from the target's result directory as a regular file of at
    most 1 MiB (the target's user owns that directory: what it holds is not trusted further)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.stat(RESULT, dir_fd=st.result_fd, follow_symlinks=False)
            break
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TargetError(f"process {pid} did not run the injected code within {timeout:.0f}s")
        if not Path(f"/proc/{pid}").exists():
            raise TargetError(f"process {pid} exited during injection")
        time.sleep(0.05)
    try:
        rep = json.loads(confined.read_regular(st.result_fd, RESULT, shown=f"{st.inner}/r/{RESULT}"))
    except (confined.UnsafePath, ValueError) as e:
        raise TargetError(f"process {pid}: the injected code's report is unreadable ({e})") from None
    if not isinstance(rep, dict):
        raise TargetError(f"process {pid}: the injected code's report is not an object")
    return rep


def _remote_exec(pid: int, inner_path: str, timeout: float) -> None:
    """Python 3.14+: the target's own interpreter calls sys.remote_exec (PEP 768); the code
    runs at the target's next safe point."""
    exe = f"/proc/{pid}/exe"
    try:
        st = os.stat(exe)
    except OSError:
        raise TargetError(f"process {pid} exited during injection") from None
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise TargetError(f"process {pid}: its interpreter is not root's alone (uid {st.st_uid}, mode "
                          f"{st.st_mode & 0o7777:04o}); kvtrace runs no other user's program as root")
    p = subprocess.run([exe, "-c", f"import sys; sys.remote_exec({pid}, {inner_path!r})"],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise TargetError(f"sys.remote_exec into {pid} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")


def hook(pid: int, action: str = "install", timeout: float = 10.0, checked: dict | None = None,
         *, module: str, owned: bool = True) -> dict:
    """Install or uninstall the hook ``module`` (a server kind's ``hook_module``) in pid, from its
    files staged in the target (kvtrace.inject.stage.hook_files); returns the loader's report.
    ``checked``: the verdict on the target's source (the kind's support check,
    kvtrace.servers.kind), which the hook uses instead of reading that source again while the
    target waits.  ``owned``: a hook this call installs leaves when this process exits (attach);
    else it stays until removed."""
    phases.mark("inject_start", action, pid)
    try:
        major, minor = python_version(pid)
        if minor < 11:
            raise TargetError(f"process {pid} runs Python 3.{minor}; live injection supports 3.11+")
        try:
            st = stage.stage(pid, python=(major, minor), module=module)
        except confined.UnsafePath as e:
            raise TargetError(f"process {pid}: the hook is not staged: {e}") from None
        try:
            code = loader.render(st.files, f"{st.inner}/{stage.RESULT_DIR}/{RESULT}", action,
                                 owner=os.getpid() if owned else 0, checked=checked, module=module)
            return run(pid, st, code, minor, timeout)
        finally:
            st.close()
    finally:
        phases.mark("inject_end", action, pid)
