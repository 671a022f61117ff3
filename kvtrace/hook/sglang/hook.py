"""The hook inside SGLang's scheduler process: class-level wrappers (kvtrace.hook.sglang.engine)
that record SGLang's scheduler iterations, prefill chunks, radix-cache hits and evictions,
retractions, arrivals and finishes as the same records as vLLM's, sent through the process's
Transport (kvtrace.hook.state).

Loaded by SGLang's plugin entry point (``sglang.srt.plugins``: kvtrace.hook.sglang.plugin) or by
live injection (kvtrace.inject.loader, from the files this module imports: kvtrace.inject.stage),
which calls ``install()``.  The same rules as the vLLM hook: a wrapper never raises into SGLang,
records go to a bounded queue (full: counted drops), nothing is patched unless every target of
kvtrace.hook.sglang.needs checks out, and the hook removes itself when the agent that injected
it goes (its uninstall is registered with ``state.on_leave``).  Prompt token ids never leave the
process.
"""
from __future__ import annotations

import logging
import os

from .. import classhook, plan, state
from ..source import SourceTree
from . import needs
from .engine import (G, _alloc_done, _decode_alloc_pre, _evict_done, _evict_pre, _extend_alloc_pre, _next_post,
                     _next_pre, _queue_post, _queue_pre, _result_done, _result_pre, _retract_done, _retract_pre)

T, _REGISTRY, _STATUS = state.T, state._REGISTRY, state._STATUS
log = logging.getLogger("sglang.kvtrace_hook")
set_owner, HOOK_VERSION = state.set_owner, state.HOOK_VERSION


def _sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "?"))
    except Exception:
        return "?"


_wrap = classhook.decorated


WRAPPERS = {
    "Scheduler.get_next_batch_to_run": _wrap(_next_pre, _next_post),
    "Scheduler.process_batch_result": _wrap(_result_pre, _result_done, names=("batch",)),
    "Scheduler.update_running_batch": _wrap(_decode_alloc_pre, _alloc_done, _alloc_done, names=("batch",)),
    "Scheduler._add_request_to_queue": _wrap(_queue_pre, _queue_post, names=("req", "is_retracted")),
    "ScheduleBatch.prepare_for_extend": _wrap(_extend_alloc_pre, _alloc_done, _alloc_done),
    "ScheduleBatch.retract_decode": _wrap(_retract_pre, _retract_done),
    "UnifiedRadixCache._evict_device_leaf": _wrap(_evict_pre, _evict_done, names=("node_id",)),
}


def install(roles=None, live: bool = False, checked: dict | None = None) -> bool:
    """Patch SGLang's scheduler classes.  Idempotent; never raises (a SGLang that differs is left
    untouched, with one message naming the first difference)."""
    try:
        if _STATUS["installed"]:
            return True
        version = _sglang_version()
        prior = checked if checked and _unchanged(checked) else None
        bad = list(prior["roles"]["engine"]) if prior else plan.differences(
            needs.METHODS + needs.READS, SourceTree.of_imported("sglang"))
        items = classhook.items(needs.METHODS, bad, WRAPPERS)
        G.version = f"{version}"
        if not classhook.apply(items, bad, kind="sglang", title="SGLang", version=version, role="engine", log=log,
                               left=_left):
            return False
        log.info("kvtrace hook %s installed (engine) on SGLang %s: %d methods wrapped; records flow while a "
                 "kvtrace agent is attached", HOOK_VERSION, version, len(_REGISTRY))
        return True
    except Exception as e:  # never break SGLang
        uninstall()
        return classhook.inert(f"install failed: {type(e).__name__}: {e}", log)


def _unchanged(checked: dict) -> bool:
    try:
        return SourceTree.of_imported("sglang").unchanged(checked["files"])
    except Exception:
        return False


def uninstall() -> None:
    """Restore every wrapped attribute and send what is queued."""
    G.rec = False
    classhook.unpatch()
    G.reset()


def _left(pid: int) -> None:
    """The agent that injected the hook (pid) is gone: SGLang is restored (state.on_leave)."""
    uninstall()
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)


def status() -> dict:
    return classhook.status("sglang")


def detect_roles() -> list[str]:
    return ["engine"] if os.environ.get("KVTRACE_HOOK", "1") != "0" else []
