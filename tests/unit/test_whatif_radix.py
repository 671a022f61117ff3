"""The radix-cache replay of `kvtrace whatif` (SGLang datasets) on hand-made workloads whose hits
and evictions follow from SGLang's rules: longest cached prefix (at most length - 1), nodes as
SGLang inserts them (a chunk, an output) split where a match ends, locked paths, least recently
used leaf nodes evicted whole, a parent evictable once its children are gone, a batch's hits
locked before its allocation evicts."""
from __future__ import annotations

import pytest

from kvtrace.analysis.whatif import Replay, Req, Workload
from kvtrace.errors import UsageError

SEC = 1_000_000_000


def workload(*chains, output=1) -> Workload:
    reqs = [Req(f"r{i}", i * SEC, len(c), output, list(c)) for i, c in enumerate(chains)]
    return Workload(reqs, 1, {}, (1e6, 0.0, 0.0), [], kind="sglang")


def test_lru_leaves_go_first_and_a_prefix_outlives_its_branches():
    x, y, z = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [20, 21, 22]
    s = Replay(workload(x, y, z, x), chunk=256, block=1, cache_blocks=10).run()
    # one output token each: the token the last chunk samples, whose KV is never computed, so a
    # request leaves its prompt's pages.  x: one node of 6; y hits 1..3 (x's node split there)
    # and adds a node 7, 8 (8 pages); z needs 3 with 2 free: the least recently used leaf goes,
    # x's 4..6, whole; x again hits 1..3, and its 4..6 evict y's 7, 8 (z's node is newer)
    assert (s["requests"], s["prompt_tokens"], s["hit_local"], s["evictions"]) == (4, 20, 6, 5)
    assert s["preemptions"] == 0


def test_match_stops_one_short_of_the_prompt():
    s = Replay(workload([5, 6, 7, 8], [5, 6, 7, 8]), chunk=256, block=1, cache_blocks=100).run()
    assert s["hit_local"] == 3   # SGLang computes the last token


def test_chunks_are_nodes_evicted_whole_and_a_locked_path_is_not_evicted():
    # a 12-token prompt in chunks of 4 on a 15-slot cache (SGLang admits what fits strictly:
    # 12 + 1 output + a page < 15), then a 12-token stranger: it fits only by evicting the first
    # request's chunks, which it may once that request finished: three nodes of 4, whole
    s = Replay(workload(list(range(12)), list(range(100, 112))), chunk=4, block=1, cache_blocks=15).run()
    assert s["steps"] == 3 + 3 and s["hit_local"] == 0 and s["evictions"] == 12


def test_a_batch_locks_its_hits_before_its_allocation_evicts():
    """Two requests admitted in one prefill batch: the first's new tokens need room, and the
    least recently used node is the second one's hit.  SGLang matches (and locks) every admission
    of the batch before prepare_for_extend allocates for all of them, so what goes is the other
    unlocked node, and the second request hits its whole prefix."""
    p, q, a, b = list(range(1, 7)), list(range(50, 60)), list(range(100, 106)), list(range(1, 8))
    reqs = [Req("p", 0, 6, 1, p), Req("q", SEC, 10, 1, q), Req("a", 2 * SEC, 6, 1, a), Req("b", 2 * SEC, 7, 1, b)]
    s = Replay(Workload(reqs, 1, {}, (1e6, 0.0, 0.0), [], kind="sglang"), chunk=256, block=1, cache_blocks=21).run()
    # p (6) and q (10) cached, 5 slots free; a (6 tokens) and b (hits p's 6) in one batch need 7:
    # q's node goes, not p's
    assert (s["hit_local"], s["evictions"]) == (6, 10)


def test_refusals():
    with pytest.raises(UsageError, match="device radix cache only"):
        Replay(workload([1, 2]), 256, 1, 10, tier="file")
    with pytest.raises(UsageError, match="at least 1"):
        Replay(workload([1, 2]), 256, 1, 0)
