"""What the hook patches in vLLM, in one place: for each role the classes and methods it wraps,
the parameters it expects of each and the wrapper each gets, the fields of vLLM's data classes
the wrappers read, and the vLLM versions tested.  install() (kvtrace.hook.install) patches
nothing unless every check made here passes.  This is where differences between vLLM releases
belong, as one table per release family.  (The wrappers' work, in kvtrace.hook.engine and
kvtrace.hook.worker, reads further attributes of vLLM's objects; engine._engine_on checks the
Scheduler's at the first recorded step.)

vLLM is imported only when a plan is made, inside install(); the patching itself is
kvtrace.hook.patch.
"""
from __future__ import annotations

import importlib

from . import state
from .engine import (ALLOC_PARAMS, ALLOCATE_BODY, EVICT_BODY, _note_admission_alloc, _note_evict, _preempt_post,
                     _preempt_pre, _schedule_post, _schedule_pre, _update_post, _update_pre)
from .patch import _original, _patch, _signature_differs
from .state import _monotonic_ns, exact, inline, why_not, wrapper
from .worker import (LAYER_BODY, LOAD_BODY, SAVE_BODY, _bind_pre, _layer_done, _load_done, _save_done, _save_end,
                     _timed_pre)

S, T, W, log = state.S, state.T, state.W, state.log   # (bound by assignment: see kvtrace.hook.engine)

TESTED_VLLM = ("0.32.",)


# ---------------------------------------------------------------------------------------------
# Wrapper factories: each takes vLLM's method and returns the function that replaces it


def _nothing(self, t) -> None:
    """abort: nothing to undo when vLLM's method raised."""


def _nothing_after(self, t, out) -> None:
    """post: nothing to do after vLLM's method."""


# What the inlined wrappers' bodies (engine.ALLOCATE_BODY, EVICT_BODY; worker.LOAD_BODY,
# LAYER_BODY, SAVE_BODY) call and read: their globals.
_ENV = {"_kv_S": S, "_kv_W": W, "_kv_mono": _monotonic_ns, "_kv_error": T.error,
        "_kv_admission": _note_admission_alloc, "_kv_note_evict": _note_evict, "_kv_save_end": _save_end}


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


# (module, class, method, its leading parameters, wrapper factory).  Checked strictly: no other
# required parameter, and every parameter plain (the wrapper spells them all out).
ENGINE_METHODS = [
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", ["self", "throttle_prefills"],
     _exactly(_schedule_pre, _schedule_post)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output",
     ["self", "scheduler_output", "model_runner_output"],
     _exactly(_update_pre, _update_post, names=("scheduler_output",))),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request",
     ["self", "request", "timestamp", "drop_stale_output"],
     _exactly(_preempt_pre, _preempt_post, names=("request",))),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots",
     ["self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"],
     _inlined(ALLOCATE_BODY, ALLOC_PARAMS)),
    ("vllm.v1.core.block_pool", "BlockPool", "_maybe_evict_cached_block", ["self", "block"],
     _inlined(EVICT_BODY, ("block",))),
]

# Fields the engine wrappers read off vLLM's own data classes (dataclasses of this module).
ENGINE_FIELDS = ("vllm.v1.core.sched.output", {
    "SchedulerOutput": ["scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                        "total_num_scheduled_tokens", "preempted_req_ids", "finished_req_ids"],
    "CachedRequestData": ["resumed_req_ids"],
    "NewRequestData": ["req_id"],
})


def _class(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def engine_plan() -> tuple[list, list[str]]:
    """([(class, method, wrapper factory)], what differs from what the wrappers expect)."""
    plan, bad = [], []
    for module, cls_name, attr, want, wrap in ENGINE_METHODS:
        cls = _class(module, cls_name)
        why = _signature_differs(cls.__dict__.get(attr), want) or wrap.why_not(_original(cls, attr))
        if why:
            bad.append(f"{cls.__name__}.{attr} {why}")
        plan.append((cls, attr, wrap))
    return plan, bad + _engine_data_checks()


def _engine_data_checks() -> list[str]:
    import dataclasses

    module, want = ENGINE_FIELDS
    output = importlib.import_module(module)
    bad = []
    for cls_name, fields in want.items():
        cls = getattr(output, cls_name, None)
        have = {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else set()
        for f in fields:
            if f not in have:
                bad.append(f"{cls_name}.{f} is missing")
    return bad


# ---------------------------------------------------------------------------------------------
# Worker: the connector API, on each connector's own class


# method -> (its leading parameters, wrapper factory): with its own parameters where they are
# all plain (kvtrace.hook.exact; wait_for_layer_load runs once per layer and step), else through
# *args/**kwargs (start_load_kv takes **kwargs in vLLM's base class).  Checked leniently (other
# parameters may follow), on the base class at install and on each connector class patched.
CONNECTOR_METHODS = {
    "bind_connector_metadata": (["self", "connector_metadata"], _any_params(_bind_pre, _nothing_after, _nothing)),
    "start_load_kv": (["self", "forward_context"], _any_params(_timed_pre, _load_done, _load_done, LOAD_BODY)),
    "wait_for_layer_load": (["self", "layer_name"], _any_params(_timed_pre, _layer_done, _layer_done, LAYER_BODY)),
    "wait_for_save": (["self"], _any_params(_timed_pre, _save_done, _save_done, SAVE_BODY)),
}
CONNECTOR_BASE = ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1")
# the classmethod that makes each connector (patched: it patches the class of what it returns)
CONNECTOR_FACTORY = ("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory",
                     "create_connector", ["cls", "config", "role"])
# where a connector made before install() is (live injection)
LIVE_CONNECTOR = ("vllm.distributed.kv_transfer.kv_transfer_state", "_KV_CONNECTOR_AGENT")


def worker_plan() -> tuple[list, list[str]]:
    """([(class, method, wrapper factory)], what differs from what the wrappers expect)."""
    base = _class(*CONNECTOR_BASE)
    module, cls_name, attr, want = CONNECTOR_FACTORY
    factory = _class(module, cls_name)
    bad = []
    for name, (params, _) in CONNECTOR_METHODS.items():
        why = _signature_differs(getattr(base, name, None), params, strict=False)
        if why:
            bad.append(f"{base.__name__}.{name} {why}")
    raw = factory.__dict__.get(attr)
    if not isinstance(raw, classmethod):
        bad.append(f"{cls_name}.{attr} is not a classmethod")
    else:
        why = _signature_differs(raw.__func__, want, strict=False)
        if why:
            bad.append(f"{cls_name}.{attr} {why}")
    return [(factory, attr, _wrap_create_connector)], bad


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
    for name, (want, _) in CONNECTOR_METHODS.items():
        why = _signature_differs(getattr(cls, name, None), want, strict=False)
        if why:
            bad.append(f"{cls.__name__}.{name} {why}")
    if bad:
        log.warning("kvtrace hook: KV connector %s not traced: %s", cls.__name__, "; ".join(bad))
        return
    for name, (_, wrap) in CONNECTOR_METHODS.items():
        _patch(cls, name, wrap)


def live_connector():
    """The connector vLLM made in this process before install(), if any."""
    module, name = LIVE_CONNECTOR
    return getattr(importlib.import_module(module), name, None)


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
