"""SGLang's wrappers (kvtrace.hook.sglang) on stand-ins of SGLang's scheduler, batch and radix
cache, driven through scheduler iterations with an agent attached.  What the agent decodes from
the marker frames (admissions with their hits, chunks, evictions and whose allocation made them,
retractions, arrivals, finishes, prompt hashes, steps) is exactly what each scenario implies,
worked out here from the stand-ins and SGLang's hash rule, not from the hook's code.  (The same
against a real SGLang server: tests/sglang/test_sglang.py.)"""
from __future__ import annotations

import hashlib
import struct
from types import SimpleNamespace as NS

import pytest

from kvtrace.hook import state
from kvtrace.hook.sglang import engine as sg
from kvtrace.hook.sglang import hook as sglang_hook
from tests import hookframes


def digests(tokens, salt=None) -> list[bytes]:
    """SGLang's KV-event hash of each token's prefix (page size 1): d_k = SHA256(d_{k-1} ||
    uint32_le(t_k)), from SHA256("sglang-cache-salt-v1\\0" + salt) when salted, else from nothing."""
    d = hashlib.sha256(b"sglang-cache-salt-v1\x00" + salt.encode()).digest() if salt else b""
    out = []
    for t in tokens:
        d = hashlib.sha256(d + struct.pack("<I", t)).digest()
        out.append(d)
    return out


def chain(tokens, salt=None) -> list[int]:
    """The hashes as SGLang's BlockStored/BlockRemoved carry them: each digest's first 8 bytes."""
    return [int.from_bytes(d[:8], "big") for d in digests(tokens, salt)]


# ---------------------------------------------------------------------------------------------
# Stand-ins: SGLang's classes as the hook sees them (kvtrace.hook.sglang.needs), with a token
# pool whose free slots a radix cache of leaves (least recently used first) gives back.


class Req:
    def __init__(self, rid, prompt, max_new, base, salt=None, host=0):
        self.rid, self.origin_input_ids, self.output_ids, self.base = rid, list(prompt), [], base
        self.sampling_params, self.cache_salt, self.lora_id = NS(max_new_tokens=max_new), salt, None
        self.retraction_count = self.extend_len = self.own = self.computed = 0
        self.host_loaded_length = host

    @property
    def full_untruncated_fill_ids(self):
        return self.origin_input_ids + self.output_ids

    def finished(self):
        return len(self.output_ids) >= self.sampling_params.max_new_tokens


class Allocator:
    def __init__(self, free):
        self.free = free

    def available_size(self):
        return self.free


class UnifiedRadixCache:
    def __init__(self, alloc):
        self.alloc, self.leaves, self.locked, self.evicted = alloc, {}, set(), []
        self.tree_core = NS(values={})
        self.tree_core.get_hash_values = lambda node_id: self.tree_core.values[node_id]
        never_evicted = NS(_value=NS(get=lambda: 0))
        self.metrics_collector = NS(labels={"model_name": "m"}, eviction_num_tokens=NS(labels=lambda **kw: never_evicted))

    def insert(self, node_id, prefix, tokens, salt=None):
        """A leaf of tokens already in the pool, after ``prefix``."""
        self.leaves[node_id] = (list(prefix), list(tokens))
        self.tree_core.values[node_id] = [d.hex() for d in digests(list(prefix) + list(tokens), salt)[len(prefix):]]

    def match(self, tokens) -> tuple[int, int | None]:
        best = (0, None)
        for node_id, (prefix, own) in self.leaves.items():
            seq, n = prefix + own, 0
            while n < min(len(seq), len(tokens)) and seq[n] == tokens[n]:
                n += 1
            best = max(best, (n, node_id), key=lambda b: b[0])
        return best

    def evictable(self) -> int:
        return sum(len(own) for n, (_, own) in self.leaves.items() if n not in self.locked)

    def make_room(self, need):
        for node_id in [n for n in self.leaves if n not in self.locked]:
            if self.alloc.free >= need:
                return
            self._evict_device_leaf(node_id)

    def _evict_device_leaf(self, node_id):
        _, own = self.leaves.pop(node_id)
        del self.tree_core.values[node_id]
        self.alloc.free += len(own)
        self.evicted.append(node_id)


class ScheduleBatch:
    def __init__(self, sched, reqs, extend, prefix_lens=(), chunked_req=None):
        self.sched, self.reqs, self.forward_mode = sched, list(reqs), NS(is_extend=lambda: extend)
        self.prefix_lens, self.extend_lens, self.chunked_req = list(prefix_lens), [], chunked_req
        self.token_to_kv_pool_allocator = sched.token_to_kv_pool_allocator

    def prepare_for_extend(self):
        self.extend_lens = [r.extend_len for r in self.reqs]
        self.allocate(sum(self.extend_lens))
        for r, n in zip(self.reqs, self.extend_lens):
            r.own += n
            r.computed += n

    def allocate(self, need):
        self.sched.tree_cache.make_room(need)
        assert self.token_to_kv_pool_allocator.free >= need, "the scenario ran out of slots"
        self.token_to_kv_pool_allocator.free -= need

    def retract_decode(self, server_args=None):
        req = self.reqs.pop()
        req.retraction_count += 1
        self.token_to_kv_pool_allocator.free += req.own
        req.own = req.computed = 0
        return [req], 0.5, []


class Scheduler:
    """``next``: what the next iteration runs: None (nothing), "decode" (the running batch), or
    [(request, most tokens it may compute)] (an extend batch)."""

    def __init__(self, free):
        self.token_to_kv_pool_allocator = Allocator(free)
        self.tree_cache = UnifiedRadixCache(self.token_to_kv_pool_allocator)
        self.forward_ct, self.waiting_queue, self.running_batch, self.next = 0, [], NS(reqs=[]), None
        self.node_ids = iter(range(100, 200))

    def _add_request_to_queue(self, req, is_retracted=False):
        self.waiting_queue.append(req)

    def get_next_batch_to_run(self, running_batch=None, last_batch=None):
        what, self.next = self.next, None
        if what is None:
            return NS(batch_to_run=None)
        if what == "decode":
            batch = ScheduleBatch(self, self.running_batch.reqs, False)
            self.update_running_batch(batch)
            return NS(batch_to_run=batch)
        prefix, chunked = [], None
        for req, limit in what:
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
            if not req.computed:    # an admission: the cache's match, and what HiCache loaded from host
                n, node_id = self.tree_cache.match(req.full_untruncated_fill_ids)
                self.tree_cache.locked.add(node_id)
                req.computed = n + req.host_loaded_length
            prefix.append(req.computed)
            req.extend_len = min(limit, len(req.full_untruncated_fill_ids) - req.computed)
            if req.computed + req.extend_len < len(req.full_untruncated_fill_ids):
                chunked = req
        batch = ScheduleBatch(self, [r for r, _ in what], True, prefix, chunked)
        batch.prepare_for_extend()
        return NS(batch_to_run=batch)

    def update_running_batch(self, batch):
        if self.token_to_kv_pool_allocator.free + self.tree_cache.evictable() < len(batch.reqs):
            retracted, _, _ = batch.retract_decode()
            for req in retracted:
                self._add_request_to_queue(req, is_retracted=True)
            self.running_batch.reqs = list(batch.reqs)
        batch.allocate(len(batch.reqs))
        for r in batch.reqs:    # the KV of each request's last token
            r.own += 1
            r.computed += 1

    def process_batch_result(self, batch, result):
        for req in batch.reqs:
            if req is batch.chunked_req:
                continue
            req.output_ids.append(req.base + len(req.output_ids) + 1)
            if req not in self.running_batch.reqs:
                self.running_batch.reqs.append(req)
            if req.finished():      # its tokens stay in the pool, as a leaf of the cache
                self.running_batch.reqs.remove(req)
                fill = req.full_untruncated_fill_ids
                self.tree_cache.insert(next(self.node_ids), fill[:req.computed - req.own],
                                       fill[req.computed - req.own:req.computed], req.cache_salt)
        self.forward_ct += 1

    def iteration(self, what=None):
        """One pass of SGLang's event loop: pick a batch, run it, process its result."""
        self.next = what
        batch = self.get_next_batch_to_run(self.running_batch, None).batch_to_run
        if batch is not None:
            self.process_batch_result(batch, None)


STANDINS = {c.__name__: c for c in (Scheduler, ScheduleBatch, UnifiedRadixCache)}
for _label, _wrap in sglang_hook.WRAPPERS.items():     # what install() patches in SGLang's classes
    _cls, _name = _label.split(".")
    setattr(STANDINS[_cls], _name, _wrap(STANDINS[_cls].__dict__[_name]))


# ---------------------------------------------------------------------------------------------
# The agent: a flag entry naming this process, marker writes received (tests/hookframes.py)


@pytest.fixture
def received(tmp_path, monkeypatch):
    """Records the agent decodes, by table, from every frame the hook sent (sent now)."""
    monkeypatch.setattr(sg.G, "version", "0.5.23")
    sg.G.reset()
    with hookframes.receiver(tmp_path, monkeypatch) as records:
        yield records
    sg.G.reset()


def rows(got: dict, table: str, *fields: str) -> list[tuple]:
    return [tuple(r[f] for f in fields) for r in got.get(table, [])]


STEP = ("step", "num_reqs", "total_tokens", "prefill_reqs", "prefill_tokens", "decode_reqs", "decode_tokens",
        "new_reqs", "resumed_reqs", "preempted", "evicted", "alloc_failures", "running", "waiting", "free_blocks",
        "finished")
ADMIT = ("step", "request", "attempt", "prompt_len", "prefill_len", "cached_local", "cached_external", "start",
         "hit_blocks", "last_hit_hash", "resumed")
CHUNK = ("step", "request", "attempt", "chunk_index", "start", "length", "prompt_len", "prefill_len", "last", "resumed")
EVICT = ("step", "request", "block_id", "block_hash", "group", "medium")


def evicted(step, request, node_id, hashes):
    return [(step, request, node_id, h, 0, "GPU") for h in hashes]


# ---------------------------------------------------------------------------------------------


def test_hits_chunks_and_evictions_of_extend_and_decode_allocations(received):
    """Five free slots; the cache holds X [1,2,3,4] (node 7), Y [9,9,9] (8), Z = X + [7,7] (9)
    and W [40,41,42] (10), least recently used first after X, which A's match locks.

    1  extend A (hits X: 4), B (salted, a chunk of 4 of its 6): 6 slots for 5 free; A's 2 fit,
       B's do not: Y goes, for B
    2  extend B's last 2, C (hits X: 4 on the device, 2 more loaded from host): 4 slots for 2
       free; B's fit, C's do not: Z goes, for C
    3  decode A, B, C: W goes, for C (the newest); B finishes, its 7 tokens stay as a leaf
    4  decode A, C: B's leaf goes, for C; A finishes"""
    sched = Scheduler(free=5)
    for node_id, prefix, tokens in ((7, [], [1, 2, 3, 4]), (8, [], [9, 9, 9]), (9, [1, 2, 3, 4], [7, 7]),
                                    (10, [], [40, 41, 42])):
        sched.tree_cache.insert(node_id, prefix, tokens)
    a = Req("A", [1, 2, 3, 4, 5, 6], max_new=3, base=100)
    b = Req("B", [20, 21, 22, 23, 24, 25], max_new=2, base=200, salt="s1")
    c = Req("C", [1, 2, 3, 4, 5, 6, 7, 8], max_new=4, base=300, host=2)
    sched.iteration()                                   # recording begins
    sched._add_request_to_queue(a)
    sched._add_request_to_queue(b)
    sched.iteration([(a, 99), (b, 4)])
    sched._add_request_to_queue(c)
    sched.iteration([(b, 99), (c, 99)])
    sched.iteration("decode")
    sched.iteration("decode")
    got = received()

    assert [r["name"] for r in got["engine"]] == ["sglang"] and got["engine"][0]["block_size"] == 1
    assert rows(got, "hook_start", "role", "vllm_version") == [("engine", "0.5.23")]
    assert rows(got, "cached", "step", "served", "total") == [(1, 0, 0)]   # the tree had evicted nothing
    ha, hb, hc = chain(a.origin_input_ids), chain(b.origin_input_ids, "s1"), chain(c.origin_input_ids)
    assert rows(got, "admit", *ADMIT) == [(1, "A", 0, 6, 6, 4, 0, 4, 4, ha[3], 0),
                                          (1, "B", 0, 6, 6, 0, 0, 0, 0, 0, 0),
                                          (2, "C", 0, 8, 8, 4, 2, 6, 6, hc[5], 0)]
    assert rows(got, "chunk", *CHUNK) == [(1, "A", 0, 0, 4, 2, 6, 6, 1, 0), (1, "B", 0, 0, 0, 4, 6, 6, 0, 0),
                                          (2, "B", 0, 1, 4, 2, 6, 6, 1, 0), (2, "C", 0, 0, 6, 2, 8, 8, 1, 0)]
    assert sched.tree_cache.evicted == [8, 9, 10, 100]
    b_leaf = chain([20, 21, 22, 23, 24, 25, 201], "s1")
    assert rows(got, "evict", *EVICT) == (evicted(1, "B", 8, chain([9, 9, 9]))
                                          + evicted(2, "C", 9, chain([1, 2, 3, 4, 7, 7])[4:])
                                          + evicted(3, "C", 10, chain([40, 41, 42]))
                                          + evicted(4, "C", 100, b_leaf))
    assert rows(got, "prompt_blocks", "step", "request", "block_size", "prompt_len", "max_output", "num_blocks",
                "first", "hashes") == [(1, "A", 1, 6, 3, 6, 0, ha), (1, "B", 1, 6, 2, 6, 0, hb),
                                       (2, "C", 1, 8, 4, 8, 0, hc)]
    assert b_leaf[:6] == hb     # an evicted prompt token has the hash its prompt_blocks gave it
    assert rows(got, "step", *STEP) == [(1, 2, 6, 2, 6, 0, 0, 2, 0, 0, 3, 0, 1, 0, 2, 0),
                                        (2, 2, 4, 2, 4, 0, 0, 1, 0, 0, 2, 0, 3, 0, 0, 0),
                                        (3, 3, 3, 0, 0, 3, 3, 0, 0, 0, 3, 0, 2, 0, 0, 1),
                                        (4, 2, 2, 0, 0, 2, 2, 0, 0, 0, 7, 0, 1, 0, 5, 1)]
    assert all(s["t_start_ns"] <= s["t_sched_end_ns"] <= s["t_end_ns"] for s in got["step"])
    assert rows(got, "arrive", "step", "request") == [(1, "A"), (1, "B"), (1, "C")]
    assert all(r["t_ns"] > 0 for r in got["arrive"])   # queued while recording: the time it came
    assert rows(got, "finish", "step", "request") == [(3, "B"), (4, "A")]
    assert "preempt" not in got and "resume_blocks" not in got


def test_a_retracted_request_is_preempted_and_comes_back_resumed(received):
    """Seven free slots, an empty cache.

    1  extend D (3 tokens), E (4): they fill the pool
    2  decode D, E: no slot and nothing to evict: E is retracted (5 tokens computed: 4 of its
       prompt and its first output), back in the queue; D finishes, its 4 tokens a leaf
    3  extend E again (attempt 1: its prompt and its output, nothing cached): D's leaf goes, for E"""
    sched = Scheduler(free=7)
    d = Req("D", [50, 51, 52], max_new=2, base=500)
    e = Req("E", [60, 61, 62, 63], max_new=5, base=600)
    sched.iteration()
    sched._add_request_to_queue(d)
    sched._add_request_to_queue(e)
    sched.iteration([(d, 99), (e, 99)])
    sched.iteration("decode")
    sched.iteration([(e, 99)])
    got = received()

    assert rows(got, "preempt", "step", "request", "computed_before", "num_tokens", "num_preemptions",
                "for_request") == [(2, "E", 5, 5, 1, "")]
    he = chain([60, 61, 62, 63, 601])
    assert rows(got, "admit", *ADMIT) == [(1, "D", 0, 3, 3, 0, 0, 0, 0, 0, 0), (1, "E", 0, 4, 4, 0, 0, 0, 0, 0, 0),
                                          (3, "E", 1, 4, 5, 0, 0, 0, 0, 0, 1)]
    assert rows(got, "chunk", *CHUNK) == [(1, "D", 0, 0, 0, 3, 3, 3, 1, 0), (1, "E", 0, 0, 0, 4, 4, 4, 1, 0),
                                          (3, "E", 1, 0, 0, 5, 4, 5, 1, 1)]
    assert rows(got, "resume_blocks", "step", "request", "attempt", "first", "hashes") == [(3, "E", 1, 4, he[4:])]
    assert rows(got, "prompt_blocks", "request", "hashes") == [("D", chain([50, 51, 52])), ("E", he[:4])]
    assert rows(got, "evict", *EVICT) == evicted(3, "E", 100, chain([50, 51, 52, 501]))
    assert rows(got, "step", *STEP) == [(1, 2, 7, 2, 7, 0, 0, 2, 0, 0, 0, 0, 2, 0, 0, 0),
                                        (2, 1, 1, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 3, 1),
                                        (3, 1, 5, 1, 5, 0, 0, 0, 1, 0, 4, 0, 1, 0, 2, 0)]
    assert rows(got, "arrive", "step", "request") == [(1, "D"), (1, "E")]   # a retracted request does not arrive again
    assert rows(got, "finish", "step", "request") == [(2, "D")]


def test_nothing_is_recorded_without_an_agent(received, tmp_path, monkeypatch):
    monkeypatch.setattr(state.T, "flag_path", str(tmp_path / "nobody"))
    sched = Scheduler(free=4)
    a = Req("A", [1, 2], max_new=1, base=100)
    sched._add_request_to_queue(a)
    sched.iteration([(a, 99)])
    assert received() == {} and not sg.G.on and a.output_ids == [101]
