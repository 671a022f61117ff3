"""What the hook patches in vLLM, and with what: the wrapper of each method that
kvtrace.hook.vllm.needs lists, and the plan of each role: its methods with their wrappers,
after every target of the role passed its check (kvtrace.hook.plan).  install()
(kvtrace.hook.vllm.install) patches nothing unless the whole plan of each of its roles passes.
Differences between vLLM releases are kvtrace.hook.vllm.releases's rows; two of them choose a
wrapper variant here (engine_wrappers).

vLLM is imported only when a plan is made, inside install(); the patching itself is
kvtrace.hook.patch.
"""
from __future__ import annotations

import importlib

from .. import plan, state
from ..exact import exact, inline, why_not, wrapper
from ..patch import _patch, _signature_differs
from ..source import SourceTree
from ..state import _monotonic_ns
from . import connector, engine, needs, releases, worker
from .engine import (ALLOC_PARAMS, ALLOCATE_BODY, EVICT_BODY, EVICT_BODY_ONE_HASH, _note_admission_alloc, _note_evict,
                     _preempt_post, _preempt_pre, _schedule_post, _schedule_pre, _schedule_pre_counting, _update_post,
                     _update_pre)
from .worker import (LAYER_BODY, LOAD_BODY, SAVE_BODY, SAVE_LAYER_BODY, _bind_pre, _layer_done, _load_done,
                     _save_done, _save_end, _save_layer_done, _timed_pre)

# (bound by assignment: see kvtrace.hook.vllm.engine)
S, T, W, log = engine.S, state.T, worker.W, engine.log


# ---------------------------------------------------------------------------------------------
# Wrapper factories: each takes vLLM's method and returns the function that replaces it


def _nothing(self, t) -> None:
    """abort: nothing to undo when vLLM's method raised."""


def _nothing_after(self, t, out) -> None:
    """post: nothing to do after vLLM's method."""


# What the inlined wrappers' bodies (engine.ALLOCATE_BODY, EVICT_BODY; worker.LOAD_BODY,
# LAYER_BODY, SAVE_BODY) call and read: their globals.
_ENV = {"_kv_S": S, "_kv_W": W, "_kv_mono": _monotonic_ns, "_kv_error": T.error,
        "_kv_admission": _note_admission_alloc, "_kv_note_evict": _note_evict, "_kv_save_end": _save_end,
        "_kv_ext_alloc": connector.note_alloc}


def _exactly(pre, post, abort=_nothing, names=()):
    """The wrapper factory of an engine method: pre, the method, post, in a function with the
    method's own parameters (kvtrace.hook.exact)."""
    def wrap(orig):
        return exact(orig, pre, post, abort, names, orig.__name__)

    wrap.why_not = lambda func: why_not(func, names)
    return wrap


def _inlined(body: str, names=()):
    """The wrapper factory of a hot engine method: ``body`` written into a function with the
    method's own parameters (kvtrace.hook.exact inline)."""
    def wrap(orig):
        return inline(orig, body, _ENV, names, orig.__name__)

    wrap.why_not = lambda func: why_not(func, names)
    return wrap


def _any_params(pre, post, abort, body=None):
    """The wrapper factory of a connector method: ``body`` written into a function with its
    own parameters where they are all plain, else kvtrace.hook.exact.wrapper (pre, the
    method, post; through *args/**kwargs where the parameters are not plain)."""
    def wrap(orig):
        if body is not None and why_not(orig) is None:
            return inline(orig, body, _ENV, (), orig.__name__)
        return wrapper(orig, pre, post, abort, orig.__name__)

    return wrap


# ---------------------------------------------------------------------------------------------
# EngineCore


def engine_wrappers() -> dict:
    """The wrapper factory of each method of needs.ENGINE_METHODS, by its label.  Two rows of
    kvtrace.hook.vllm.releases choose a variant: step_counter (before 0.23 the hook numbers the
    scheduler's steps) and block_hash_sets (before 0.24 a cached block holds one hash)."""
    return {
        "Scheduler.schedule": _exactly(_schedule_pre if releases.has("step_counter") else _schedule_pre_counting,
                                       _schedule_post),
        "Scheduler.update_from_output": _exactly(_update_pre, _update_post, names=("scheduler_output", "model_runner_output")),
        "Scheduler._preempt_request": _exactly(_preempt_pre, _preempt_post, names=("request",)),
        "KVCacheManager.allocate_slots": _inlined(ALLOCATE_BODY, ALLOC_PARAMS),
        "Scheduler._update_from_kv_xfer_finished": _exactly(connector.xfer_pre, connector.xfer_post,
                                                            names=("kv_connector_output",)),
        "Scheduler._connector_finished": _exactly(connector.finished_pre, connector.finished_post,
                                                  names=("request",)),
        "BlockPool._maybe_evict_cached_block": _inlined(EVICT_BODY if releases.has("block_hash_sets")
                                                        else EVICT_BODY_ONE_HASH, ("block",)),
    }


def _class(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def role_plan(methods, reads, wrappers: dict, checked: list[str] | None) -> tuple[list, list[str]]:
    """([(class, method, wrapper factory)], what differs: "target: what", the first first).
    ``checked``: the source check's differences when the agent already made it on these very
    files (kvtrace.hook.vllm.install), else None: the check is made here.  The wrapped methods are
    also checked on the imported classes, which their wrappers are made from."""
    bad = list(checked) if checked is not None else plan.differences(methods + reads, SourceTree.of_imported_vllm())
    items = []
    for m in methods:
        if any(b.startswith(m.label + ":") for b in bad):
            continue
        cls = _class(m.module, m.cls)
        wrap = wrappers[m.label]
        why = m.live() or getattr(wrap, "why_not", lambda f: None)(plan._original(cls, m.name))
        if why:
            bad.append(f"{m.label}: {why}")
        items.append((cls, m.name, wrap))
    return items, bad


def engine_plan(checked=None) -> tuple[list, list[str]]:
    return role_plan(needs.ENGINE_METHODS, needs.ENGINE_READS, engine_wrappers(), checked)


# ---------------------------------------------------------------------------------------------
# Worker: the connector API, on each connector's own class


# The connector API (needs.CONNECTOR_API) -> its wrapper factory: with the method's own
# parameters where they are all plain (kvtrace.hook.exact; wait_for_layer_load runs once per
# layer and step), else through *args/**kwargs (start_load_kv takes **kwargs in vLLM's base
# class).  Checked on the base class with the worker's plan and on each connector class patched.
CONNECTOR_METHODS = {
    "bind_connector_metadata": _any_params(_bind_pre, _nothing_after, _nothing),
    "start_load_kv": _any_params(_timed_pre, _load_done, _load_done, LOAD_BODY),
    "wait_for_layer_load": _any_params(_timed_pre, _layer_done, _layer_done, LAYER_BODY),
    "save_kv_layer": _any_params(_timed_pre, _save_layer_done, _save_layer_done, SAVE_LAYER_BODY),
    "wait_for_save": _any_params(_timed_pre, _save_done, _save_done, SAVE_BODY),
}
_API = {m.name: m for m in needs.CONNECTOR_API}


def worker_plan(checked=None) -> tuple[list, list[str]]:
    """The connector factory, patched to patch the class of each connector it makes."""
    return role_plan(needs.WORKER_METHODS, needs.WORKER_READS,
                     {"KVConnectorFactory.create_connector": _wrap_create_connector}, checked)


def _wrap_create_connector(orig_func):
    """KVConnectorFactory.create_connector (a classmethod): patch the class of what it creates."""

    def create_connector(cls, *args, **kwargs):
        conn = orig_func(cls, *args, **kwargs)
        try:
            _patch_connector_class(type(conn))
        except Exception as e:
            T.error(e)
            log.warning("kvtrace hook: KV connector %s not traced: %s", type(conn).__name__, e)
        return conn

    return create_connector


def _patch_connector_class(cls: type) -> None:
    bad = []
    for name in CONNECTOR_METHODS:
        why = _signature_differs(getattr(cls, name, None), list(_API[name].params), strict=False)
        if why:
            bad.append(f"{cls.__name__}.{name} {why}")
    if bad:
        log.warning("kvtrace hook: KV connector %s not traced: %s", cls.__name__, "; ".join(bad))
        return
    for name, wrap in CONNECTOR_METHODS.items():
        _patch(cls, name, wrap)


def live_connector():
    """The connector vLLM made in this process before install(), if any."""
    return getattr(importlib.import_module(needs.STATE), "_KV_CONNECTOR_AGENT", None)


def _live_connector():
    """live_connector(), or None where vLLM cannot say (install's test for a live injection)."""
    try:
        return live_connector()
    except Exception:
        return None


def _patch_live_connector() -> None:
    """Live injection: a connector created before install() gets its class patched now."""
    try:
        conn = live_connector()
        if conn is not None:
            _patch_connector_class(type(conn))
    except Exception as e:
        T.error(e)


PLANS = {"engine": engine_plan, "worker": worker_plan}
