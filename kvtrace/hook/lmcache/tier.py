"""The hook's wrappers in LMCache's multiprocess server: what the tier did for each request, as
records on the shared queue (kvtrace.hook.state), sent every FLUSH_EVERY_NS by a timer thread.

  StorageManager.submit_prefetch_task       the engine's request id of each lookup (its prefetch id)
  StorageManager.query_prefetch_status      tier_lookup: the lookup's chunks, hit in L1, hit in L2
  PrefetchController._submit_load_tasks     which L2 load task reads for which lookup
  FSL2Adapter._execute_load (coroutine)     tier_op l2_read: an L2 load, disk -> L1 (keys, bytes, time)
  FSL2Adapter._execute_store (coroutine)    tier_op l2_write: L1 -> disk (no request: batches mix them)
  PickleTransferStrategy.prepare_retrieve   tier_op retrieve: L1 -> the engine (tokens, bytes, time)
  PickleTransferStrategy.commit_store       tier_op store: the engine -> L1
  L1EvictionController.execute_eviction_action   tier_op evict: keys the L1 eviction loop dropped

Every wrapper runs only while an agent is attached (the flag, re-read once a second) and never
raises into LMCache.  Token ids never leave the process: keys are counted, not sent.
"""
from __future__ import annotations

import threading

from .. import state
from ..state import FLUSH_EVERY_NS, HOOK_VERSION, MAX_TRACKED, _enqueue, _flush, _monotonic_ns, _new_agent, _refresh

T = state.T
TIER = "lmcache"


class _Tier:
    """The hook's state in the server: the agents seen, each lookup's request, each L2 task's lookup."""

    __slots__ = ("seen_check", "agents", "version", "lookups", "tasks", "timer", "lock")

    def __init__(self):
        self.version = "?"
        self.lock = threading.Lock()
        self.timer = None
        self.reset()

    def reset(self):
        self.seen_check = 0
        self.agents: frozenset = frozenset()
        self.lookups: dict[int, str] = {}            # prefetch request id -> the engine's request id
        self.tasks: dict[tuple[int, int], int] = {}  # (adapter, L2 task id) -> prefetch request id


G = _Tier()


def _on() -> bool:
    """Records wanted: an agent is attached (a new one gets its hook_start, role "tier": no
    `engine` record, which names a serving engine)."""
    on = _refresh() if _monotonic_ns() >= T.next_check else T.enabled
    if on and _new_agent(G):
        _enqueue(("hook_start", _monotonic_ns(), "tier", G.version, HOOK_VERSION))
    return on


def _queue(rec: tuple) -> None:
    """Queue a record and make sure a send follows within FLUSH_EVERY_NS (the server has no
    step of its own at whose end to send)."""
    _enqueue(rec)
    with G.lock:
        if G.timer is None:
            G.timer = threading.Timer(FLUSH_EVERY_NS / 1e9, _send)
            G.timer.daemon = True
            G.timer.start()


def _send() -> None:
    with G.lock:
        G.timer = None
    try:
        _flush(_monotonic_ns())
    except Exception as e:   # never into LMCache
        T.error(e)


def _bound(d: dict) -> None:
    if len(d) >= MAX_TRACKED:
        d.clear()


# ---------------------------------------------------------------------------------------------
# Lookups: the request, then the lookup's result


def submit_pre(self, spec, external_request_id):
    return external_request_id if _on() else None


def submit_post(self, rid, handle) -> None:
    try:
        _bound(G.lookups)
        G.lookups[handle.prefetch_request_id] = str(rid)
    except Exception as e:
        T.error(e)


def query_pre(self, handle):
    return handle if _on() else None


def query_post(self, handle, result) -> None:
    """The lookup is done (a result, once): its chunks per key row, and which hit L1 or L2."""
    if result is None:
        return
    try:
        rows = max(len(result.l1_hit_cells), 1)
        l2 = result.l2_hit_cells[0].get_indices_list() if result.l2_hit_cells else []
        _queue(("tier_lookup", _monotonic_ns(), str(handle.external_request_id), handle.total_requested_keys // rows,
                result.l1_hit_count // rows, result.l2_hit_count // rows, [int(i) for i in l2][:448], TIER))
    except Exception as e:
        T.error(e)


# ---------------------------------------------------------------------------------------------
# L2 loads: which lookup each task reads for, then the read itself


def tasks_pre(self, request, reserved_objs):
    return request if _on() else None


def tasks_post(self, request, _r) -> None:
    try:
        adapters = self._l2_adapters
        _bound(G.tasks)
        for l2_idx, task_id in request.inflight_load_tasks.items():
            G.tasks[(id(adapters[l2_idx]), task_id)] = request.request_id
    except Exception as e:
        T.error(e)


def _nbytes(objects) -> int:
    return sum(int(o.get_size()) for o in objects)


def async_timed(op: str):
    """The wrapper factory of an L2 adapter's coroutine: awaited as LMCache awaits it, timed
    around it, a tier_op when it ends (raised or not)."""
    def wrap(orig):
        async def timed(self, keys, objects, task_id):
            if not _on():
                return await orig(self, keys, objects, task_id)
            t0 = _monotonic_ns()
            ok = 0
            try:
                r = await orig(self, keys, objects, task_id)
                ok = 1
                return r
            finally:
                _io_done(self, op, keys, objects, task_id, t0, ok)
        timed.__name__ = orig.__name__
        timed.__qualname__ = getattr(orig, "__qualname__", orig.__name__)
        return timed

    return wrap


def _io_done(adapter, op: str, keys, objects, task_id, t0: int, ok: int) -> None:
    try:
        t1 = _monotonic_ns()
        rid = ""
        if op == "l2_read":
            pf = G.tasks.pop((id(adapter), task_id), None)
            rid = G.lookups.get(pf, "") if pf is not None else ""
            done = getattr(adapter, "_completed_load_tasks", {}).get(task_id)
            if ok and done is not None and hasattr(done, "popcount"):
                ok = 1 if done.popcount() == len(keys) else 0
        _queue(("tier_op", t0, t1, rid, op, len(keys), 0, _nbytes(objects), ok, TIER))
    except Exception as e:
        T.error(e)


# ---------------------------------------------------------------------------------------------
# The engine's transfers (its workers' RPCs) and L1 evictions


def xfer_pre(self, key, instance_id, *extra):
    return (_monotonic_ns(), key, extra[0] if extra else None) if _on() else None


def retrieve_post(self, t, resp) -> None:
    t0, key, _ = t
    try:
        _queue(("tier_op", t0, _monotonic_ns(), str(key.request_id), "retrieve", 0, int(key.end - key.start),
                len(resp.data or b""), 1 if resp.success else 0, TIER))
    except Exception as e:
        T.error(e)


def store_post(self, t, ok) -> None:
    t0, key, data = t
    try:
        _queue(("tier_op", t0, _monotonic_ns(), str(key.request_id), "store", 0, int(key.end - key.start),
                len(data or b""), 1 if ok else 0, TIER))
    except Exception as e:
        T.error(e)


def evict_pre(self, action):
    return (_monotonic_ns(), action) if _on() else None


def evict_post(self, t, _r) -> None:
    t0, action = t
    try:
        _queue(("tier_op", t0, _monotonic_ns(), "", "evict", len(action.keys), 0, 0, 1, TIER))
    except Exception as e:
        T.error(e)
