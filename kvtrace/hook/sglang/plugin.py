"""SGLang plugin entry point (``sglang.srt.plugins``: kvtrace = kvtrace.hook.sglang.plugin:register).

SGLang calls register() once in each process it starts (the HTTP server, the scheduler, the
detokenizer), before the scheduler is built.  The hook patches the scheduler's classes, which
only the scheduler process uses: elsewhere the wrappers are installed but never called.
KVTRACE_HOOK=0 (or SGLang's own SGLANG_PLUGINS filter) turns it off.  register() never raises.
"""
from __future__ import annotations

import logging
import os


def register() -> None:
    try:
        if os.environ.get("KVTRACE_HOOK", "1") == "0":
            return
        from . import hook  # lazy: register() costs nothing when KVTRACE_HOOK=0

        hook.install()
    except Exception as e:  # pragma: no cover - defensive: a plugin error must not stop SGLang
        try:
            logging.getLogger("sglang.kvtrace_hook").warning("kvtrace hook inactive (nothing patched): %s: %s",
                                                             type(e).__name__, e)
        except Exception:
            pass
