"""The hook's EngineCore wrappers: scheduler steps, prefill chunks, admissions, preemptions and
evictions, as records on the shared queue (kvtrace.hook.state), and the EngineCore's state (S).

  Scheduler.schedule / update_from_output   step span, chunk and admit records, flush (batched)
  Scheduler._preempt_request                 preempt
  KVCacheManager.allocate_slots              hit sizes at admission; which request allocates
  BlockPool._maybe_evict_cached_block        evicts (a batch per allocation, one hash per BlockRemoved)

What is patched with what (classes, methods, signatures, wrapper factories) is in
kvtrace.hook.vllm.targets; this module holds the wrappers' work.  Every name a wrapper reads is a
global of this module (imported from kvtrace.hook.state once), so a step pays one global lookup
per name.
"""
from __future__ import annotations

import logging
import time

from .. import state
from ..state import (FLUSH_EVERY_NS, FLUSH_RECORDS, MAX_TRACKED, _enqueue, _flush, _hook_start, _leave_if_owner_gone,
                     _monotonic_ns, _new_agent, _refresh)
from ..wire import EVICTS_MAX, PROMPT_PIECE
from . import connector, groups, releases, spec

# The shared state's objects are bound here by assignment, not by `from ..state import`: CPython
# 3.11+ compiles `T.error(e)` on an imported name as an attribute load that makes a bound method
# per call (it takes an imported name for a module), on an assigned name as a method call.
T, _Q, _LOCK, _REGISTRY, _last = state.T, state._Q, state._LOCK, state._REGISTRY, state._last
log = logging.getLogger("vllm.kvtrace_hook")   # under "vllm", so vLLM's log configuration applies


class _Engine:
    """EngineCore state, reset whenever the agent goes away."""

    __slots__ = ("on", "rec", "step", "cur_req", "last_alloc", "reqs", "alloc", "steps", "evicted", "ev",
                 "alloc_failures", "broken", "seen_check", "agents", "counting", "spec", "spec_now", "dropped")

    def __init__(self):
        self.counting = False   # the hook numbers the steps (_schedule_pre_counting); kept over resets
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
        self.dropped: dict[str, set] = {}    # request finished while steps were in flight -> their id(SchedulerOutput)
        self.evicted = 0
        self.ev: list | None = None          # the open `evicts` batch: [step, t_ns, medium, request, blocks]
        self.alloc_failures = 0
        self.broken = ""
        self.seen_check = 0
        self.agents: frozenset = frozenset()   # the agents attached at the last flag check (_new_agent)
        self.spec = False                     # the scheduler proposes draft tokens (kvtrace.hook.vllm.spec)
        self.spec_now = None                  # the step's scheduled drafts, between update_from_output's pre and post


S = _Engine()


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
    if not S.broken and pool is None:
        S.broken = "KVCacheManager has no block_pool"
    if S.broken:
        S.rec = False
        log.warning("kvtrace hook: records off in this process: %s", S.broken)
    spec.reset()
    S.spec = S.rec and spec.enabled(sched)
    _new_agent(S)
    _hook_start("engine", "vllm", releases.version())
    if S.rec:
        _snapshot(sched, groups.send(sched, _monotonic_ns()))
        try:
            connector.start(sched)
        except Exception as e:
            connector.C.reset()
            T.error(e)


def _engine_off() -> None:
    S.reset()
    connector.C.reset()
    with _LOCK:
        _Q.clear()
    _leave_if_owner_gone()


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
            _hook_start("engine", "vllm", releases.version())
            if S.rec:
                _snapshot(self)
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


def _schedule_pre_counting(self):
    """Scheduler.schedule in a vLLM that does not number its steps (before 0.23: row
    step_counter of kvtrace.hook.vllm.releases): the hook numbers them on the scheduler, as later
    releases do at the start of schedule(), then goes on as _schedule_pre."""
    try:
        self.current_step = self.__dict__.get("current_step", 0)
        S.counting = True   # (so the step before an attach cannot tell whether it served before)
    except Exception as e:
        T.error(e)
        return None
    t = _schedule_pre(self)
    self.current_step += 1
    return t


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
            elif attempt:
                _resume_blocks(sched, step, rid, req, attempt)
            if req.skip_reading_prefix_cache or req.lora_request is not None or req.cache_salt or req.mm_features:
                _lookup(sched, step, rid, req, attempt)
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


def _prompt_blocks(sched, step: int, rid: str, req) -> None:
    """prompt_blocks records: the prompt's block-hash chain (64-bit KV-event form), never token ids."""
    try:
        bs = _hash_size(sched)
        n_prompt = req.num_prompt_tokens
        from_bytes = int.from_bytes   # & M64 of the big-endian int: its last 8 bytes
        hashes = [from_bytes(h[-8:], "big") for h in req.block_hashes[:n_prompt // bs]]
        max_out = min(int(getattr(req, "max_tokens", 0) or 0), 0xFFFFFFFF)
        for first in range(0, max(len(hashes), 1), PROMPT_PIECE):
            _enqueue(("prompt_blocks", step, rid, bs, n_prompt, max_out, len(hashes), first,
                      hashes[first:first + PROMPT_PIECE]))
    except Exception as e:
        T.error(e)


def _hash_size(sched) -> int:
    return int(getattr(sched, "hash_block_size", 0) or sched.block_size)


def _resume_blocks(sched, step: int, rid: str, req, attempt: int) -> None:
    """resume_blocks: at a re-admission, the hashes of the request's blocks past its prompt."""
    try:
        bs = _hash_size(sched)
        first = req.num_prompt_tokens // bs
        from_bytes = int.from_bytes
        hashes = [from_bytes(h[-8:], "big") for h in req.block_hashes[first:req.num_tokens // bs]]
        for i in range(0, len(hashes), PROMPT_PIECE):
            _enqueue(("resume_blocks", step, rid, min(attempt, 0xFFFF), first + i, hashes[i:i + PROMPT_PIECE]))
    except Exception as e:
        T.error(e)


def _lookup(sched, step: int, rid: str, req, attempt: int) -> None:
    """lookup (and prompt_plain for a keyed first admission): a lookup that differs from plain."""
    try:
        keyed = 1 if (req.lora_request is not None or req.cache_salt or req.mm_features) else 0
        _enqueue(("lookup", step, rid, min(attempt, 0xFFFF), 1 if req.skip_reading_prefix_cache else 0, keyed))
        if keyed and attempt == 0:
            hashes = _plain_chain(sched, req)
            for i in range(0, len(hashes), PROMPT_PIECE):
                _enqueue(("prompt_plain", step, rid, i, hashes[i:i + PROMPT_PIECE]))
    except Exception as e:
        T.error(e)


def _plain_chain(sched, req) -> list[int]:
    """The prompt's full blocks hashed as vLLM hashes them, without extra keys (64-bit form)."""
    from vllm.utils.hashing import get_hash_fn_by_name     # vLLM's own, as the engine configured it
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    bs = _hash_size(sched)
    tokens = req.prompt_token_ids
    parent, out = None, []
    for i in range(req.num_prompt_tokens // bs):
        parent = hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs])
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def _snapshot(sched, ngroups: int = 1) -> None:
    """cached: the prefix cache's block hashes as the hook begins recording for an agent (and,
    with several KV cache groups, each group's: kvtrace.hook.vllm.groups)."""
    try:
        pool = sched.kv_cache_manager.block_pool
        extra = getattr(pool, "cached_block_hashes_by_block", None) or {}
        keys = []   # every BlockHashWithGroupId a block is cached under
        for b in pool.blocks:
            key = b.block_hash
            if key is not None:
                keys.append(key)
                keys.extend(k for k in extra.get(b.block_id, ()) if k != key)
        from_bytes = int.from_bytes
        hashes = [from_bytes(k[-12:-4], "big") for k in keys]
        now, step = _monotonic_ns(), sched.current_step
        served = 2 if S.counting else (1 if step > 0 else 0)
        for i in range(0, max(len(hashes), 1), PROMPT_PIECE):
            _enqueue(("cached", now, step, served, i, len(hashes), hashes[i:i + PROMPT_PIECE]))
        if ngroups > 1:
            groups.snapshot(keys, hashes, now)
    except Exception as e:
        T.error(e)


_NO_STEP = ()   # update_from_output of a step not recorded, with records waiting to be sent


def _update_pre(self, scheduler_output, model_runner_output):
    """Scheduler.update_from_output: the step's summary from schedule(), if any; on a server that
    speculates, with the step's scheduled drafts (kvtrace.hook.vllm.spec)."""
    info = S.steps.pop(id(scheduler_output), None) if S.steps else None
    if info is None:
        return _NO_STEP if (_Q or S.ev is not None) else None
    gone = _dropped(info, scheduler_output) if S.dropped else ()
    if S.spec:
        # (the accepted drafts counted before vLLM trims a finished request's sampled tokens in place)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if gone and drafts:
            drafts = {rid: d for rid, d in drafts.items() if rid not in gone}
        S.spec_now = (drafts, spec.accepted_drafts(drafts, model_runner_output) if drafts else 0)
    return info


def _dropped(info, so) -> tuple:
    """The requests of this step that finished while it was in flight (the batch-queue order of
    async scheduling and pipeline parallelism: vLLM scheduled their next decode before it knew
    of the stop, computes it and drops it as "already finished"): their decode tokens are taken
    out of the step's decode figures (what the requests got), and their drafts out of the
    step's.  The step's total_tokens still counts them: they were computed."""
    key, scheduled, gone = id(so), so.num_scheduled_tokens, []
    for rid, keys in list(S.dropped.items()):
        if key in keys:
            keys.discard(key)
            n = scheduled.get(rid)
            if n:
                info[9] -= 1
                info[10] -= n
                gone.append(rid)
            if not keys:
                del S.dropped[rid]
    return tuple(gone)


def _update_post(self, info, out) -> None:
    try:
        if S.ev is not None:
            _evicts_out()
        now = _monotonic_ns()
        if S.steps and self.finished_req_ids:
            _note_dropped(self.finished_req_ids)
        if info:
            info[4] = now
            _enqueue(info)
            if S.spec:
                (drafts, accepted), S.spec_now = S.spec_now or ({}, 0), None
                for rec in spec.step_records(info[1], now, drafts or {}, accepted, out or {}):
                    _enqueue(rec)
        # (a request still running: not idle, without asking vLLM's three nested calls)
        if now - _last["flush"] >= FLUSH_EVERY_NS or len(_Q) >= FLUSH_RECORDS or (not self.running and _idle(self)):
            _flush(now)
    except Exception as e:
        T.error(e)


def _note_dropped(finished) -> None:
    """Decoding requests that finished while other steps were in flight (S.steps: scheduled, not
    yet updated): _dropped() takes their decode out of those steps.  (The serial EngineCore.step
    never has a step in flight here.)"""
    tracked, dropped = S.reqs, S.dropped
    for rid in finished:
        if rid not in dropped and tracked.get(rid) is _DECODING:
            if len(dropped) >= MAX_TRACKED:
                dropped.clear()
            dropped[rid] = set(S.steps)


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


ALLOC_PARAMS = ("request", "num_new_computed_tokens", "new_computed_blocks", "num_external_computed_tokens",
                "delay_cache_blocks")

# KVCacheManager.allocate_slots, once per running request and step: the request allocating (its
# evictions and a preemption are its doing) and, at an admission, the prefix-cache hit that
# comes with it; a None result is an allocation failure.  An admission granted with external
# tokens (the connector's hit) is a load: kvtrace.hook.vllm.connector.note_alloc.  Allocations do not nest in vLLM 0.32;
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
elif num_external_computed_tokens and new_computed_blocks is not None:
    try:
        _kv_ext_alloc(self, _kv_s.step, request, num_new_computed_tokens, num_external_computed_tokens,
                      delay_cache_blocks)
    except Exception as _kv_e:
        _kv_error(_kv_e)
return _kv_r
"""


def _note_admission_alloc(request, local, blocks, external) -> None:
    """The hit of an admission's allocation.  A request whose connector loaded its KV
    asynchronously is allocated twice: with its hit while the load runs, then, loaded (its
    computed tokens set), with nothing new: the first allocation's hit stands."""
    if not local and not external and request.num_computed_tokens and request.request_id in S.alloc:
        return
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


# The same, in a vLLM whose cached blocks hold one prefix hash each (before 0.24: row
# block_hash_sets of kvtrace.hook.vllm.releases).
EVICT_BODY_ONE_HASH = EVICT_BODY.replace("            _kv_extra = self.cached_block_hashes_by_block.get(_kv_bid)\n",
                                         "            _kv_extra = None\n")
assert EVICT_BODY_ONE_HASH != EVICT_BODY


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
