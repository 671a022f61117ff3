"""The hook inside LMCache's multiprocess server: class-level wrappers (kvtrace.hook.lmcache.tier)
that record each lookup's L1 and L2 hits, each L2 read and write, the transfers to and from the
engine and L1 evictions, sent through the process's Transport (kvtrace.hook.state).

Injected live by the agent that traces the engine whose connector reaches this server
(kvtrace.attach.tiers; kvtrace.inject), which calls ``install()``.  The same rules as the
engines' hooks: a wrapper never raises into LMCache, records go to a bounded queue (full:
counted drops), nothing is patched unless every target of kvtrace.hook.lmcache.needs checks out,
and the hook removes itself when the agent that injected it goes.  Standard library only.
"""
from __future__ import annotations

import importlib
import inspect
import logging

from .. import plan, state
from ..exact import exact, why_not
from ..patch import _patch, _unpatch_all
from ..source import SourceTree
from ..support import first
from . import needs, tier
from .tier import G

T, _REGISTRY, _STATUS = state.T, state._REGISTRY, state._STATUS
log = logging.getLogger("lmcache.kvtrace_hook")
set_owner, HOOK_VERSION = state.set_owner, state.HOOK_VERSION


def _wrap(pre, post, names=()):
    """pre, the method, post, with the method's own parameters (those of the function a
    decorator wraps, where one does)."""
    def wrap(orig):
        inner = inspect.unwrap(orig)
        return exact(orig, pre, post, tier._none, names, orig.__name__,
                     params_of=inner if inner is not orig else None)

    return wrap


WRAPPERS = {
    "StorageManager.submit_prefetch_task": _wrap(tier.submit_pre, tier.submit_post, ("spec", "external_request_id")),
    "StorageManager.query_prefetch_status": _wrap(tier.query_pre, tier.query_post, ("handle",)),
    "PrefetchController._submit_load_tasks": _wrap(tier.tasks_pre, tier.tasks_post, ("request", "reserved_objs")),
    "FSL2Adapter._execute_load": tier.async_timed("l2_read"),
    "FSL2Adapter._execute_store": tier.async_timed("l2_write"),
    "PickleTransferStrategy.prepare_retrieve": _wrap(tier.xfer_pre, tier.retrieve_post, ("key", "instance_id")),
    "PickleTransferStrategy.commit_store": _wrap(tier.xfer_pre, tier.store_post, ("key", "instance_id", "cpu_data")),
    "L1EvictionController.execute_eviction_action": _wrap(tier.evict_pre, tier.evict_post, ("action",)),
}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:
        return "?"


def install(roles=None, live: bool = False, checked: dict | None = None) -> bool:
    """Patch LMCache's server classes.  Idempotent; never raises (an LMCache that differs is left
    untouched, with one message naming the first difference)."""
    try:
        if _STATUS["installed"]:
            return True
        version = _version()
        bad = plan.differences(needs.METHODS + needs.READS, SourceTree.of_imported("lmcache"))
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
            _STATUS.update(installed=False, reason=f"LMCache {version} differs: {first(bad)}", differences=bad)
            log.warning("kvtrace hook inactive (nothing patched): %s", _STATUS["reason"])
            return False
        G.version = version
        for cls, attr, wrap in items:
            _patch(cls, attr, wrap)
        state.on_leave(_left)
        _STATUS.update(installed=True, roles=["tier"], reason="", differences=[], kind="lmcache")
        log.info("kvtrace hook %s installed (tier) in LMCache %s's server: %d methods wrapped; records flow while "
                 "a kvtrace agent is attached", HOOK_VERSION, version, len(_REGISTRY))
        return True
    except Exception as e:  # never break LMCache
        uninstall()
        _STATUS.update(installed=False, reason=f"install failed: {type(e).__name__}: {e}")
        log.warning("kvtrace hook inactive (nothing patched): %s", _STATUS["reason"])
        return False


def _live_differs(cls, m) -> str | None:
    raw = plan._original(cls, m.name)
    if raw is None:
        return "missing"
    inner = inspect.unwrap(raw)
    if inspect.iscoroutinefunction(inner):
        return None if list(inspect.signature(inner).parameters)[:len(m.params)] == list(m.params) else \
            "parameters differ"
    return why_not(inner, tuple(p for p in m.params if p != "self"))


def uninstall() -> None:
    """Restore every wrapped attribute and send what is queued."""
    _unpatch_all()
    try:
        state._flush(state._monotonic_ns())
    except Exception:
        pass
    G.reset()
    _STATUS.update(installed=False, roles=[], patched=[], reason="uninstalled")


def _left(pid: int) -> None:
    """The agent that injected the hook (pid) is gone: LMCache is restored (state.on_leave)."""
    uninstall()
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)


def status() -> dict:
    return {**_STATUS, "patched": list(_STATUS["patched"]), "emitted": T.emitted, "dropped": T.dropped,
            "errors": T.errors, "last_error": T.last_error, "kind": "lmcache"}
