"""The hook inside vLLM: class-level wrappers that turn scheduler, KV-cache and KV-connector
activity into kvtrace records (kvtrace.hook.wire), sent through one Transport per process.

Runs in vLLM's own interpreter: standard library plus what vLLM itself imports.  Loaded by the
``vllm.general_plugins`` entry point (kvtrace.hook.plugin) or imported from a path by a later
live-injection step, which only has to call ``install()``.

EngineCore (role "engine"):
  Scheduler.schedule / update_from_output   step span, chunk and admit records, flush (batched)
  Scheduler._preempt_request                 preempt
  KVCacheManager.allocate_slots              hit sizes at admission; which request allocates
  BlockPool._maybe_evict_cached_block        evicts (a batch per allocation, one hash per BlockRemoved)
Worker (role "worker"), on the class of each KV connector vLLM creates:
  bind_connector_metadata / start_load_kv / wait_for_layer_load / wait_for_save   kv_load, kv_store

Rules: a wrapper never raises into vLLM (errors are counted and reported in hook_stats), never
blocks (records go to a bounded queue; full means counted drops), and while no agent is attached
costs one Transport.refresh() call (a time comparison) per step and one flag test per wrapped
call.  Prompt token ids are never read into a record: prompts appear only as block hashes.
"""
from __future__ import annotations

import collections
import inspect
import logging
import multiprocessing
import os
import sys
import threading
import time

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

HOOK_VERSION = "4"  # 2: evictions batched (wire record 13); 3: records sent every 100 ms (record 14);
# 4: one kv_step record per Worker step (record 15) instead of a kv_load and a kv_store
TESTED_VLLM = ("0.32.",)
MAX_QUEUE = 20000          # records waiting for their flush
# Engine records are sent at a step end once FLUSH_EVERY_NS have passed since the last send, once
# FLUSH_RECORDS are queued, or when the scheduler has no request left (the engine then waits for
# new ones, and the records must not wait with it).  A send is a system call, the hook's dearest
# operation, so a fast engine sends a frame for several steps; records carry their own times.
FLUSH_EVERY_NS = 100_000_000
FLUSH_RECORDS = 256
# The Worker sends at a step end once FLUSH_EVERY_NS have passed; otherwise a sleeping thread
# sends FLUSH_EVERY_NS later, naming the Worker's thread in the frame (_Later).
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
                 "alloc_failures", "broken", "seen_check", "agent_pid")

    def __init__(self):
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
        self.agent_pid = ""


class _Worker:
    __slots__ = ("active", "on", "seen_check", "agent_pid", "seq", "depth", "source", "t_bind", "load_t0",
                 "load_t1", "waits", "wait_ns", "last_wait_end")

    def __init__(self):
        self.active = False
        self.on = False
        self.seen_check = 0
        self.agent_pid = ""
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


def _hook_start(role: str) -> None:
    now = time.monotonic_ns()
    _enqueue(("hook_start", now, role, _vllm_version(), HOOK_VERSION))
    _last["stats"] = 0  # a hook_stats with the first flush


def _agent_pid() -> str:
    """The attached agents, as one string (a change means a new agent)."""
    try:
        return ",".join(map(str, agent_pids(T.flag_path)))
    except Exception:
        return ""


def _new_agent(state) -> bool:
    """True (once) when the transport re-checked the flag and it names another agent than before:
    a new agent needs its own hook_start.  Runs at most once per Transport re-check (1 s)."""
    if T.next_check == state.seen_check:
        return False
    state.seen_check = T.next_check
    pid = _agent_pid()
    if pid == state.agent_pid:
        return False
    state.agent_pid = pid
    return True


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
# Hashes: the 64-bit int vLLM publishes in KV events (maybe_convert_block_hash(get_block_hash(k)))


def _hash64(key: bytes) -> int:
    """BlockHashWithGroupId (hash bytes + 4-byte big-endian group) -> the KV-event int:
    ``int.from_bytes(key[:-4], "big") & M64``, i.e. the hash part's last 8 bytes."""
    return int.from_bytes(key[-12:-4], "big")


def _group(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big")


# ---------------------------------------------------------------------------------------------
# EngineCore wrappers


# The per-call wrappers (about ten calls a step): in vLLM's classes only while an agent is
# attached; detached, vLLM runs its own methods and a step pays for the schedule wrapper alone.
HOT = ("allocate_slots", "_maybe_evict_cached_block")
_HOT_IN = [True]   # as installed


def _hot(on: bool) -> None:
    """Put the per-call wrappers in (on) or take them out, where the class still holds what
    this module left there (another copy's or someone else's patch is not touched)."""
    for (cls, attr), (had_own, original, wrapper) in list(_REGISTRY.items()):
        if attr not in HOT:
            continue
        cur = cls.__dict__.get(attr)
        if on and cur is not wrapper and ((cur is original) if had_own else attr not in cls.__dict__):
            setattr(cls, attr, wrapper)
        elif not on and cur is wrapper:
            if had_own:
                setattr(cls, attr, original)
            else:
                delattr(cls, attr)
    _HOT_IN[0] = on


def _engine_on(sched) -> None:
    _hot(True)
    S.reset()
    S.on = S.rec = True
    for attr in ("requests", "current_step", "running", "waiting", "kv_cache_manager"):
        if not hasattr(sched, attr):
            S.broken = f"Scheduler has no attribute {attr!r}"
    pool = getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None)
    if not S.broken and not hasattr(pool, "cached_block_hashes_by_block"):
        S.broken = "KVCacheManager.block_pool has no cached_block_hashes_by_block"
    if S.broken:
        S.rec = False
        log.warning("kvtrace hook: records off in this process: %s", S.broken)
    _new_agent(S)
    _hook_start("engine")


def _engine_off() -> None:
    S.reset()
    with _LOCK:
        _Q.clear()
    _leave_if_owner_gone()


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
    uninstall()
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


def _nothing(self, t) -> None:
    """abort: nothing to undo when vLLM's method raised."""


def _schedule_pre(self):
    """Scheduler.schedule: its start time when this step is recorded, else None."""
    try:
        # the flag is re-read at most once per second; otherwise one clock read and two tests
        t0 = _monotonic_ns()
        if not (_refresh() if t0 >= T.next_check else T.enabled):
            if S.on:
                _engine_off()
            if _HOT_IN[0]:
                _hot(False)
            return None
        if not S.on:
            _engine_on(self)
            t0 = _monotonic_ns()
        elif T.next_check != S.seen_check and _new_agent(S):
            _hook_start("engine")
            t0 = _monotonic_ns()
        if S.broken:
            return None
        S.step = self.current_step + 1
        S.cur_req = S.last_alloc = ""
        S.evicted = S.alloc_failures = 0
        return t0
    except Exception as e:
        T.error(e)
        return None


def _schedule_post(self, t0: int, out) -> None:
    S.last_alloc = ""
    try:
        if S.ev is not None:
            _evicts_out()
        _after_schedule(self, out, t0, _monotonic_ns())
    except Exception as e:
        T.error(e)


_DECODING = [-1, -1, 0]  # S.reqs' entry of a request past its prefill (until preempted or finished)


def _after_schedule(sched, so, t0: int, t1: int) -> None:
    step = S.step = sched.current_step
    requests = sched.requests
    new_ids = {r.req_id for r in so.scheduled_new_reqs} if so.scheduled_new_reqs else ()
    resumed_ids = so.scheduled_cached_reqs.resumed_req_ids
    tracked, alloc = S.reqs, S.alloc
    prefill_reqs = prefill_tokens = n_new = n_resumed = 0
    for rid, n in so.num_scheduled_tokens.items():
        st = tracked.get(rid)
        if st is _DECODING and rid not in resumed_ids:
            continue    # most of a step: requests past their prefill
        req = requests.get(rid)
        if req is None:
            continue
        end = req.num_computed_tokens
        start = end - n
        if rid in new_ids or rid in resumed_ids:
            attempt = min(req.num_preemptions, 0xFFFF)
            resumed = 1 if (rid in resumed_ids or attempt > 0) else 0
            n_resumed += resumed
            n_new += 1 - resumed
            prefill_len = req.num_tokens
            info = alloc.pop(rid, None) or (start, 0, 0, 0)
            _enqueue(("admit", step, rid, attempt, req.num_prompt_tokens, prefill_len,
                      info[0], info[1], start, info[2], info[3], resumed))
            if rid in new_ids and attempt == 0:
                _arrive(step, rid, req, t1)
                _prompt_blocks(sched, step, rid, req)
            st = tracked[rid] = [0, prefill_len, attempt]
        elif st is None:  # attached after this request's first chunk
            if len(tracked) >= MAX_TRACKED:
                tracked.clear()
            st = tracked[rid] = [-1, req.num_prompt_tokens, min(req.num_preemptions, 0xFFFF)]
        prefill_len = st[1]
        if start < prefill_len:
            idx = st[0]
            if idx >= 0:
                st[0] = idx + 1
            _enqueue(("chunk", step, rid, st[2], idx, start, n, req.num_prompt_tokens, prefill_len,
                      1 if end >= prefill_len else 0, 1 if st[2] > 0 else 0))
            prefill_reqs += 1
            prefill_tokens += n
        if end >= prefill_len:
            tracked[rid] = _DECODING
    for rid in so.finished_req_ids:
        _enqueue(("finish", step, t0, rid))
        tracked.pop(rid, None)
        alloc.pop(rid, None)
    if len(alloc) >= MAX_TRACKED:
        alloc.clear()
    num_reqs = len(so.num_scheduled_tokens)
    total = so.total_num_scheduled_tokens
    try:
        free_blocks = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    except Exception:
        free_blocks = 0
    if len(S.steps) >= 16:  # update_from_output never came for old steps
        S.steps.clear()
    # the step record, its end time (index 4) set by update_from_output
    S.steps[id(so)] = ["step", step, t0, t1, 0, num_reqs, total, prefill_reqs, prefill_tokens,
                       num_reqs - prefill_reqs, total - prefill_tokens, n_new, n_resumed,
                       len(so.preempted_req_ids), S.evicted, S.alloc_failures, len(sched.running),
                       len(sched.waiting), free_blocks, len(so.finished_req_ids)]


def _arrive(step: int, rid: str, req, now: int) -> None:
    """arrive record: arrival on CLOCK_MONOTONIC, and the request's W3C trace context if any."""
    wall = getattr(req, "arrival_time", None)
    t = now - max(int((time.time() - wall) * 1e9), 0) if wall else 0
    headers = getattr(req, "trace_headers", None) or {}
    _enqueue(("arrive", step, t, rid, str(headers.get("traceparent", "") or "")[:128],
              str(headers.get("tracestate", "") or "")[:512]))


PROMPT_PIECE = 448  # hashes per prompt_blocks record (3,584 bytes: one record fits a frame)


def _prompt_blocks(sched, step: int, rid: str, req) -> None:
    """prompt_blocks records: the prompt's block-hash chain (64-bit KV-event form), never token ids."""
    try:
        bs = int(getattr(sched, "hash_block_size", 0) or sched.block_size)
        n_prompt = req.num_prompt_tokens
        from_bytes = int.from_bytes   # & M64 of the big-endian int: its last 8 bytes
        hashes = [from_bytes(h[-8:], "big") for h in req.block_hashes[:n_prompt // bs]]
        max_out = min(int(getattr(req, "max_tokens", 0) or 0), 0xFFFFFFFF)
        for first in range(0, max(len(hashes), 1), PROMPT_PIECE):
            _enqueue(("prompt_blocks", step, rid, bs, n_prompt, max_out, len(hashes), first,
                      hashes[first:first + PROMPT_PIECE]))
    except Exception as e:
        T.error(e)


_NO_STEP = ()   # update_from_output of a step not recorded, with records waiting to be sent


def _update_pre(self, scheduler_output):
    """Scheduler.update_from_output: the step's summary from schedule(), if any."""
    info = S.steps.pop(id(scheduler_output), None) if S.steps else None
    if info is None:
        return _NO_STEP if (_Q or S.ev is not None) else None
    return info


def _update_post(self, info, out) -> None:
    try:
        if S.ev is not None:
            _evicts_out()
        now = _monotonic_ns()
        if info:
            info[4] = now
            _enqueue(info)
        # (a request still running: not idle, without asking vLLM's three nested calls)
        if now - _last["flush"] >= FLUSH_EVERY_NS or len(_Q) >= FLUSH_RECORDS or (not self.running and _idle(self)):
            _flush(now)
    except Exception as e:
        T.error(e)


def _idle(sched) -> bool:
    """True when no request is left for another step (or vLLM cannot say)."""
    try:
        return not sched.has_unfinished_requests()
    except Exception:
        return True


def _preempt_pre(self, request):
    """Scheduler._preempt_request: (request, its id, computed tokens, tokens) before it."""
    if not S.rec:
        return None
    try:
        return (request, request.request_id, request.num_computed_tokens, request.num_tokens)
    except Exception as e:
        T.error(e)
        return None


def _preempt_post(self, t, out) -> None:
    request, rid, before, ntok = t
    try:
        S.reqs.pop(rid, None)
        _enqueue(("preempt", S.step, _monotonic_ns(), rid, before, ntok,
                  min(request.num_preemptions, 0xFFFF), S.last_alloc))
    except Exception as e:
        T.error(e)


ALLOC_PARAMS = ("request", "num_new_computed_tokens", "new_computed_blocks", "num_external_computed_tokens")

# KVCacheManager.allocate_slots, once per running request and step: the request allocating (its
# evictions and a preemption are its doing) and, at an admission, the prefix-cache hit that
# comes with it; a None result is an allocation failure.  Allocations do not nest in vLLM 0.32;
# the request allocating before is restored after.  Written into the wrapper (kvtrace.hook.exact
# inline): a pre and a post function cost more than the work.
ALLOCATE_BODY = """\
_kv_s = _kv_S
if not _kv_s.rec:
    return {call}
_kv_prev = _kv_s.cur_req
try:
    _kv_s.cur_req = _kv_s.last_alloc = request.request_id
    if new_computed_blocks is not None:
        _kv_admission(request, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens)
except Exception as _kv_e:
    _kv_error(_kv_e)
try:
    _kv_r = {call}
finally:
    _kv_s.cur_req = _kv_prev
if _kv_r is None:
    _kv_s.alloc_failures += 1
return _kv_r
"""


def _note_admission_alloc(request, local, blocks, external) -> None:
    hit, last = 0, 0
    groups = getattr(blocks, "blocks", None)
    if groups:
        g0 = groups[0]
        hit = len(g0)
        if hit:
            key = g0[-1].block_hash
            last = _hash64(key) if key is not None else 0
    S.alloc[request.request_id] = (int(local or 0), int(external or 0), hit, last)


# BlockPool._maybe_evict_cached_block, once per block taken from the free queue: the block's
# hashes (block_hash and the others it holds) are read before the call, which may drop them from
# the prefix cache; a true result means it did.
EVICT_BODY = """\
_kv_key = None
if _kv_S.rec:
    try:
        _kv_key = block.block_hash
        if _kv_key is not None:
            _kv_bid = block.block_id
            _kv_extra = self.cached_block_hashes_by_block.get(_kv_bid)
    except Exception as _kv_e:
        _kv_error(_kv_e)
        _kv_key = None
if _kv_key is None:
    return {call}
_kv_r = {call}
if _kv_r:
    try:
        _kv_note_evict(self, _kv_bid, _kv_key, _kv_extra)
    except Exception as _kv_e:
        _kv_error(_kv_e)
return _kv_r
"""


def _note_evict(pool, bid: int, key: bytes, extra) -> None:
    """Add the hashes the block held to the open batch (a new one for another step, request or
    medium, or when full): one `evicts` record per allocation instead of one per hash."""
    medium = getattr(pool, "medium", "") or ""
    b, step, req, from_bytes = S.ev, S.step, S.cur_req, int.from_bytes
    if b is None or b[0] != step or b[3] != req or b[2] != medium or len(b[4]) >= 2 * EVICTS_MAX:
        if b is not None:
            _enqueue(("evicts", *b))
        b = S.ev = [step, time.monotonic_ns(), medium, req, []]
    blocks = b[4]
    for k in (key, *extra) if extra else (key,):
        S.evicted += 1
        blocks.append(from_bytes(k[-12:-4], "big"))
        blocks.append(from_bytes(k[-4:], "big") << 32 | bid)


def _evicts_out() -> None:
    """Queue the open `evicts` batch (the callers, at the end of schedule() and of
    update_from_output(), test that there is one)."""
    _enqueue(("evicts", *S.ev))
    S.ev = None


# ---------------------------------------------------------------------------------------------
# Worker wrappers (KV connector API, on the concrete connector class)


def _bind_pre(self):
    """bind_connector_metadata (a Worker step starts): never anything to do after the call."""
    try:
        if _refresh():
            now = _monotonic_ns()
            if _new_agent(W) or not W.on:
                W.on = True
                _hook_start("worker")
            W.active = True
            W.seq += 1
            W.source = "connector:" + type(self).__name__
            W.begin(now)
        else:
            if W.on:
                W.on = False
                with _LOCK:
                    _Q.clear()
                _leave_if_owner_gone()
            W.active = False
    except Exception as e:
        T.error(e)
    return None


def _timed_pre(self):
    """start_load_kv, wait_for_layer_load, wait_for_save: their start, in a recorded Worker step
    and not inside another of them (a connector calling its own API)."""
    if not W.active or W.depth:
        return None
    W.depth += 1
    return _monotonic_ns()


def _load_done(self, t0, out=None) -> None:
    W.depth -= 1
    if not W.load_t0:
        W.load_t0 = t0
    W.load_t1 = _monotonic_ns()


def _layer_done(self, t0, out=None) -> None:
    W.depth -= 1
    t1 = _monotonic_ns()
    W.waits += 1
    W.wait_ns += t1 - t0
    W.last_wait_end = t1


def _save_done(self, t0, out=None) -> None:
    W.depth -= 1
    _save_end(t0)


def _save_end(t0: int) -> None:
    try:
        _worker_step_end(t0, _monotonic_ns())
    except Exception as e:
        T.error(e)


# The same three, written into wrappers with the connector's own parameters (kvtrace.hook.exact
# inline): wait_for_layer_load runs once per layer and step, and a pre and a post function per
# call would cost more than the timing.  Only attribute writes on W happen after the call.
_TIMED_HEAD = """\
_kv_w = _kv_W
if not _kv_w.active or _kv_w.depth:
    return {call}
_kv_w.depth = 1
_kv_t0 = _kv_mono()
try:
    return {call}
finally:
    _kv_w.depth = 0
"""
LOAD_BODY = _TIMED_HEAD + """\
    if not _kv_w.load_t0:
        _kv_w.load_t0 = _kv_t0
    _kv_w.load_t1 = _kv_mono()
"""
LAYER_BODY = _TIMED_HEAD + """\
    _kv_t1 = _kv_mono()
    _kv_w.waits += 1
    _kv_w.wait_ns += _kv_t1 - _kv_t0
    _kv_w.last_wait_end = _kv_t1
"""
SAVE_BODY = _TIMED_HEAD + """\
    _kv_save_end(_kv_t0)
"""


def _worker_step_end(t_save0: int, t_save1: int) -> None:
    W.active = False
    # one record for the step's kv_load and kv_store rows (the agent splits it: wire.kv_step_rows)
    if W.load_t0:
        _enqueue(("kv_step", W.load_t0, max(W.load_t1, W.last_wait_end), W.load_t1, W.seq, W.waits, W.wait_ns,
                  t_save0, t_save1, 1, W.source))
    else:   # no start_load_kv: the load, if a layer waited, spans bind to the last wait
        _enqueue(("kv_step", W.t_bind, W.last_wait_end, W.t_bind, W.seq, W.waits, W.wait_ns,
                  t_save0, t_save1, 1 if W.waits else 0, W.source))
    if t_save1 - _last["flush"] >= FLUSH_EVERY_NS:
        _flush(t_save1)
    else:
        _LATER.arm()


class _Later:
    """Sends the Worker's records FLUSH_EVERY_NS after they were queued, from a daemon thread
    that sleeps otherwise: a Worker cannot tell whether another step will come to send them.
    Its frames name the Worker's thread, whose id joins a kv_load or kv_store to that thread's
    file I/O.  Arming costs an Event.set() once per interval and no system call: the thread
    starts on first use in each process (threads do not survive a fork, which resets this),
    and the calling thread's native id is asked of the kernel once per thread."""

    def __init__(self):
        self.started = False
        self.tid = 0
        self.ev = threading.Event()
        self.local = threading.local()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.forked)

    def forked(self) -> None:
        self.started = False
        self.ev = threading.Event()
        self.local = threading.local()   # the forking thread's id is not the child's

    def arm(self) -> None:
        tid = getattr(self.local, "tid", 0)
        if not tid:
            tid = self.local.tid = threading.get_native_id()
        self.tid = tid
        if not self.started:
            self.started = True
            threading.Thread(target=self._run, args=(self.ev,), name="kvtrace-hook-send", daemon=True).start()
        if not self.ev.is_set():
            self.ev.set()

    def _run(self, ev: threading.Event) -> None:
        while True:
            ev.wait()
            time.sleep(FLUSH_EVERY_NS / 1e9)
            ev.clear()
            try:
                _flush(time.monotonic_ns(), self.tid)
            except Exception as e:  # never into vLLM, never out of the loop
                T.error(e)


_LATER = _Later()


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


def _nothing_after(self, t, out) -> None:
    """post: nothing to do after vLLM's method."""


def _any_params(pre, post, abort, body=None):
    """The wrapper factory of a connector method: ``body`` written into a function with its
    own parameters where they are all plain, else kvtrace.hook.exact.wrapper (pre, the
    method, post; through *args/**kwargs where the parameters are not plain)."""
    def wrap(orig):
        if body is not None and why_not(orig) is None:
            return inline(orig, body, _ENV, (), orig.__name__)
        return wrapper(orig, pre, post, abort, orig.__name__)

    return wrap


# the connector API, on each connector's own class: with its own parameters where they are all
# plain (kvtrace.hook.exact; wait_for_layer_load runs once per layer and step), else through
# *args/**kwargs (start_load_kv takes **kwargs in vLLM's base class)
CONNECTOR_METHODS = {
    "bind_connector_metadata": (["self", "connector_metadata"], _any_params(_bind_pre, _nothing_after, _nothing)),
    "start_load_kv": (["self", "forward_context"], _any_params(_timed_pre, _load_done, _load_done, LOAD_BODY)),
    "wait_for_layer_load": (["self", "layer_name"], _any_params(_timed_pre, _layer_done, _layer_done, LAYER_BODY)),
    "wait_for_save": (["self"], _any_params(_timed_pre, _save_done, _save_done, SAVE_BODY)),
}


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


# What the inlined wrappers' bodies call and read (their globals).
_ENV = {"_kv_S": S, "_kv_W": W, "_kv_mono": _monotonic_ns, "_kv_error": T.error,
        "_kv_admission": _note_admission_alloc, "_kv_note_evict": _note_evict, "_kv_save_end": _save_end}


# ---------------------------------------------------------------------------------------------
# Install / uninstall


def _signature_differs(func, want: list[str], strict: bool = True) -> str | None:
    """None when the leading parameter names are ``want`` (strict: and no other required one)."""
    if func is None:
        return "is missing"
    try:
        params = list(inspect.signature(inspect.unwrap(func)).parameters.values())
    except (TypeError, ValueError) as e:
        return f"has no readable signature ({e})"
    names = [p.name for p in params]
    if names[:len(want)] != want:
        return f"takes ({', '.join(names)}), expected ({', '.join(want)}, ...)"
    if strict:
        for p in params[len(want):]:
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                return f"has an extra required parameter {p.name!r}"
    return None


def _engine_targets():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    return [
        (Scheduler, "schedule", ["self", "throttle_prefills"], _exactly(_schedule_pre, _schedule_post)),
        (Scheduler, "update_from_output", ["self", "scheduler_output", "model_runner_output"],
         _exactly(_update_pre, _update_post, names=("scheduler_output",))),
        (Scheduler, "_preempt_request", ["self", "request", "timestamp", "drop_stale_output"],
         _exactly(_preempt_pre, _preempt_post, names=("request",))),
        (KVCacheManager, "allocate_slots", ["self", "request", "num_new_tokens", "num_new_computed_tokens",
                                            "new_computed_blocks"],
         _inlined(ALLOCATE_BODY, ALLOC_PARAMS)),
        (BlockPool, "_maybe_evict_cached_block", ["self", "block"], _inlined(EVICT_BODY, ("block",))),
    ]


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


def _engine_data_checks() -> list[str]:
    """Fields the wrappers read off vLLM's own data classes."""
    import dataclasses

    from vllm.v1.core.sched import output

    bad = []
    want = {
        "SchedulerOutput": ["scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                            "total_num_scheduled_tokens", "preempted_req_ids", "finished_req_ids"],
        "CachedRequestData": ["resumed_req_ids"],
        "NewRequestData": ["req_id"],
    }
    for cls_name, fields in want.items():
        cls = getattr(output, cls_name, None)
        have = {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else set()
        for f in fields:
            if f not in have:
                bad.append(f"{cls_name}.{f} is missing")
    return bad


def _worker_targets():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    bad = []
    for name, (want, _) in CONNECTOR_METHODS.items():
        why = _signature_differs(getattr(KVConnectorBase_V1, name, None), want, strict=False)
        if why:
            bad.append(f"KVConnectorBase_V1.{name} {why}")
    raw = KVConnectorFactory.__dict__.get("create_connector")
    if not isinstance(raw, classmethod):
        bad.append("KVConnectorFactory.create_connector is not a classmethod")
    else:
        why = _signature_differs(raw.__func__, ["cls", "config", "role"], strict=False)
        if why:
            bad.append(f"KVConnectorFactory.create_connector {why}")
    return KVConnectorFactory, bad


def _patch(cls: type, attr: str, wrap) -> None:
    """Wrap cls.attr once; a wrapper left by another copy of this module is replaced."""
    key = (cls, attr)
    if key in _REGISTRY:
        return
    current = cls.__dict__.get(attr)
    had_own = attr in cls.__dict__
    if current is not None and hasattr(_unbox(current), _MARK):  # wrapped by another module copy
        original = getattr(_unbox(current), _MARK)
        had_own = getattr(_unbox(current), "__kvtrace_had_own__", True)
    else:
        original = current if had_own else None
    base = original if original is not None else getattr(cls, attr)
    if isinstance(base, classmethod):
        wrapper = classmethod(wrap(base.__func__))
        inner = wrapper.__func__
    else:
        wrapper = inner = wrap(base)
    setattr(inner, _MARK, original if had_own else base)
    inner.__kvtrace_had_own__ = had_own
    inner.__name__ = attr
    inner.__qualname__ = f"{cls.__name__}.{attr}"
    inner.__wrapped__ = base.__func__ if isinstance(base, classmethod) else base
    setattr(cls, attr, wrapper)
    _REGISTRY[key] = (had_own, original, wrapper)
    _STATUS["patched"].append(f"{cls.__module__}.{cls.__qualname__}.{attr}")


def _original(cls, attr):
    """What the class's attribute wraps (vLLM's own method), or the attribute itself."""
    cur = _unbox(cls.__dict__.get(attr))
    return getattr(cur, _MARK, None) or cur


def _unbox(obj):
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


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


def _live_connector():
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as state

        return getattr(state, "_KV_CONNECTOR_AGENT", None)
    except Exception:
        return None


def install(roles: list[str] | None = None, live: bool = False) -> bool:
    """Patch vLLM for these roles ("engine", "worker"; default: by process).  Idempotent.

    Returns True when something is patched.  Never raises: a vLLM whose version or method
    signatures differ from what the hook reads leaves everything untouched and logs one
    message saying what differs.
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
        version = _vllm_version()
        if not version.startswith(TESTED_VLLM) and os.environ.get("KVTRACE_HOOK_ANY_VLLM") != "1":
            return _inert(f"vLLM {version} is not a tested version ({', '.join(v + 'x' for v in TESTED_VLLM)}); "
                          "set KVTRACE_HOOK_ANY_VLLM=1 to patch anyway when the signatures match")
        plan, bad = [], []
        if "engine" in roles:
            for cls, attr, want, wrap in _engine_targets():
                why = _signature_differs(cls.__dict__.get(attr), want) or wrap.why_not(_original(cls, attr))
                if why:
                    bad.append(f"{cls.__name__}.{attr} {why}")
                plan.append((cls, attr, wrap))
            bad += _engine_data_checks()
        if "worker" in roles:
            factory, wbad = _worker_targets()
            bad += wbad
            plan.append((factory, "create_connector", _wrap_create_connector))
        if bad:
            return _inert("; ".join(bad))
        for cls, attr, wrap in plan:
            _patch(cls, attr, wrap)
        if "worker" in roles:
            _patch_live_connector()
        try:
            from kvtrace.hook import api

            api._sink = record_transfer
        except Exception:
            pass
        _STATUS.update(installed=True, roles=sorted(set(_STATUS["roles"]) | set(roles)), reason="")
        log.info("kvtrace hook %s installed (%s) on vLLM %s: %d methods wrapped; records flow while a kvtrace agent is attached",
                 HOOK_VERSION, "+".join(roles), version, len(_REGISTRY))
        return True
    except Exception as e:  # never break vLLM start-up
        uninstall()
        return _inert(f"install failed: {type(e).__name__}: {e}")


def _inert(reason: str) -> bool:
    _STATUS.update(installed=False, reason=reason)
    log.warning("kvtrace hook inactive (nothing patched): %s", reason)
    return False


def _patch_live_connector() -> None:
    """Live injection: a connector created before install() gets its class patched now."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as state

        conn = getattr(state, "_KV_CONNECTOR_AGENT", None)
        if conn is not None:
            _patch_connector_class(type(conn))
    except Exception as e:
        T.error(e)


def uninstall() -> None:
    """Restore every wrapped attribute (also those left by another copy of this module)."""
    S.rec = False
    for (cls, attr), (had_own, original, wrapper) in list(_REGISTRY.items()):
        try:
            if cls.__dict__.get(attr) is wrapper:
                if had_own:
                    setattr(cls, attr, original)
                else:
                    delattr(cls, attr)
        except Exception as e:
            T.error(e)
    _REGISTRY.clear()
    _HOT_IN[0] = True
    try:
        from kvtrace.hook import api

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


def status() -> dict:
    return {**_STATUS, "patched": list(_STATUS["patched"]), "emitted": T.emitted,
            "dropped": T.dropped, "errors": T.errors, "last_error": T.last_error}
