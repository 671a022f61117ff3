"""The SGLang plugin entry point under its earlier name, kept for one release: kvtrace 0.2.0
removes it.  Its place is kvtrace.hook.sglang.plugin (pyproject.toml's ``sglang.srt.plugins``
names that); an environment whose entry-point metadata still names this one loads the same hook.
"""
from __future__ import annotations

from .sglang.plugin import register

__all__ = ["register"]
