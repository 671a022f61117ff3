"""The hook's per-process state, shared by its engine and worker wrappers: the Transport, the
bounded record queue and its flush, the engine's and the worker's state objects, agent and
owner checks.  Standard library only (plus kvtrace.hook's exact/transport/wire, found by path
when kvtrace is not importable).

The wrappers' modules (kvtrace.hook.engine, kvtrace.hook.worker) bind what they use from here
as their own globals, once at import (functions and constants by ``from .state import``, the
objects by assignment, ``S = state.S``): a hot path then pays one global lookup per name, as
when the hook was one module, never an attribute lookup through this module.  So the state is
only ever changed in place (attributes of ``S``, ``W`` and ``T``; items of ``_last``,
``_OWNER``, ``_STATUS``, ``_REGISTRY``; ``_Q``'s contents), never rebound here.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time

# (exact, inline, why_not, wrapper and EVICTS_MAX are for the hook's other modules, which import
# them from here: the fallback below is then in one place)
try:
    from kvtrace.hook.exact import exact, inline, why_not, wrapper
    from kvtrace.hook.transport import Transport, agent_pids, owner_live
    from kvtrace.hook.wire import CODEC, EVICTS_MAX
except ImportError:  # imported from a path where kvtrace is not installed: use the sibling files
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, _root)
    try:
        from kvtrace.hook.exact import exact, inline, why_not, wrapper
        from kvtrace.hook.transport import Transport, agent_pids, owner_live
        from kvtrace.hook.wire import CODEC, EVICTS_MAX
    finally:
        sys.path.remove(_root)

HOOK_VERSION = "5"  # 2: evictions batched (wire record 13); 3: records sent every 100 ms (record 14);
# 4: one kv_step record per Worker step (record 15) instead of a kv_load and a kv_store;
# 5: records 16-19 for the miss causes (lookup, prompt_plain, cached, resume_blocks); vLLM checked, not versioned
MAX_QUEUE = 20000          # records waiting for their flush
# Engine records are sent at a step end once FLUSH_EVERY_NS have passed since the last send, once
# FLUSH_RECORDS are queued, or when the scheduler has no request left (the engine then waits for
# new ones, and the records must not wait with it).  A send is a system call, the hook's dearest
# operation, so a fast engine sends a frame for several steps; records carry their own times.
# (kvtrace.hook.engine and kvtrace.hook.worker read their own copies: set those to change it.)
FLUSH_EVERY_NS = 100_000_000
FLUSH_RECORDS = 256
# The Worker sends at a step end once FLUSH_EVERY_NS have passed; otherwise a sleeping thread
# sends FLUSH_EVERY_NS later, naming the Worker's thread in the frame (worker._Later).
MAX_TRACKED = 65536        # per-request state entries (chunk counters, admission info)
STATS_EVERY_NS = 1_000_000_000
API_FLUSH_AFTER_NS = 200_000_000  # kv_transfer() flushes itself when no step end did for this long
M64 = (1 << 64) - 1

log = logging.getLogger("vllm.kvtrace_hook")
_monotonic_ns = time.monotonic_ns

# The transport: one per process, shared by every wrapper and by kvtrace.hook.api.
T = Transport()
_Q: collections.deque = collections.deque()
_LOCK = threading.Lock()

# Module-global patch registry: (class, attribute) -> (had_own_attribute, original, wrapper).
_REGISTRY: dict[tuple[type, str], tuple[bool, object, object]] = {}
_STATUS: dict = {"installed": False, "roles": [], "patched": [], "reason": "not installed"}
_MARK = "__kvtrace_original__"


class _Engine:
    """EngineCore state, reset whenever the agent goes away."""

    __slots__ = ("on", "rec", "step", "cur_req", "last_alloc", "reqs", "alloc", "steps", "evicted", "ev",
                 "alloc_failures", "broken", "seen_check", "agents", "counting")

    def __init__(self):
        self.counting = False   # the hook numbers the steps (engine._schedule_pre_counting); kept over resets
        self.reset()

    def reset(self):
        self.on = False
        self.rec = False                      # records wanted (on, and vLLM's data as expected)
        self.step = 0
        self.cur_req = ""
        self.last_alloc = ""                  # the request of the latest allocate_slots (preemptions)
        self.reqs: dict[str, list] = {}      # request id -> [next chunk index, prefill_len, attempt] or _DECODING
        self.alloc: dict[str, tuple] = {}    # request id -> (local, external, hit blocks, last hash)
        self.steps: dict[int, tuple] = {}    # id(SchedulerOutput) -> step summary
        self.evicted = 0
        self.ev: list | None = None          # the open `evicts` batch: [step, t_ns, medium, request, blocks]
        self.alloc_failures = 0
        self.broken = ""
        self.seen_check = 0
        self.agents: frozenset = frozenset()   # the agents attached at the last flag check (_new_agent)


class _Worker:
    __slots__ = ("active", "on", "seen_check", "agents", "seq", "depth", "source", "t_bind", "load_t0",
                 "load_t1", "waits", "wait_ns", "last_wait_end")

    def __init__(self):
        self.active = False
        self.on = False
        self.seen_check = 0
        self.agents: frozenset = frozenset()
        self.seq = 0
        self.depth = 0
        self.source = ""
        self.begin(0)

    def begin(self, now):
        self.t_bind = now
        self.load_t0 = self.load_t1 = 0
        self.waits = self.wait_ns = self.last_wait_end = 0


S = _Engine()
W = _Worker()
_last = {"flush": 0, "stats": 0}


# ---------------------------------------------------------------------------------------------
# Emission


def _enqueue(rec: tuple) -> None:
    if len(_Q) < MAX_QUEUE:
        _Q.append(rec)
    else:
        T.dropped += 1


_ENCODERS = CODEC.encoders  # record name -> encoder taking the queued tuple (name first)


def _flush(now: int, made_on: int = 0) -> None:
    """Encode queued records and send them (step end; any thread): one encoder call per
    record, usually one marker write per flush.  ``made_on``: the native id of the thread the
    records were made on, when another thread sends them (a `thread` record heads each frame)."""
    with _LOCK:
        if not T.enabled:
            _Q.clear()
            return
        recs = []
        if _Q:
            popleft, append, enc = _Q.popleft, recs.append, _ENCODERS
            size, limit = 0, T.max_buffer
            while _Q:
                rec = popleft()
                try:
                    b = enc[rec[0]](*rec)
                except Exception as e:  # a bad value must never reach vLLM
                    T.error(e)
                    continue
                size += len(b)
                if size > limit:
                    size -= len(b)
                    T.dropped += 1
                    continue
                append(b)
            T.emitted += len(recs)
        if now - _last["stats"] >= STATS_EVERY_NS:
            _last["stats"] = now
            _emit_stats(now)
        T.flush(recs, CODEC.encode("thread", made_on) if made_on else b"")
        _last["flush"] = now


def _emit_stats(now: int) -> None:
    T.emit("hook_stats", now, T.emitted, T.dropped, T.errors, T.last_error)


def _hook_start(role: str, engine: str = "vllm", version: str | None = None, block_size: int = 0) -> None:
    """hook_start (its version field: the engine's version) and the engine record."""
    now = time.monotonic_ns()
    version = _vllm_version() if version is None else version
    _enqueue(("hook_start", now, role, version, HOOK_VERSION))
    _enqueue(("engine", now, engine, version, block_size))
    _last["stats"] = 0  # a hook_stats with the first flush


def _agents() -> frozenset | None:
    """The attached agents, by the pid naming their flag entry (None: the flag could not be read)."""
    try:
        return frozenset(agent_pids(T.flag_path))
    except Exception:
        return None


def _new_agent(state) -> bool:
    """True (once) when the transport re-checked the flag and it names an agent that was not
    attached at the previous check: that agent's capture needs its own hook_start and the cache
    snapshot at its attach (the hook cannot tell an agent tracing this process from one tracing
    others: the flag entry names only the agent).  An agent leaving is no reason: nothing is sent
    then (each capture's cold against unseen is decided by the first snapshot it recorded,
    kvtrace.correlate.causes; docs/hook.md, "The cache snapshot").  Runs at most once per
    Transport re-check (1 s)."""
    if T.next_check == state.seen_check:
        return False
    state.seen_check = T.next_check
    now = _agents()
    if now is None:   # (unread: judged at the next check, against the agents known before)
        return False
    new = not now <= state.agents
    state.agents = now
    return new


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "?"))
    except Exception:
        return "?"


def record_transfer(direction, request_id, blocks, nbytes, t_start_ns, t_end_ns, source="") -> None:
    """kvtrace.hook.api.kv_transfer lands here (any thread)."""
    with _LOCK:
        enabled = T.refresh()
    if not enabled:
        return
    try:
        d = str(direction).lower()
        if d in ("load", "read", "in", "recv", "get"):
            name = "kv_load"
        elif d in ("store", "save", "write", "out", "send", "put"):
            name = "kv_store"
        else:
            raise ValueError(f"kv_transfer direction {direction!r} is not load or store")
        nblocks = blocks if isinstance(blocks, int) else len(blocks)
        t0, t1 = int(t_start_ns), int(t_end_ns)
        _enqueue((name, t0, t1, t1, 0, 0, 0, nblocks, int(nbytes), str(request_id or ""), str(source or "api")))
        now = time.monotonic_ns()
        if now - _last["flush"] >= API_FLUSH_AFTER_NS:
            _flush(now)
    except Exception as e:
        T.error(e)


# ---------------------------------------------------------------------------------------------
# The agent: attached or not, and (live injection) the one that installed this hook


# Live injection: the agent that installed this hook.  An injected hook leaves with its agent
# (Ctrl-C, SIGTERM, --duration or SIGKILL alike): once the owner is gone, vLLM is restored.
_OWNER = {"pid": 0}


def set_owner(pid: int) -> None:
    _OWNER["pid"] = int(pid)


def _leave_if_owner_gone() -> bool:
    """True when the hook just removed itself because the agent that injected it is gone."""
    pid = _OWNER["pid"]
    if not pid or owner_live(T.flag_path, pid):   # its flag entry: valid across pid namespaces
        return False
    _OWNER["pid"] = 0
    from . import install   # (imported here: install imports the wrappers, which import this)

    install.uninstall()
    _STATUS.update(installed=False, reason=f"the agent that injected the hook (pid {pid}) exited")
    log.info("kvtrace hook removed: its agent (pid %d) exited", pid)
    return True


def _refresh() -> bool:
    """T.refresh(); and each time it re-reads the flag (once a second), an injected hook whose
    agent is gone leaves, even while other agents on the host are attached (they trace other
    processes)."""
    check = T.next_check
    on = T.refresh()
    if T.next_check != check and _OWNER["pid"] and _leave_if_owner_gone():
        return False
    return on
