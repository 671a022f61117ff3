"""The hook's wrappers in SGLang's scheduler process: scheduler iterations, prefill chunks,
admissions with their radix-cache prefix match, evictions of radix-tree leaves, retractions,
arrivals and finishes, as the same records as vLLM's (kvtrace.hook.wire) on the shared queue
(kvtrace.hook.state), and the scheduler's state (G).  What SGLang calls them (docs/hook.md,
"SGLang"):

  Scheduler.get_next_batch_to_run      step start; after it returns, the batch: chunk and admit
                                       records (SGLang admits and allocates inside it)
  Scheduler.process_batch_result       step end: step, finish
  ScheduleBatch.prepare_for_extend     the prefill allocation: whose evictions they are
  Scheduler.update_running_batch       the decode allocation: whose evictions they are
  ScheduleBatch.retract_decode         preempt (SGLang's retraction)
  UnifiedRadixCache._evict_device_leaf evicts: the leaf's hashes, as SGLang's BlockRemoved has them
  Scheduler._add_request_to_queue      arrive

A step is one scheduler iteration that ran a batch; its number is SGLang's forward count.  The
radix cache is token-granular (page size 1): one "block" is one token, its hash SGLang's
KV-event hash of the token's prefix (d_k = SHA256(d_{k-1} || uint32_le(t_k)), its first 8
bytes), computed here once per prompt at first admission.  Token ids never leave the process.
Every wrapper catches its own errors (SGLang's scheduler dies on any exception).
"""
from __future__ import annotations

import hashlib
import time

from .. import state
from ..state import (FLUSH_EVERY_NS, FLUSH_RECORDS, MAX_TRACKED, _enqueue, _flush, _hook_start, _leave_if_owner_gone,
                     _monotonic_ns, _new_agent, _refresh)
from ..wire import EVICTS_MAX, PROMPT_PIECE

T, _Q, _LOCK, _last = state.T, state._Q, state._LOCK, state._last   # (bound by assignment: kvtrace.hook.state)
SALT_SEED = b"sglang-cache-salt-v1\x00"


class _Sglang:
    """The scheduler's state, reset whenever the agent goes away."""

    __slots__ = ("on", "rec", "step", "t0", "t_sched", "cur_req", "reqs", "done", "ev", "evicted", "retracted",
                 "admits", "seen_check", "agents", "version", "page")

    def __init__(self):
        self.version, self.page = "", 1
        self.reset()

    def reset(self):
        self.on = self.rec = False
        self.step = self.t0 = self.t_sched = 0
        self.cur_req = ""
        self.reqs: dict[str, list] = {}     # rid -> [next chunk index, prefill_len, attempt]
        self.done: dict[str, None] = {}     # rids reported finished (bounded)
        self.ev: list | None = None         # the open `evicts` batch
        self.evicted = self.retracted = 0
        self.admits = [0, 0]                # new, resumed admissions of the step
        self.seen_check = 0
        self.agents: frozenset = frozenset()


G = _Sglang()


def _on(sched) -> None:
    G.reset()
    G.on = G.rec = True
    _new_agent(G)
    _hook_start("engine", "sglang", G.version, G.page)
    _snapshot(sched)


def _snapshot(sched) -> None:
    """The `cached` record at attach, without hashes: the radix tree's tokens are not listed (a
    request's hit is in its admit record, an eviction's hashes in its evicts record).  served: 0
    when the tree had evicted nothing before (so every token absent from it was never stored: a
    miss on it is cold), 1 when it had, 2 unknown (SGLang's metrics off)."""
    served = 2
    try:
        mc = sched.tree_cache.metrics_collector
        if mc is not None:
            served = 1 if mc.eviction_num_tokens.labels(**mc.labels)._value.get() else 0
    except Exception as e:
        T.error(e)
    _enqueue(("cached", _monotonic_ns(), sched.forward_ct + 1, served, 0, 0, []))


def _off() -> None:
    G.reset()
    with _LOCK:
        _Q.clear()
    _leave_if_owner_gone()


# ---------------------------------------------------------------------------------------------
# The iteration


def _next_pre(self):
    """Scheduler.get_next_batch_to_run: the iteration's start when recorded, else None."""
    try:
        t0 = _monotonic_ns()
        if not (_refresh() if t0 >= T.next_check else T.enabled):
            if G.on:
                _off()
            return None
        if not G.on:
            _on(self)
        elif T.next_check != G.seen_check and _new_agent(G):
            _hook_start("engine", "sglang", G.version, G.page)
            _snapshot(self)
        G.step = self.forward_ct + 1
        G.t0 = t0
        G.cur_req = ""
        G.evicted = G.retracted = 0
        G.admits = [0, 0]
        return t0
    except Exception as e:
        T.error(e)
        return None


def _next_post(self, t0, plan) -> None:
    """After get_next_batch_to_run: the batch it made (chunks and admissions of an extend batch)."""
    try:
        G.cur_req = ""
        batch = plan.batch_to_run
        if batch is None:
            if G.ev is not None:
                _evicts_out()
            return
        G.t_sched = _monotonic_ns()
        if batch.forward_mode.is_extend():
            _extend(self, batch)
    except Exception as e:
        T.error(e)


def _extend(sched, batch) -> None:
    step, reqs, tracked = G.step, batch.reqs, G.reqs
    chunked = batch.chunked_req
    for req, start, n in zip(reqs, batch.prefix_lens, batch.extend_lens):
        rid = req.rid
        attempt = min(req.retraction_count, 0xFFFF)
        prefill_len = len(req.full_untruncated_fill_ids)
        prompt_len = len(req.origin_input_ids)
        st = tracked.get(rid)
        if st is None or st[2] != attempt:       # an admission: its first chunk
            resumed = 1 if attempt else 0
            G.admits[resumed] += 1
            host = int(getattr(req, "host_loaded_length", 0) or 0)
            hashes = _prefix_hashes(req, req.origin_input_ids if attempt == 0 else req.full_untruncated_fill_ids)
            last = hashes[start - 1] if hashes and start else 0
            _enqueue(("admit", step, rid, attempt, prompt_len, prefill_len, start - host, host, start, start, last,
                      resumed))
            if attempt == 0:
                _arrive_if_unseen(step, req)
                _prompt_blocks(step, rid, req, hashes)
            elif hashes is not None:   # a retracted request comes back with its output tokens
                for first in range(prompt_len, len(hashes), PROMPT_PIECE):
                    _enqueue(("resume_blocks", step, rid, attempt, first, hashes[first:first + PROMPT_PIECE]))
            if len(tracked) >= MAX_TRACKED:
                tracked.clear()
            st = tracked[rid] = [0, prefill_len, attempt]
        idx = st[0]
        st[0] = idx + 1
        last_chunk = 1 if req is not chunked else 0
        _enqueue(("chunk", step, rid, attempt, idx, start, n, prompt_len, prefill_len, last_chunk, 1 if attempt else 0))


def _result_pre(self, batch):
    """Scheduler.process_batch_result: the batch, when its step is recorded, else None."""
    return batch if (G.rec and G.t0) else None


def _result_done(self, batch, out) -> None:
    """After process_batch_result: the step's end (its record) and the requests it finished."""
    try:
        now = _monotonic_ns()
        if G.ev is not None:
            _evicts_out()
        reqs = batch.reqs
        mode = batch.forward_mode
        extend = mode.is_extend()
        prefill_tokens = sum(batch.extend_lens) if extend else 0
        decode = 0 if extend else len(reqs)
        finished = 0
        done = G.done
        for req in reqs:
            if req.finished() and req.rid not in done:
                if len(done) >= MAX_TRACKED:
                    done.clear()
                done[req.rid] = None
                G.reqs.pop(req.rid, None)
                finished += 1
                _enqueue(("finish", G.step, G.t0, req.rid))
        n = len(reqs)
        running = len(self.running_batch.reqs) if self.running_batch is not None else 0
        try:
            free = int(self.token_to_kv_pool_allocator.available_size())
        except Exception:
            free = 0
        _enqueue(("step", G.step, G.t0, G.t_sched or G.t0, now, n, prefill_tokens + decode, n if extend else 0,
                  prefill_tokens, decode, decode, G.admits[0], G.admits[1], G.retracted, G.evicted, 0, running,
                  len(self.waiting_queue), free, finished))
        G.t0 = G.t_sched = 0
        if now - _last["flush"] >= FLUSH_EVERY_NS or len(_Q) >= FLUSH_RECORDS or not (self.waiting_queue or running):
            _flush(now)
    except Exception as e:
        T.error(e)


# ---------------------------------------------------------------------------------------------
# Who allocates: the evictions of a prefill batch go to the request whose tokens did not fit


def _extend_alloc_pre(self):
    """ScheduleBatch.prepare_for_extend: the request whose allocation overruns the free tokens."""
    if not G.rec:
        return None
    try:
        prev = G.cur_req
        avail = int(self.token_to_kv_pool_allocator.available_size())
        total, who = 0, ""
        for req in self.reqs:    # the batch's extend_lens are set inside prepare_for_extend
            total += req.extend_len
            who = req.rid
            if total > avail:
                break
        G.cur_req = who
        return prev
    except Exception as e:
        T.error(e)
        return None


def _alloc_done(self, prev, out=None) -> None:
    G.cur_req = prev or ""


def _decode_alloc_pre(self, batch):
    """Scheduler.update_running_batch: a decode step's allocation (its last request's, as the
    newest one SGLang keeps)."""
    if not G.rec:
        return None
    try:
        prev = G.cur_req
        G.cur_req = batch.reqs[-1].rid if batch is not None and batch.reqs else ""
        return prev
    except Exception as e:
        T.error(e)
        return None


# ---------------------------------------------------------------------------------------------
# Retraction, eviction, arrival


def _retract_pre(self):
    """ScheduleBatch.retract_decode: each request's computed tokens before it."""
    if not G.rec:
        return None
    try:
        return {r.rid: len(r.origin_input_ids) + len(r.output_ids) for r in self.reqs}
    except Exception as e:
        T.error(e)
        return None


def _retract_done(self, before, out) -> None:
    try:
        retracted = out[0] if out else ()
        now = _monotonic_ns()
        for req in retracted:
            n = before.get(req.rid, 0)
            G.reqs.pop(req.rid, None)
            G.retracted += 1
            _enqueue(("preempt", G.step, now, req.rid, n, n, min(req.retraction_count, 0xFFFF), ""))
    except Exception as e:
        T.error(e)


def _evict_pre(self, node_id):
    """UnifiedRadixCache._evict_device_leaf: the leaf's hashes, read before it goes."""
    if not G.rec:
        return None
    try:
        return (node_id, self.tree_core.get_hash_values(node_id))
    except Exception as e:
        T.error(e)
        return None


def _evict_done(self, t, out) -> None:
    try:
        node_id, hexes = t
        b = G.ev
        if b is None or b[0] != G.step or b[3] != G.cur_req or len(b[4]) >= 2 * EVICTS_MAX:
            if b is not None:
                _enqueue(("evicts", *b))
            b = G.ev = [G.step, time.monotonic_ns(), "GPU", G.cur_req, []]
        blocks, nid = b[4], int(node_id) & 0xFFFFFFFF
        for h in hexes or ():
            G.evicted += 1
            blocks.append(int(h[:16], 16))
            blocks.append(nid)
            if len(blocks) >= 2 * EVICTS_MAX:
                _enqueue(("evicts", *b))
                b = G.ev = [G.step, b[1], "GPU", G.cur_req, []]
                blocks = b[4]
    except Exception as e:
        T.error(e)


def _evicts_out() -> None:
    if G.ev[4]:
        _enqueue(("evicts", *G.ev))
    G.ev = None


def _queue_pre(self, req, is_retracted):
    """Scheduler._add_request_to_queue: a new request's arrival (a retracted one comes back)."""
    if not G.rec or is_retracted:
        return None
    return req


def _queue_post(self, req, out) -> None:
    try:
        G.done.pop(req.rid, None)
        _enqueue(("arrive", G.step, _monotonic_ns(), req.rid, "", ""))
        G.reqs.pop(req.rid, None)
        req._kvtrace_arrived = True
    except Exception as e:
        T.error(e)


def _arrive_if_unseen(step: int, req) -> None:
    """A request queued before the agent attached arrives at its admission (time unknown: 0)."""
    if not getattr(req, "_kvtrace_arrived", False):
        _enqueue(("arrive", step, 0, req.rid, "", ""))


# ---------------------------------------------------------------------------------------------
# Prompt structure: SGLang's own KV-event hash of each prompt token's prefix


def _prefix_hashes(req, tokens) -> list[int] | None:
    """The per-token chain (page size 1) of ``tokens`` (the prompt; after a retraction the prompt
    and its output) as SGLang's KV events carry it, unsigned; None for a LoRA request (SGLang
    namespaces those hashes further)."""
    try:
        if getattr(req, "lora_id", None):
            return None
        salt = getattr(req, "cache_salt", None)
        d = hashlib.sha256(SALT_SEED + salt.encode()).digest() if salt else b""
        sha, out = hashlib.sha256, []
        append = out.append
        for t in tokens:
            d = sha(d + int(t).to_bytes(4, "little")).digest()
            append(int.from_bytes(d[:8], "big"))
        return out
    except Exception as e:
        T.error(e)
        return None


def _prompt_blocks(step: int, rid: str, req, hashes) -> None:
    if hashes is None:
        return
    n = len(hashes)
    max_out = min(int(getattr(req.sampling_params, "max_new_tokens", 0) or 0), 0xFFFFFFFF)
    for first in range(0, max(n, 1), PROMPT_PIECE):
        _enqueue(("prompt_blocks", step, rid, 1, n, max_out, n, first, hashes[first:first + PROMPT_PIECE]))
