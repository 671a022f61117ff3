"""A real SGLang server (CPU engine, tests/sglang/stub for its one kernel op) for the SGLang tests."""
from __future__ import annotations

import subprocess
from pathlib import Path

from kvtrace.demo.sglang_server import sglang_python

STUB = str(Path(__file__).resolve().parent / "stub")


def sglang_skip_reason() -> str | None:
    py = sglang_python()
    if not Path(py).exists():
        return f"needs the SGLang venv ({py}; make setup-sglang, or set KVTRACE_SGLANG_PYTHON)"
    probe = ("from importlib.metadata import entry_points; import sys, sglang;"
             "sys.exit(0 if any(e.name == 'kvtrace' for e in entry_points(group='sglang.srt.plugins')) else 3)")
    r = subprocess.run([py, "-c", probe], capture_output=True, timeout=120)
    if r.returncode == 3:
        return f"kvtrace is not installed in the SGLang venv: {Path(py).parent}/pip install --no-deps -e <repo>"
    if r.returncode:
        return f"the SGLang venv does not run: {r.stderr.decode(errors='replace')[-300:]}"
    return None
