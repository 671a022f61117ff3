"""The vLLM plugin entry point under its earlier name, kept for one release: kvtrace 0.2.0
removes it.  Its place is kvtrace.hook.vllm.plugin (pyproject.toml's ``vllm.general_plugins``
names that); an environment whose entry-point metadata still names this one loads the same hook.
"""
from __future__ import annotations

from .vllm.plugin import register

__all__ = ["register"]
