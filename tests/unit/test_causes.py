"""The miss-cause replay (kvtrace.correlate.causes) on hand-built hook records: each cause made
a known number of times, every admission tiled exactly.  (Against a real vLLM server:
tests/vllm/test_causes.py.)"""
from __future__ import annotations

from kvtrace.correlate.causes import CAUSES, CacheReplay, causes_of

B = 4          # tokens per block in these records
PID = 7


def chain(name: str, n: int) -> list[int]:
    """n distinct 64-bit-ish hashes named after ``name`` (a shared prefix: the same name)."""
    return [hash((name, i)) & (2**64 - 1) for i in range(n)]


class Run:
    """Records of one engine, step by step, in vLLM's order within a step."""

    def __init__(self, served: int = 0):
        self.replay = CacheReplay()
        self.replay.structure(cached=[{"pid": PID, "first": 0, "served": served, "hashes": []}])
        self.step = 0
        self.segments = []

    def prompt(self, req: str, hashes: list[int], plain: list[int] | None = None, skipped=False):
        rows = {"prompt_blocks": [{"pid": PID, "request": req, "block_size": B, "first": 0, "hashes": hashes}]}
        if plain is not None or skipped:
            rows["lookup"] = [{"pid": PID, "request": req, "attempt": 0, "skipped": int(skipped),
                               "keyed": int(plain is not None)}]
        if plain is not None:
            rows["prompt_plain"] = [{"pid": PID, "request": req, "first": 0, "hashes": plain}]
        self.replay.structure(**rows)

    def do(self, admits=(), chunks=(), evicts=(), preempts=(), finishes=()):
        """One step.  admits: (req, attempt, prefill_len, local, external); chunks: (req, attempt,
        start, length) in scheduling order; evicts: (hash, by request)."""
        self.step += 1
        s = self.step
        t = s * 1_000_000
        segs = self.replay.feed(
            [{"pid": PID, "step": s, "t_start_ns": t}],
            [{"pid": PID, "step": s, "request": r, "attempt": a, "prefill_len": n, "cached_local": l,
              "cached_external": x} for r, a, n, l, x in admits],
            [{"pid": PID, "step": s, "request": r, "attempt": a, "start": st, "length": ln} for r, a, st, ln in chunks],
            [{"pid": PID, "step": s, "t_ns": t + 10, "block_hash": h, "request": by} for h, by in evicts],
            [{"pid": PID, "step": s, "request": r} for r in preempts],
            [{"pid": PID, "step": s, "request": r} for r in finishes])
        self.segments += segs
        return segs

    def causes(self, req: str, attempt: int = 0) -> dict[str, int]:
        got = causes_of([s for s in self.segments if s.request == req])[attempt]
        return {k: v for k, v in got.items() if v}


def test_cold_tail_and_a_hit():
    run = Run()
    a = chain("a", 4)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 18, 0, 0)], chunks=[("A", 0, 0, 18)])
    # 16 tokens in 4 full blocks, but vLLM hits at most 17: blocks 0-3 cold, the last 2 tokens the tail
    assert run.causes("A") == {"miss_cold": 16, "miss_tail": 2}
    run.prompt("A2", a)
    run.do(admits=[("A2", 0, 18, 16, 0)], chunks=[("A2", 0, 16, 2)], finishes=["A"])
    assert run.causes("A2") == {"hit_local": 16, "miss_tail": 2}
    # a prompt ending on a block boundary: its last block is the tail (vLLM computes the last token)
    run.prompt("A3", a)
    run.do(admits=[("A3", 0, 16, 12, 0)], chunks=[("A3", 0, 12, 4)])
    assert run.causes("A3") == {"hit_local": 12, "miss_tail": 4}


def test_evicted_with_its_eviction():
    run = Run()
    a, f = chain("a", 3), chain("f", 3)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 13, 0, 0)], chunks=[("A", 0, 0, 13)])
    run.prompt("F", f)
    run.do(admits=[("F", 0, 13, 0, 0)], chunks=[("F", 0, 0, 13)], evicts=[(a[2], "F"), (a[1], "F")], finishes=["A"])
    run.do(evicts=[(a[0], "G")])
    run.prompt("A2", a)
    segs = run.do(admits=[("A2", 0, 13, 0, 0)], chunks=[("A2", 0, 0, 13)])
    assert run.causes("A2") == {"miss_evicted": 12, "miss_tail": 1}
    ev = [s for s in segs if s.cause == "miss_evicted"]
    assert [(s.start, s.end, s.block_hash, s.evicted_by, s.distance_blocks) for s in ev] == [
        (0, 4, a[0], "G", 1), (4, 8, a[1], "F", 2), (8, 12, a[2], "F", 3)]
    assert ev[0].distance_ns == 4_000_000 - 3_000_010 and ev[1].evict_ns == 2_000_010


def test_inflight_while_a_running_request_computes_the_prefix():
    run = Run()
    c = chain("c", 6)
    run.prompt("C", c)
    run.prompt("D", c[:3] + chain("d", 3))
    # C's first chunk computes blocks 0-1 before D's lookup in the same step; blocks 2-5 are still to come
    run.do(admits=[("C", 0, 26, 0, 0), ("D", 0, 26, 8, 0)], chunks=[("C", 0, 0, 8), ("D", 0, 8, 8)])
    assert run.causes("D") == {"hit_local": 8, "miss_inflight": 4, "miss_cold": 12, "miss_tail": 2}
    assert {s.computing for s in run.segments if s.cause == "miss_inflight"} == {"C"}


def test_other_key_not_looked_up_and_the_chain_break():
    run = Run()
    a = chain("a", 3)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 13, 0, 0)], chunks=[("A", 0, 0, 13)])
    salted = chain("salted", 3)
    run.prompt("S", salted, plain=a)             # the same tokens under a cache_salt
    run.do(admits=[("S", 0, 13, 0, 0)], chunks=[("S", 0, 0, 13)])
    assert run.causes("S") == {"miss_other_key": 12, "miss_tail": 1}
    run.prompt("P", a, skipped=True)              # prompt logprobs: no lookup
    run.do(admits=[("P", 0, 13, 0, 0)], chunks=[("P", 0, 0, 13)])
    assert run.causes("P") == {"miss_not_looked_up": 13}
    # a[0] evicted, a[1] and a[2] still cached: vLLM's lookup stops at block 0
    run.do(evicts=[(a[0], "X")], finishes=["A", "S", "P"])
    run.prompt("A2", a)
    run.do(admits=[("A2", 0, 13, 0, 0)], chunks=[("A2", 0, 0, 13)])
    assert run.causes("A2") == {"miss_evicted": 12, "miss_tail": 1}
    assert [s.block_hash for s in run.segments if s.request == "A2" and s.cause == "miss_evicted"] == [a[0], 0]


def test_unseen_when_the_server_served_before_the_agent():
    run = Run(served=1)
    run.prompt("U", chain("u", 2))
    run.do(admits=[("U", 0, 9, 0, 0)], chunks=[("U", 0, 0, 9)])
    assert run.causes("U") == {"miss_unseen": 8, "miss_tail": 1}


def test_readmission_after_preemption():
    run = Run()
    a = chain("a", 2)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 9, 0, 0)], chunks=[("A", 0, 0, 9)])
    # preempted with 12 tokens (9 prompt + 3 generated), its blocks evicted in part, then back
    run.do(preempts=["A"], evicts=[(a[1], "B")])
    gen = chain("gen", 1)
    run.replay.structure(resume_blocks=[{"pid": PID, "request": "A", "attempt": 1, "first": 2, "hashes": gen}])
    run.do(admits=[("A", 1, 12, 4, 0)], chunks=[("A", 1, 4, 8)])
    # 12 tokens: block 0 found again, block 1 evicted meanwhile, and past the 8 tokens vLLM can hit
    # (it computes the last token) the tail, generated block included
    assert run.causes("A", 1) == {"hit_local": 4, "miss_evicted": 4, "miss_tail": 4}


def test_every_admission_sums_to_its_prefill():
    run = Run()
    for k in range(20):
        h = chain(f"p{k % 3}", 5)
        run.prompt(f"R{k}", h)
        hit = 8 if k >= 3 else 0
        run.do(admits=[(f"R{k}", 0, 21, hit, 0)], chunks=[(f"R{k}", 0, hit, 21 - hit)],
               evicts=[(h[4], f"R{k}")] if k % 4 == 0 else [])
    for k in range(20):
        got = causes_of([s for s in run.segments if s.request == f"R{k}"])[0]
        assert sum(got.values()) == 21 and set(got) == set(CAUSES)


def test_a_finished_request_leaves_nothing_behind_after_its_chunks_are_read():
    """Live, feed after feed: a finished request's chain, lookups and segments go (memory stays
    bounded by the requests in flight), but not before the chunks of the pass it finished in are read."""
    run = Run()
    run.prompt("A", chain("a", 4), skipped=True)
    run.do(admits=[("A", 0, 8, 0, 0)], chunks=[("A", 0, 0, 8)], finishes=["A"])   # one chunk, one token
    e = run.replay.engines[PID]
    assert "A" not in e.chains and "A" not in e.lookups and "A" not in e.running
    assert run.replay.chunk_causes(PID, "A", 0, 0, 8)["miss_not_looked_up"] == 8   # still readable this pass
    run.prompt("B", chain("b", 2))
    run.do(admits=[("B", 0, 8, 0, 0)], chunks=[("B", 0, 0, 4)])
    assert list(run.replay.kept) == [(PID, "B")]
    assert run.replay.chunk_causes(PID, "A", 0, 0, 8)["miss_not_looked_up"] == 0
    run.do(chunks=[("B", 0, 4, 4)], finishes=["B"])
    run.do()
    assert not run.replay.kept and not e.chains and not e.running and not e.pending


def _cold_run_with_a_later_snapshot(later: str) -> Run:
    """A fresh server (the snapshot at the attach says it never served), prompts evicting each
    other, and in the middle another agent's arrival: its hook_start and a snapshot of the cache
    then, which says the server has served (and, for vLLM, lists what is cached).  ``later``:
    "none" (no such agent), "offline" (the whole run read at once, the later snapshot among the
    structure rows from the start) or "live" (it reaches the replay in the pass it was sent in)."""
    run = Run()   # its snapshot at the attach: served 0
    snap = lambda hashes: [{"pid": PID, "t_ns": 5_000_000, "first": 0, "served": 1, "hashes": hashes}]  # noqa: E731
    a, b, c = chain("a", 3), chain("b", 3), chain("c", 3)
    if later == "offline":
        run.replay.structure(cached=snap(a[:1] + b))
    run.prompt("A", a)
    run.do(admits=[("A", 0, 13, 0, 0)], chunks=[("A", 0, 0, 13)], finishes=["A"])
    run.prompt("B", b)
    run.do(admits=[("B", 0, 13, 0, 0)], chunks=[("B", 0, 0, 13)], evicts=[(a[2], "B"), (a[1], "B")], finishes=["B"])
    if later == "live":
        run.replay.structure(cached=snap(a[:1] + b))
    run.prompt("C", c)           # never stored anywhere: cold
    run.do(admits=[("C", 0, 13, 0, 0)], chunks=[("C", 0, 0, 13)], evicts=[(a[0], "C"), (b[2], "C")], finishes=["C"])
    run.prompt("A2", a)          # A's blocks, evicted since
    run.do(admits=[("A2", 0, 13, 0, 0)], chunks=[("A2", 0, 0, 13)])
    return run


def test_another_agents_snapshot_does_not_change_the_causes():
    """Cold against unseen is decided by the snapshot at the attach (the run's first): a later
    one, sent because another agent (say, one tracing other processes) arrived after the server
    had served, changes no cause, whether it is read with the whole run or live, pass by pass."""
    base = _cold_run_with_a_later_snapshot("none")
    assert base.causes("C") == {"miss_cold": 12, "miss_tail": 1}
    assert base.causes("A2") == {"miss_evicted": 12, "miss_tail": 1}
    for later in ("offline", "live"):
        run = _cold_run_with_a_later_snapshot(later)
        for req in ("A", "B", "C", "A2"):
            assert run.causes(req) == base.causes(req), (later, req)
        assert not [s for s in run.segments if s.cause == "miss_unseen"], later
        assert run.replay.engines[PID].fresh is True


def test_a_run_without_a_snapshot_takes_the_first_one_it_gets():
    """A snapshot that comes after the fallback (fresh from the first step) decided still
    decides, as before: the fallback is not a snapshot."""
    replay = CacheReplay()
    replay.set_fresh(PID, False)
    replay.structure(cached=[{"pid": PID, "t_ns": 9, "first": 0, "served": 0, "hashes": []}])
    replay.structure(cached=[{"pid": PID, "t_ns": 20, "first": 0, "served": 1, "hashes": []}])
    assert replay.engines[PID].fresh is True


def test_tier_partial_chunk_blocks_the_tier_never_stored():
    """A tier of 8-token chunks (2 blocks): A's 22 tokens fill 2 whole chunks (blocks 0-3) and a
    partial one (tokens 16-21: block 4), which the tier never stores.  B shares A's 5 blocks plus
    its own: evicted from the device, blocks 0-3 stay miss_evicted (the tier held them, so its
    miss is another story) and block 4 is miss_tier_partial.  C computes block 4 again inside a
    whole chunk of its own prompt: the tier now holds it, so the next eviction is plain again."""
    run = Run()
    run.replay.structure(tiers=[{"kind": "lmcache", "chunk_tokens": 8}])
    a = chain("a", 5)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 22, 0, 0)], chunks=[("A", 0, 0, 22)], finishes=["A"])
    run.do(evicts=[(h, "X") for h in a])
    b = a + chain("b", 2)
    run.prompt("B", b)
    run.do(admits=[("B", 0, 29, 0, 0)], chunks=[("B", 0, 0, 29)], finishes=["B"])
    assert run.causes("B") == {"miss_evicted": 16, "miss_tier_partial": 4, "miss_cold": 8, "miss_tail": 1}
    part = [s for s in run.segments if s.request == "B" and s.cause == "miss_tier_partial"]
    assert [(s.start, s.end, s.block_hash) for s in part] == [(16, 20, a[4])]
    run.do(evicts=[(h, "X") for h in b])
    run.prompt("C", b)
    run.do(admits=[("C", 0, 29, 0, 0)], chunks=[("C", 0, 0, 29)])
    # B computed blocks 5-6 (tokens 20-28) with block 4 inside its whole chunk [16, 24): held now;
    # block 6 (24-28) sat in B's partial chunk [24, 29)
    assert run.causes("C") == {"miss_evicted": 24, "miss_tier_partial": 4, "miss_tail": 1}


def test_without_a_tier_or_with_two_chunk_sizes_no_tier_cause():
    for tiers in ([], [{"chunk_tokens": 8}, {"chunk_tokens": 16}]):
        run = Run()
        run.replay.structure(tiers=tiers)
        a = chain("a", 5)
        run.prompt("A", a)
        run.do(admits=[("A", 0, 22, 0, 0)], chunks=[("A", 0, 0, 22)], finishes=["A"])
        run.do(evicts=[(h, "X") for h in a])
        run.prompt("B", a)
        run.do(admits=[("B", 0, 22, 0, 0)], chunks=[("B", 0, 0, 22)])
        assert run.causes("B") == {"miss_evicted": 20, "miss_tail": 2}


def test_cached_on_another_engine_of_the_server():
    """Two engines (data-parallel ranks) of one run: a prompt computed on engine 7 and then sent
    to engine 8 misses there on blocks engine 7 holds: miss_other_engine, naming engine 7, in
    time order across the engines (engine 8's step comes after engine 7's in time, though its
    pid sorts later); once engine 7 evicted them, they are cold again."""
    replay = CacheReplay()
    a = chain("a", 3)
    for pid in (7, 8):
        replay.structure(cached=[{"pid": pid, "first": 0, "served": 0, "hashes": []}])
    replay.structure(prompt_blocks=[{"pid": 7, "request": "A", "block_size": B, "first": 0, "hashes": a},
                                    {"pid": 8, "request": "A2", "block_size": B, "first": 0, "hashes": a},
                                    {"pid": 8, "request": "A3", "block_size": B, "first": 0, "hashes": a}])

    def step(pid, s, t, admits=(), chunks=(), evicts=()):
        return replay.feed([{"pid": pid, "step": s, "t_start_ns": t}],
                           [{"pid": pid, "step": s, "request": r, "attempt": 0, "prefill_len": n, "cached_local": 0,
                             "cached_external": 0} for r, n in admits],
                           [{"pid": pid, "step": s, "request": r, "attempt": 0, "start": 0, "length": n} for r, n in chunks],
                           [{"pid": pid, "step": s, "t_ns": t + 1, "block_hash": h, "request": "X"} for h in evicts], [], [])

    # one feed, engine 8's step numbered 1 and engine 7's 5: time, not pid or step, orders them
    segs = replay.feed([{"pid": 7, "step": 5, "t_start_ns": 100}, {"pid": 8, "step": 1, "t_start_ns": 200}],
                       [{"pid": 7, "step": 5, "request": "A", "attempt": 0, "prefill_len": 13, "cached_local": 0,
                         "cached_external": 0},
                        {"pid": 8, "step": 1, "request": "A2", "attempt": 0, "prefill_len": 13, "cached_local": 0,
                         "cached_external": 0}],
                       [{"pid": 7, "step": 5, "request": "A", "attempt": 0, "start": 0, "length": 13},
                        {"pid": 8, "step": 1, "request": "A2", "attempt": 0, "start": 0, "length": 13}], [], [], [])
    got = causes_of([s for s in segs if s.request == "A2"])[0]
    assert {k: v for k, v in got.items() if v} == {"miss_other_engine": 12, "miss_tail": 1}
    assert {s.other_engine for s in segs if s.cause == "miss_other_engine"} == {7}
    assert {k: v for k, v in causes_of([s for s in segs if s.request == "A"])[0].items() if v} == \
        {"miss_cold": 12, "miss_tail": 1}
    # engine 7 evicts them and engine 8's own copies too: A3 finds them nowhere
    step(7, 6, 300, evicts=a)
    step(8, 2, 400, evicts=a)
    segs = step(8, 3, 500, admits=[("A3", 13)], chunks=[("A3", 13)])
    assert {k: v for k, v in causes_of(segs)[0].items() if v} == {"miss_evicted": 12, "miss_tail": 1}


def test_the_block_an_eagle_drafter_gives_back():
    """An engine whose drafter is EAGLE-style (kv_group `eagle`): vLLM drops the last matched
    block from the hit; that block is miss_spec_dropped, the ones after it their own causes."""
    run = Run()
    run.replay.structure(kv_group=[{"pid": PID, "group": 0, "kind": "full_attention", "block_size": B, "window": 0,
                                    "align": B, "hash_block": B, "retention": -1, "eagle": 1}])
    a = chain("a", 4)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 18, 0, 0)], chunks=[("A", 0, 0, 18)], finishes=["A"])
    run.prompt("A2", a)
    run.do(admits=[("A2", 0, 18, 12, 0)], chunks=[("A2", 0, 12, 6)])
    assert run.causes("A2") == {"hit_local": 12, "miss_spec_dropped": 4, "miss_tail": 2}
    run.prompt("B", a[:2] + chain("b", 2))
    run.do(admits=[("B", 0, 18, 4, 0)], chunks=[("B", 0, 4, 14)])
    assert run.causes("B") == {"hit_local": 4, "miss_spec_dropped": 4, "miss_cold": 8, "miss_tail": 2}
