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

import logging

from .. import classhook, plan, state
from ..source import SourceTree
from . import needs, tier
from .tier import G

T, _REGISTRY, _STATUS = state.T, state._REGISTRY, state._STATUS
log = logging.getLogger("lmcache.kvtrace_hook")
set_owner, HOOK_VERSION = state.set_owner, state.HOOK_VERSION


_wrap = classhook.decorated

WRAPPERS = {
    "StorageManager.submit_prefetch_task": _wrap(tier.submit_pre, tier.submit_post,
                                                 names=("spec", "external_request_id")),
    "StorageManager.query_prefetch_status": _wrap(tier.query_pre, tier.query_post, names=("handle",)),
    "PrefetchController._submit_load_tasks": _wrap(tier.tasks_pre, tier.tasks_post, names=("request", "reserved_objs")),
    "FSL2Adapter._execute_load": tier.async_timed("l2_read"),
    "FSL2Adapter._execute_store": tier.async_timed("l2_write"),
    "PickleTransferStrategy.prepare_retrieve": _wrap(tier.xfer_pre, tier.retrieve_post, names=("key", "instance_id")),
    "PickleTransferStrategy.commit_store": _wrap(tier.xfer_pre, tier.store_post,
                                                 names=("key", "instance_id", "cpu_data")),
    "L1EvictionController.execute_eviction_action": _wrap(tier.evict_pre, tier.evict_post, names=("action",)),
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
        items = classhook.items(needs.METHODS, bad, WRAPPERS)
        G.version = version
        if not classhook.apply(items, bad, kind="lmcache", title="LMCache", version=version, role="tier", log=log,
                               left=_left):
            return False
        log.info("kvtrace hook %s installed (tier) in LMCache %s's server: %d methods wrapped; records flow while "
                 "a kvtrace agent is attached", HOOK_VERSION, version, len(_REGISTRY))
        return True
    except Exception as e:  # never break LMCache
        uninstall()
        return classhook.inert(f"install failed: {type(e).__name__}: {e}", log)


def uninstall() -> None:
    """Restore every wrapped attribute and send what is queued."""
    classhook.unpatch()
    G.reset()


def _left(pid: int) -> None:
    """The agent that injected the hook (pid) is gone: LMCache is restored (state.on_leave)."""
    uninstall()
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)


def status() -> dict:
    return classhook.status("lmcache")
