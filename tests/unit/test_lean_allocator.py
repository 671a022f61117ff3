"""`kvtrace attach` runs with Arrow on glibc's allocator (kvtrace.cli._lean_allocator), so the
pipeline's malloc_trim returns freed Arrow buffers; other commands keep Arrow's default."""
from __future__ import annotations

import subprocess
import sys

PROBE = ("import sys, kvtrace.cli as c; c._register = lambda: None; c.cli.main = lambda **k: 0\n"
         "try:\n    c.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "import pyarrow as pa; print(pa.default_memory_pool().backend_name)")


def backend(*args: str, env: dict | None = None) -> str:
    import os

    e = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env={**e, **(env or {})}, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()[-1]


def test_attach_uses_the_system_allocator_and_others_do_not():
    assert backend("attach", "--help") == "system"
    default = backend("summary", "--help")
    assert default != "system"
    assert backend("attach", "--help", env={"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"}) in ("jemalloc", default)
