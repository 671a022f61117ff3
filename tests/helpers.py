"""Helpers shared by the tests: a free local port in a range, waiting for a condition, a
process's resident memory, and requests to a vLLM server's OpenAI API."""
from __future__ import annotations

import json
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port(lo: int, hi: int, avoid=()) -> int:
    """A port in [lo, hi] nothing on 127.0.0.1 is bound to (the range a test may use), tried in
    random order so tests running at once rarely race for the same one."""
    ports = [p for p in range(lo, hi + 1) if p not in avoid]
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def wait_for(pred, timeout: float = 30.0, what: str | None = None, step: float = 0.05):
    """Poll ``pred`` until it returns something true and return that.  At the timeout: raise
    AssertionError naming ``what`` when given, else return ``pred()``'s last (false) value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    v = pred()
    if not v and what is not None:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return v


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (VmRSS), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def post_completion(url: str, model: str, prompt, request_id: str, max_tokens: int = 4, headers: dict | None = None,
                    timeout: float = 300, **extra) -> dict:
    """POST /v1/completions (greedy) with vLLM's X-Request-Id; the decoded JSON answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id,
                                          **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def dev_post(url: str, path: str) -> None:
    """POST to one of vLLM's dev-mode endpoints (the server runs with VLLM_SERVER_DEV_MODE=1)."""
    req = urllib.request.Request(f"{url}{path}", method="POST", data=b"")
    urllib.request.urlopen(req, timeout=60).read()


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's prefix cache (POST /reset_prefix_cache)."""
    dev_post(url, "/reset_prefix_cache")


def engine_venv_skip_reason(py: str, engine: str, group: str, timeout: float = 120) -> str | None:
    """Why the engine's venv at `py` cannot serve the tests (missing, kvtrace's entry point not in
    `group`, or not running), or None."""
    if not Path(py).exists():
        return f"needs the {engine} venv ({py})"
    probe = ("from importlib.metadata import entry_points; import sys;"
             f"sys.exit(0 if any(e.name == 'kvtrace' for e in entry_points(group={group!r})) else 3)")
    r = subprocess.run([py, "-c", probe], capture_output=True, timeout=timeout)
    if r.returncode == 3:
        return f"kvtrace is not installed in the {engine} venv: {Path(py).parent}/pip install --no-deps -e <repo>"
    if r.returncode:
        return f"the {engine} venv does not run: {r.stderr.decode(errors='replace')[-300:]}"
    return None


def link_tree(src: Path, dst: Path, hard: bool = False) -> None:
    """dst: src's directories made again, its files as links to src's (no __pycache__), so a test
    can replace one file with a changed copy.  ``hard``: hard links (copies across filesystems),
    for a tree kvtrace reads from outside, where it follows no symbolic link."""
    import os
    import shutil

    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if not hard:
                (dst / rel / f).symlink_to(Path(dirpath) / f)
                continue
            try:
                os.link(Path(dirpath) / f, dst / rel / f)
            except OSError:
                shutil.copy2(Path(dirpath) / f, dst / rel / f)


def tree_state(d) -> list:
    """Every entry below ``d`` with its mode, owner and (for files) bytes, links not followed:
    what a hostile-neighbour test compares before and after to show nothing was touched."""
    import os

    out = []
    for dirpath, dirs, files in os.walk(d):
        for n in sorted(dirs + files):
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out.append((p, st.st_mode, st.st_uid, st.st_gid, Path(p).read_bytes() if os.path.isfile(p) and not os.path.islink(p) else None))
    return out


class Attached:
    """`kvtrace attach --quiet --port PORT --out OUT` run as a user runs it, in a with block: on
    entry, once the hook is injected in ``engines`` engines (and has read the agent flag, which
    it does once a second); on exit, stopped with SIGINT, which must end it with 0."""

    def __init__(self, port: int | list[int], out: Path, *extra: str, engines: int = 1, timeout: float = 240,
                 env: dict | None = None):
        import os
        import sys

        self.out, self.engines, self.timeout = out, engines, timeout
        self.err = out.parent / f"{out.name}.stderr"
        ports = [a for p in (port if isinstance(port, list) else [port]) for a in ("--port", str(p))]
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", *ports,
                                      "--out", str(out), *extra], stderr=open(self.err, "wb"),
                                     cwd=Path(__file__).resolve().parents[1], env={**os.environ, **(env or {})})

    def injected(self) -> bool:
        assert self.proc.poll() is None, self.err.read_text(errors="replace")[-3000:]
        return self.err.read_text(errors="replace").count("injected in engine") >= self.engines

    def __enter__(self) -> "Attached":
        try:
            wait_for(self.injected, self.timeout, "the hook's injection")
        except BaseException:
            self.stop()
            raise
        time.sleep(1.2)
        return self

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(180) == 0, self.err.read_text(errors="replace")[-3000:]

    def __exit__(self, *exc) -> None:
        self.stop()
