"""vLLM plugin entry point (``vllm.general_plugins``: kvtrace = kvtrace.hook.vllm.plugin:register).

vLLM calls register() once in every process it starts (API server, EngineCore, workers).  The
hook patches EngineCore and worker classes only; elsewhere it does nothing.  Active with no
flags whenever kvtrace is installed in vLLM's environment; KVTRACE_HOOK=0 (or vLLM's own
VLLM_PLUGINS filter) turns it off.  register() never raises: vLLM does not guard plugin calls.
"""
from __future__ import annotations

import logging
import os


def register() -> None:
    try:
        if os.environ.get("KVTRACE_HOOK", "1") == "0":
            return
        from . import hook  # lazy: register() costs nothing when KVTRACE_HOOK=0

        if hook.detect_roles():
            hook.install()
    except Exception as e:  # pragma: no cover - defensive: a plugin error must not stop vLLM
        try:
            logging.getLogger("vllm.kvtrace_hook").warning("kvtrace hook inactive (nothing patched): %s: %s", type(e).__name__, e)
        except Exception:
            pass
