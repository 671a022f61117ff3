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

import importlib
import inspect
import logging
import os

from .. import plan, state
from ..exact import exact, why_not
from ..patch import _patch, _unpatch_all
from ..source import SourceTree
from ..support import first
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


def _wrap(pre, post, abort=None, names=()):
    """The wrapper factory of one method: pre, the method, post, with the method's own
    parameters (those of the function a decorator wraps, where one does)."""
    def wrap(orig):
        inner = inspect.unwrap(orig)
        return exact(orig, pre, post, abort or (lambda self, t: None), names, orig.__name__,
                     params_of=inner if inner is not orig else None)

    return wrap


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
        items = []
        for m in needs.METHODS:
            if any(b.startswith(m.label + ":") for b in bad):
                continue
            cls = getattr(importlib.import_module(m.module), m.cls)
            why = _live_differs(cls, m)
            if why:
                bad.append(f"{m.label}: {why}")
            items.append((cls, m.name, WRAPPERS[m.label]))
        if bad:
            _STATUS.update(installed=False, reason=f"SGLang {version} differs: {first(bad)}", differences=bad)
            log.warning("kvtrace hook inactive (nothing patched): %s", _STATUS["reason"])
            return False
        G.version = f"{version}"
        for cls, attr, wrap in items:
            _patch(cls, attr, wrap)
        state.on_leave(_left)
        _STATUS.update(installed=True, roles=["engine"], reason="", differences=[], kind="sglang")
        log.info("kvtrace hook %s installed (engine) on SGLang %s: %d methods wrapped; records flow while a "
                 "kvtrace agent is attached", HOOK_VERSION, version, len(_REGISTRY))
        return True
    except Exception as e:  # never break SGLang
        uninstall()
        _STATUS.update(installed=False, reason=f"install failed: {type(e).__name__}: {e}")
        log.warning("kvtrace hook inactive (nothing patched): %s", _STATUS["reason"])
        return False


def _unchanged(checked: dict) -> bool:
    try:
        return SourceTree.of_imported("sglang").unchanged(checked["files"])
    except Exception:
        return False


def _live_differs(cls, m) -> str | None:
    """The method on the imported class, through a decorator's wrapper to the function it wraps."""
    raw = plan._original(cls, m.name)
    if raw is None:
        return "missing"
    inner = inspect.unwrap(raw)
    return why_not(inner, tuple(p for p in m.params if p != "self"))


def uninstall() -> None:
    """Restore every wrapped attribute."""
    G.rec = False
    _unpatch_all()
    try:
        state._flush(state._monotonic_ns())
    except Exception:
        pass
    G.reset()
    _STATUS.update(installed=False, roles=[], patched=[], reason="uninstalled")


def _left(pid: int) -> None:
    """The agent that injected the hook (pid) is gone: SGLang is restored (state.on_leave)."""
    uninstall()
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)


def status() -> dict:
    return {**_STATUS, "patched": list(_STATUS["patched"]), "emitted": T.emitted, "dropped": T.dropped,
            "errors": T.errors, "last_error": T.last_error, "kind": "sglang"}


def detect_roles() -> list[str]:
    return ["engine"] if os.environ.get("KVTRACE_HOOK", "1") != "0" else []
