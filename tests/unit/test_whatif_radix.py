"""The radix-cache replay of `kvtrace whatif` (SGLang datasets) on hand-made workloads whose hits
and evictions follow from SGLang's rules: longest cached prefix (at most length - 1), locked
paths, least recently used leaves evicted first, a parent evictable once its children are gone."""
from __future__ import annotations

import pytest

from kvtrace.analysis.whatif_radix import RadixReplay
from kvtrace.analysis.whatif_workload import Req, Workload
from kvtrace.errors import UsageError

SEC = 1_000_000_000


def workload(*chains, output=1) -> Workload:
    reqs = [Req(f"r{i}", i * SEC, len(c), output, list(c)) for i, c in enumerate(chains)]
    return Workload(reqs, 1, {}, (1e6, 0.0, 0.0), [], engine="sglang")


def test_lru_leaves_go_first_and_a_prefix_outlives_its_branches():
    x, y, z = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [20, 21, 22]
    s = RadixReplay(workload(x, y, z, x), chunk=256, block=1, cache_blocks=10).run()
    # one output token each: the token the last chunk samples, whose KV is never computed, so a
    # request leaves its prompt's pages.  x: 6 pages; y hits x's 1..3 and adds 7, 8 (8 pages);
    # z needs 3 with 2 free: the least recently used leaf goes, x's 6 (y touched only 1..3);
    # x again hits 1..5 and its 1 page evicts y's 8 (z's 22 is newer; x's 5 is locked by x)
    assert (s["requests"], s["prompt_tokens"], s["hit_local"], s["evictions"]) == (4, 20, 8, 2)
    assert s["preemptions"] == 0


def test_match_stops_one_short_of_the_prompt():
    s = RadixReplay(workload([5, 6, 7, 8], [5, 6, 7, 8]), chunk=256, block=1, cache_blocks=100).run()
    assert s["hit_local"] == 3   # SGLang computes the last token


def test_chunks_and_a_locked_path_are_not_evicted():
    # a 12-token prompt in chunks of 4 on a 13-slot cache, then a 12-token stranger: it fits only
    # by evicting the first request's pages, which it may once that request finished
    s = RadixReplay(workload(list(range(12)), list(range(100, 112))), chunk=4, block=1, cache_blocks=13).run()
    assert s["steps"] == 3 + 3 and s["hit_local"] == 0 and s["evictions"] == 11


def test_refusals():
    with pytest.raises(UsageError, match="device radix cache only"):
        RadixReplay(workload([1, 2]), 256, 1, 10, tier="file")
    with pytest.raises(UsageError, match="at least 1"):
        RadixReplay(workload([1, 2]), 256, 1, 0)
