"""install() / uninstall() / status() and the choice of roles by process.

install() makes a plan from kvtrace.hook.vllm.targets for each role: every target of
kvtrace.hook.vllm.needs the role relies on is checked (on vLLM's source, or by the agent before
it injected the hook: ``checked``), and the wrapped methods on the imported classes.  It patches
only when nothing differs (kvtrace.hook.patch), whatever vLLM's version.  Never raises: a vLLM
that differs is left untouched, with one warning naming the first difference.  An installed hook
registers its uninstall with the shared state (``state.on_leave``): an injected hook leaves when
the agent that injected it is gone.
"""
from __future__ import annotations

import multiprocessing
import os
import time

from .. import state
from ..patch import _patch, _unpatch_all
from ..source import SourceTree
from ..state import HOOK_VERSION, _flush, record_transfer
from ..support import first
from . import engine, releases, worker
from .targets import PLANS, _live_connector, _patch_live_connector

# (bound by assignment: see kvtrace.hook.vllm.engine)
S, T, W, _REGISTRY, _STATUS, log, _HOT_IN = engine.S, state.T, worker.W, state._REGISTRY, state._STATUS, engine.log, engine._HOT_IN


def detect_roles() -> list[str]:
    """Roles for this process from its multiprocessing name (vLLM titles processes later)."""
    env = os.environ.get("KVTRACE_HOOK_ROLES")
    if env:
        return [r for r in env.replace(",", " ").split() if r in ("engine", "worker")]
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        # with the uni executor (GPU, TP=1) the worker runs inside EngineCore
        return ["engine", "worker"]
    if name.startswith(("VllmWorker", "Worker")):
        return ["worker"]
    return []


def install(roles: list[str] | None = None, live: bool = False, checked: dict | None = None) -> bool:
    """Patch vLLM for these roles ("engine", "worker"; default: by process).  Idempotent.

    ``checked``: the agent's verdict on this vLLM's files (kvtrace.hook.vllm.support.check), used
    when those files are unchanged.  Returns True when something is patched.  Never raises: a
    vLLM that differs from what the hook reads is left untouched, with one message naming
    the first difference.
    """
    try:
        roles = detect_roles() if roles is None else list(roles)
        if live and "worker" in roles and _live_connector() is None:
            # injected after start-up into a worker without a KV connector: nothing to time here
            roles = [r for r in roles if r != "worker"]
            if not roles:
                _STATUS["reason"] = "no KV connector in this worker: nothing to hook"
                return False
        if not roles:
            _STATUS["reason"] = f"no role in process {multiprocessing.current_process().name!r}"
            return False
        if _STATUS["installed"] and set(roles) <= set(_STATUS["roles"]):
            return True
        version = releases.version()
        prior = _still_valid(checked)
        plan, bad = [], []
        for role in ("engine", "worker"):
            if role in roles:
                p, b = PLANS[role](prior["roles"][role] if prior else None)
                plan += p
                bad += b
        if bad:
            _STATUS["differences"] = bad
            return _inert(f"vLLM {version} differs: {first(bad)}")
        for cls, attr, wrap in plan:
            _patch(cls, attr, wrap)
        if "worker" in roles:
            _patch_live_connector()
        try:
            from kvtrace.hook import api  # lazy: the api connectors import by name (a private copy of the hook may lack it)

            api._sink = record_transfer
        except Exception:
            pass
        state.on_leave(_left)
        _STATUS.update(installed=True, roles=sorted(set(_STATUS["roles"]) | set(roles)), reason="", differences=[],
                       kind="vllm")
        log.info("kvtrace hook %s installed (%s) on vLLM %s: %d methods wrapped; records flow while a kvtrace agent is attached",
                 HOOK_VERSION, "+".join(roles), version, len(_REGISTRY))
        return True
    except Exception as e:  # never break vLLM start-up
        uninstall()
        return _inert(f"install failed: {type(e).__name__}: {e}")


def _still_valid(checked: dict | None) -> dict | None:
    """The agent's verdict when the files it read are this vLLM's, unchanged; else None."""
    try:
        if checked and SourceTree.of_imported_vllm().unchanged(checked["files"]):
            _STATUS["checked_by"] = "agent"
            releases.know(checked["releases"])
            return checked
    except Exception:
        pass
    _STATUS["checked_by"] = "hook"
    return None


def _inert(reason: str) -> bool:
    _STATUS.update(installed=False, reason=reason)
    log.warning("kvtrace hook inactive (nothing patched): %s", reason)
    return False


def uninstall() -> None:
    """Restore every wrapped attribute (also those left by another copy of this module)."""
    S.rec = False
    _unpatch_all()
    _HOT_IN[0] = True
    try:
        from kvtrace.hook import api  # lazy: the api connectors import by name (a private copy of the hook may lack it)

        if api._sink is record_transfer:
            api._sink = None
    except Exception:
        pass
    try:
        _flush(time.monotonic_ns())
    except Exception:
        pass
    S.reset()
    W.active = W.on = False
    _STATUS.update(installed=False, roles=[], patched=[], reason="uninstalled")


def _left(pid: int) -> None:
    """The agent that injected the hook (pid) is gone: vLLM is restored (state.on_leave)."""
    uninstall()
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)


def status() -> dict:
    return {**_STATUS, "patched": list(_STATUS["patched"]), "emitted": T.emitted,
            "dropped": T.dropped, "errors": T.errors, "last_error": T.last_error}
