"""The vLLM hook's module under its earlier name, kept for one release: kvtrace 0.2.0 removes
it.  Its place is kvtrace.hook.vllm.hook, which injection loads and the plugin installs; this
name gives the same functions of that module.
"""
from __future__ import annotations

from .vllm.hook import HOOK_VERSION, detect_roles, install, record_transfer, set_owner, status, uninstall

__all__ = ["HOOK_VERSION", "detect_roles", "install", "record_transfer", "set_owner", "status", "uninstall"]
