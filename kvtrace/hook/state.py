"""The hook's per-process state, shared by every server kind's wrappers: the Transport, the
bounded record queue and its flush, the records that open a recording (hook_start, engine), the
patch registry and status, the agent and owner checks.  Standard library only.

Nothing here knows a server kind.  A kind's package (kvtrace.hook.vllm, kvtrace.hook.sglang)
keeps its own wrapper state and registers with ``on_leave`` what to run when the agent that
injected the hook is gone (its uninstall); this module never imports a kind's package.

The wrappers' modules bind what they use from here as their own globals, once at import
(functions and constants by ``from ..state import``, the objects by assignment, ``T = state.T``):
a hot path then pays one global lookup per name, never an attribute lookup through this module.
So the state is only ever changed in place (attributes of ``T``; items of ``_last``, ``_OWNER``,
``_STATUS``, ``_REGISTRY``, ``_LEAVE``; ``_Q``'s contents), never rebound here.
"""
from __future__ import annotations

import collections
import threading
import time

from .transport import Transport, agent_pids, owner_live
from .wire import CODEC

HOOK_VERSION = "8"  # 2: evictions batched (wire record 13); 3: records sent every 100 ms (record 14);
# 4: one kv_step record per Worker step (record 15) instead of a kv_load and a kv_store;
# 5: records 16-19 for the miss causes (lookup, prompt_plain, cached, resume_blocks); servers checked, not versioned;
# 6: any KV connector from its scheduler (records 21-24), save_kv_layer timed (kv_step2, record 25);
# 7: speculative decoding: drafts scheduled and accepted, output tokens per request (records 28, 29)
# 8: KV cache groups (record 30) and, with several, each group's cache snapshot (record 31)
MAX_QUEUE = 20000          # records waiting for their flush
# Engine records are sent at a step end once FLUSH_EVERY_NS have passed since the last send, once
# FLUSH_RECORDS are queued, or when the scheduler has no request left (the engine then waits for
# new ones, and the records must not wait with it).  A send is a system call, the hook's dearest
# operation, so a fast engine sends a frame for several steps; records carry their own times.
# (Each kind's wrapper modules read their own copies: set those to change it.)
FLUSH_EVERY_NS = 100_000_000
FLUSH_RECORDS = 256
MAX_TRACKED = 65536        # per-request state entries (chunk counters, admission info)
STATS_EVERY_NS = 1_000_000_000
API_FLUSH_AFTER_NS = 200_000_000  # kv_transfer() flushes itself when no step end did for this long
M64 = (1 << 64) - 1

_monotonic_ns = time.monotonic_ns

# The transport: one per process, shared by every wrapper and by kvtrace.hook.api.
T = Transport()
_Q: collections.deque = collections.deque()
_LOCK = threading.Lock()

# Module-global patch registry: (class, attribute) -> (had_own_attribute, original, wrapper).
_REGISTRY: dict[tuple[type, str], tuple[bool, object, object]] = {}
_STATUS: dict = {"installed": False, "roles": [], "patched": [], "reason": "not installed"}
_MARK = "__kvtrace_original__"
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
                except Exception as e:  # a bad value must never reach the server
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


def _hook_start(role: str, engine: str, version: str, block_size: int = 0) -> None:
    """hook_start (its version field: the server's version) and the engine record: the server
    kind's name, its version, and its cache's tokens per block where the server fixes it."""
    now = time.monotonic_ns()
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
# (Ctrl-C, SIGTERM, --duration or SIGKILL alike): once the owner is gone, the server is restored
# by what the kind's package registered (on_leave).
_OWNER = {"pid": 0}
_LEAVE: list = []


def set_owner(pid: int) -> None:
    _OWNER["pid"] = int(pid)


def on_leave(fn) -> None:
    """Register ``fn(pid)``: run once the agent that injected the hook (``pid``) is gone, to
    take the hook out (a kind's package registers its uninstall when it installs)."""
    if fn not in _LEAVE:
        _LEAVE.append(fn)


def _leave_if_owner_gone() -> bool:
    """True when the hook just removed itself because the agent that injected it is gone."""
    pid = _OWNER["pid"]
    if not pid or owner_live(T.flag_path, pid):   # its flag entry: valid across pid namespaces
        return False
    _OWNER["pid"] = 0
    for fn in list(_LEAVE):
        try:
            fn(pid)
        except Exception as e:   # never into the server
            T.error(e)
    _STATUS.update(installed=False, reason=f"the agent that injected the hook (pid {pid}) exited")
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
