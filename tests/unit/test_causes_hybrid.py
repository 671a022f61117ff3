"""The miss-cause replay on a hybrid model's records: a full-attention group and a sliding-window
group (kv_group rows), each caching and evicting on its own, and vLLM's hybrid hit rule.
(Against a real vLLM with a sliding-window model: tests/vllm/test_hybrid.py.)"""
from __future__ import annotations

from kvtrace.correlate.causes import CacheReplay
from tests.unit.test_causes import B, PID, Run, chain

FULL, SWA = 0, 1


def groups(align: int = B, window: int = 2 * B) -> list[dict]:
    """Group 0 full attention, group 1 a sliding window of ``window`` tokens (2 blocks: a hit
    needs cdiv(window - 1, B) = 2 cached blocks before it in that group)."""
    return [{"pid": PID, "group": FULL, "kind": "full_attention", "block_size": B, "window": 0, "align": align,
             "hash_block": B},
            {"pid": PID, "group": SWA, "kind": "sliding_window", "block_size": B, "window": window, "align": align,
             "hash_block": B}]


class HybridRun(Run):
    def __init__(self, align: int = B):
        super().__init__()
        self.replay.structure(kv_group=groups(align))

    def evict(self, group: int, hashes, by: str = "X"):
        """Evictions of one group's copies (the hook's evict rows carry the group)."""
        self.step += 1
        s, t = self.step, self.step * 1_000_000
        self.segments += self.replay.feed(
            [{"pid": PID, "step": s, "t_start_ns": t}], [], [],
            [{"pid": PID, "step": s, "t_ns": t + 10, "block_hash": h, "group": group, "request": by} for h in hashes],
            [], [])


def test_the_sliding_window_group_cuts_the_hit_full_attention_would_give():
    run = HybridRun()
    a = chain("a", 6)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 25, 0, 0)], chunks=[("A", 0, 0, 25)], finishes=["A"])
    assert run.causes("A") == {"miss_cold": 24, "miss_tail": 1}
    # the window group frees (and so evicts first) the blocks below its window: here blocks 3-5
    run.evict(SWA, a[3:])
    run.prompt("B", a)
    # full attention holds all 6 blocks; the window group's last 2-block run ends at block 3:
    # vLLM hits 12 tokens, and blocks 3-5 are cut by group 1's rule
    run.do(admits=[("B", 0, 25, 12, 0)], chunks=[("B", 0, 12, 13)], finishes=["B"])
    assert run.causes("B") == {"hit_local": 12, "miss_group": 12, "miss_tail": 1}
    seg = [s for s in run.segments if s.request == "B" and s.cause == "miss_group"]
    assert [(s.start, s.end, s.group) for s in seg] == [(12, 24, SWA)]
    # B recomputed blocks 3-5 into both groups; now full attention loses blocks 4 and 5: those are
    # evicted for the reference group (its own cause), the window's run before block 4 still holds
    run.evict(FULL, a[4:])
    run.prompt("C", a)
    run.do(admits=[("C", 0, 25, 16, 0)], chunks=[("C", 0, 16, 9)])
    assert run.causes("C") == {"hit_local": 16, "miss_evicted": 8, "miss_tail": 1}


def test_another_groups_eviction_is_not_a_full_attention_eviction():
    run = HybridRun()
    a = chain("a", 3)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 13, 0, 0)], chunks=[("A", 0, 0, 13)], finishes=["A"])
    run.evict(SWA, a[:1])   # the window group's first block: no hit needs it (the run of blocks 1-2 serves)
    run.prompt("B", a)
    run.do(admits=[("B", 0, 13, 12, 0)], chunks=[("B", 0, 12, 1)])
    assert run.causes("B") == {"hit_local": 12, "miss_tail": 1}
    assert run.replay.engines[PID].evictions == 0   # distances count the reference group's evictions


def test_a_match_unit_larger_than_the_block():
    run = HybridRun(align=2 * B)
    a = chain("a", 6)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 25, 0, 0)], chunks=[("A", 0, 0, 25)], finishes=["A"])
    # 6 blocks could hit, 24 tokens: a multiple of the 8-token unit, so all cold
    assert run.causes("A") == {"miss_cold": 24, "miss_tail": 1}
    # a 5-block prefix of A: vLLM hits 16 (the unit), the fifth block is below the unit
    run.prompt("E", a[:5])
    run.do(admits=[("E", 0, 21, 16, 0)], chunks=[("E", 0, 16, 5)])
    assert run.causes("E") == {"hit_local": 16, "miss_match_unit": 4, "miss_tail": 1}
    # a prompt shorter than the unit: nothing can hit, never cold
    run.prompt("S", chain("s", 1))
    run.do(admits=[("S", 0, 5, 0, 0)], chunks=[("S", 0, 0, 5)])
    assert run.causes("S") == {"miss_match_unit": 4, "miss_tail": 1}


def test_the_snapshot_at_attach_is_per_group():
    a = chain("a", 4)
    rp = CacheReplay()
    rp.structure(kv_group=groups(),
                 cached=[{"pid": PID, "first": 0, "total": 8, "served": 1, "t_ns": 5, "hashes": a + a}],
                 cached_in=[{"pid": PID, "group": FULL, "first": 0, "total": 4, "t_ns": 5, "hashes": a},
                            {"pid": PID, "group": SWA, "first": 0, "total": 2, "t_ns": 5, "hashes": a[:2]}])
    run = Run.__new__(Run)
    run.replay, run.step, run.segments = rp, 0, []
    run.prompt("B", a)
    # full attention holds 4 blocks, the window group blocks 0-1 only: its run ends at block 2
    run.do(admits=[("B", 0, 17, 8, 0)], chunks=[("B", 0, 8, 9)])
    assert run.causes("B") == {"hit_local": 8, "miss_group": 8, "miss_tail": 1}


def test_sparse_retention_keeps_the_window_at_the_prompt_end_and_at_a_junction():
    """vLLM's default retention (0): the window group caches only the blocks a hit at a prompt's
    end needs, and, after an admission its rule cut, those at that shared prefix's end."""
    run = Run()
    run.replay.structure(kv_group=[{**g, "retention": 0} for g in groups()])
    a = chain("a", 6)
    run.prompt("A", a)
    run.do(admits=[("A", 0, 25, 0, 0)], chunks=[("A", 0, 0, 25)], finishes=["A"])   # window keeps blocks 4-5
    b = a[:4] + chain("b", 2)
    run.prompt("B", b)
    # full attention holds blocks 0-3; the window group none of them: nothing hits, 16 tokens cut
    run.do(admits=[("B", 0, 25, 0, 0)], chunks=[("B", 0, 0, 25)], finishes=["B"])
    assert run.causes("B") == {"miss_group": 16, "miss_cold": 8, "miss_tail": 1}
    # B pinned the junction at token 16: the window group now caches blocks 2-3
    run.prompt("D", a[:4] + chain("d", 2))
    run.do(admits=[("D", 0, 25, 16, 0)], chunks=[("D", 0, 16, 9)])
    assert run.causes("D") == {"hit_local": 16, "miss_cold": 8, "miss_tail": 1}
