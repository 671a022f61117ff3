"""A closed-loop workload under load for the live snapshot and whatif tests
(tests/vllm/test_snapshot_order.py, tests/sglang/test_snapshot_order.py), and the checks both
make of its dataset.

CLIENTS clients, each sending its next request a think time after the answer to its previous
one: 20 ms or 250 ms alternately (whatif's closed-loop inference marks the first kind, within
100 ms of a finish, and not the second: the mix that reordered the replay under load).  Each
prompt is one of GROUPS long shared prefixes plus new tokens; the clients rotate through the
groups, so a cache that holds fewer than all prefixes evicts and re-reads them."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

CLIENTS, PER = 4, 9


def think(c: int, k: int) -> float:
    return 0.02 if (c + k) % 2 == 0 else 0.25


def plan(seed: int, prefix: int, suffix: int, groups: int = 3) -> dict[tuple[int, int], tuple[str, list[int]]]:
    """(client, k) -> (request id, prompt)."""
    rnd = random.Random(seed)
    new = lambda n: [rnd.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    shared = [new(prefix) for _ in range(groups)]
    return {(c, k): (f"c{c}k{k}", shared[(c + k) % groups] + new(suffix)) for c in range(CLIENTS) for k in range(PER)}


def run(send, requests: dict, during=None) -> dict:
    """Every client's requests, closed loop; ``send(rid, prompt)`` returns (prompt tokens, cached
    tokens) as the engine answered.  ``during()`` runs in this thread while the clients send."""
    out, errors = {}, []

    def client(c: int) -> None:
        try:
            for k in range(PER):
                rid, prompt = requests[(c, k)]
                out[rid] = send(rid, prompt)
                time.sleep(think(c, k))
        except BaseException as e:  # noqa: BLE001 (raised again below)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    try:
        if during is not None:
            during()
    finally:
        for t in threads:
            t.join(600)
    assert not errors, errors
    return out


def hit_rate(out: dict) -> float:
    return sum(c for _, c in out.values()) / sum(p for p, _ in out.values())


def replay_at(ds, cache_blocks: int) -> tuple[float, list[str], list[str]]:
    """whatif's replay of the dataset at the recorded chunk budget and block size and this cache
    size: (hit rate, the requests in the order the replay first admitted them, in the order the
    recording did)."""
    from kvtrace.analysis.whatif import Replay, workload

    wl = workload(ds)
    order: list[str] = []

    class Logged(Replay):
        def _count_admission(self, r, *hit):   # every admission, either cache model
            if r.attempt == 0 and not r.admitted:
                order.append(r.rid)
            super()._count_admission(r, *hit)

    s = Logged(wl, wl.recorded["chunk_size"], wl.block_size, cache_blocks).run()
    return s["hit_rate"], order, recorded_order(ds)


def recorded_order(ds) -> list[str]:
    """The requests in the order the engine first admitted them (by step; within a step, in the
    order the hook sent the admissions: the engine's)."""
    from kvtrace.dataset.reader import Dataset

    rows = Dataset.open(ds).table("admit").to_pylist()
    first = {}
    for i, a in enumerate(rows):
        if a["attempt"] == 0 and a["request"] not in first:
            first[a["request"]] = (a["step"], i)
    return sorted(first, key=first.get)


def snapshots(ds) -> list[tuple[int, int]]:
    """The engine's cache snapshots in the dataset: (t_ns, served), in time order."""
    rows = ds.table("cached").to_pylist()
    return sorted({(r["t_ns"], r["served"]) for r in rows if r["first"] == 0})


def causes(ds) -> Counter:
    """Prompt tokens by cause, first admissions."""
    got = Counter()
    for s in ds.table("token_causes").to_pylist():
        if s["attempt"] == 0:
            got[s["cause"]] += s["tokens"]
    return got
