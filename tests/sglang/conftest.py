"""A real SGLang server (CPU engine, tests/sglang/stub for its one kernel op) for the SGLang tests."""
from __future__ import annotations

from pathlib import Path

from kvtrace.demo.sglang_server import sglang_python
from tests import helpers

STUB = str(Path(__file__).resolve().parent / "stub")


def sglang_skip_reason() -> str | None:
    py = sglang_python()
    reason = helpers.engine_venv_skip_reason(py, "SGLang", "sglang.srt.plugins")
    if reason and not Path(py).exists():
        return f"{reason}; make setup-sglang, or set KVTRACE_SGLANG_PYTHON"
    return reason
