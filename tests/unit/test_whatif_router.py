"""The routing policies `kvtrace whatif --router` models, on requests made here (no dataset):
each decision as vllm-router 0.1.17 makes it (round robin in turn; least loaded the first of
equals; cache-aware to the longest prefix above its threshold, else the least loaded, and to the
least loaded whenever the load is out of balance)."""
from __future__ import annotations

import pytest

from kvtrace.analysis.whatif.router import parse, route
from kvtrace.analysis.whatif.workload import Req
from kvtrace.errors import UsageError

B = 32


def req(i: int, prefix: int, arrival: int, finish: int, blocks: int = 5, plen: int = 168) -> Req:
    chain = [prefix * 1000 + k for k in range(4)] + [10_000 + i * 10 + k for k in range(blocks - 4)]
    return Req(f"r{i}", arrival, plen, 2, chain, finished_at=finish)


def test_round_robin_and_least_loaded():
    seq = [req(i, i % 2, arrival=10 * i, finish=10 * i + 5) for i in range(6)]
    assert route("round_robin", seq, 3, B) == [0, 1, 2, 0, 1, 2]
    assert route("least_loaded", seq, 3, B) == [0] * 6   # one at a time: always the first of equals
    overlap = [req(i, 0, arrival=i, finish=100) for i in range(5)]
    assert route("least_loaded", overlap, 2, B) == [0, 1, 0, 1, 0]


def test_cache_aware_follows_the_longest_prefix_above_its_threshold():
    seq = [req(0, 7, 0, 5), req(1, 8, 10, 15), req(2, 8, 20, 25), req(3, 7, 30, 35)]
    # one at a time: a new prefix goes to the least loaded (the first), a known one to its holder
    assert route("cache_aware", seq, 2, B) == [0, 0, 0, 0]
    busy = [req(0, 7, 0, 100), req(1, 8, 1, 100), req(2, 8, 2, 100), req(3, 7, 3, 100)]
    # in flight: r1's prefix is new (to replica 1, the less loaded); r2 follows it; r3 follows r0
    assert route("cache_aware", busy, 2, B) == [0, 1, 1, 0]
    # 4 of 5.25 blocks shared = 0.76 of the prompt: above 0.3, below 0.9
    assert route("cache_aware", busy, 2, B, threshold=0.9) == [0, 1, 0, 1]


def test_cache_aware_balances_when_the_load_is_out_of_balance():
    hot = [req(i, 7, arrival=i, finish=10_000) for i in range(70)] + [req(70, 7, 70, 10_000)]
    to = route("cache_aware", hot, 2, B)
    # all on replica 0 while max - min <= 64; the 66th in flight tips it: least loaded
    assert to[:65] == [0] * 65 and to[65] == 1


@pytest.mark.parametrize("spec,want", [("round_robin", ("round_robin", 0.3)), ("cache_aware:0.5", ("cache_aware", 0.5))])
def test_parse(spec, want):
    assert parse(spec) == want


@pytest.mark.parametrize("spec", ["random", "cache_aware:x", "cache_aware:1.5", "round_robin:0.2"])
def test_parse_refuses_in_one_line(spec):
    with pytest.raises(UsageError) as e:
        parse(spec)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
