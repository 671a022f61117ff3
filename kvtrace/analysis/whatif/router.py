"""`kvtrace whatif --router`: the recorded fleet's requests (several engines: replicas behind a
router) sent again through a model of a routing policy, each replica's cache and scheduler
replayed as `whatif` replays one server (driver.Replay, at the recorded settings).

The policies, as vllm-router 0.1.17 (and sglang-router) decide, in arrival order:
  round_robin       the next replica in turn
  least_loaded      the replica with the fewest requests in flight (the first of equals)
  cache_aware[:T]   the router's approximate prefix tree, one per replica, of the prompts it sent
                    there: when the load is balanced, the replica whose tree holds the longest
                    prefix of the prompt if that prefix is more than T of it (default 0.3),
                    else the least loaded; when it is not (max - min in flight > 64 and max >
                    1.5 x min), the least loaded.  The tree never evicts here (the router's
                    holds 32 Mi characters per replica).
Requests in flight: each request counts from its arrival to its recorded finish (the replay's
timing does not feed back into the routing).  The prefix is matched in recorded blocks (the
router matches characters of the prompt's text: the same share within a block).
"""
from __future__ import annotations

import heapq

from kvtrace.analysis.whatif.driver import Replay
from kvtrace.analysis.whatif.read import workload
from kvtrace.analysis.whatif.workload import Req, Workload
from kvtrace.errors import DatasetError, UsageError

POLICIES = ("round_robin", "least_loaded", "cache_aware")
BALANCE_ABS, BALANCE_REL, THRESHOLD = 64, 1.5, 0.3


def parse(spec: str) -> tuple[str, float]:
    """'cache_aware:0.5' -> ('cache_aware', 0.5); a policy kvtrace does not model: UsageError."""
    name, _, t = spec.partition(":")
    if name not in POLICIES:
        raise UsageError(f"--router {spec}: the policies modelled are {', '.join(POLICIES)} (cache_aware:T sets its threshold)")
    try:
        threshold = float(t) if t else THRESHOLD
    except ValueError:
        raise UsageError(f"--router {spec}: the threshold is a number between 0 and 1 (cache_aware:0.3)") from None
    if t and (name != "cache_aware" or not 0 <= threshold <= 1):
        raise UsageError(f"--router {spec}: only cache_aware takes a threshold, between 0 and 1")
    return name, threshold


def route(policy: str, reqs: list, replicas: int, block: int, threshold: float = THRESHOLD) -> list[int]:
    """The replica each request (in arrival order) goes to.  A prompt's block hashes are chained
    (each names its whole prefix), so a replica's tree is the set of hashes sent there."""
    out, trees, ends = [], [set() for _ in range(replicas)], []
    load = [0] * replicas
    for i, r in enumerate(reqs):
        while ends and ends[0][0] <= r.arrival:   # finished by now: no longer in flight
            load[heapq.heappop(ends)[1]] -= 1
        least = min(range(replicas), key=lambda k: load[k])
        if policy == "round_robin":
            k = i % replicas
        elif policy == "least_loaded" or (max(load) - min(load) > BALANCE_ABS and max(load) > BALANCE_REL * min(load)):
            k = least
        else:
            match = [_prefix(trees[k], r.chain) for k in range(replicas)]
            best = max(range(replicas), key=lambda k: match[k])
            k = best if r.prompt_len and match[best] * block / r.prompt_len > threshold else least
        if policy == "cache_aware":
            trees[k].update(r.chain)
        out.append(k)
        load[k] += 1
        heapq.heappush(ends, (r.finished_at or r.arrival, k))
    return out


def _prefix(tree: set, chain: list) -> int:
    n = 0
    while n < len(chain) and chain[n] in tree:
        n += 1
    return n


def run(directory, policies: list[str], max_num_seqs: int = 256) -> dict:
    """Each policy's predicted hit rate and balance, the recorded fleet's beside them."""
    wl = workload(directory)
    engines = sorted({r.engine for r in wl.reqs})
    if len(engines) < 2:
        raise DatasetError(f"{directory} records one engine: --router replays a fleet (attach --port A --port B)")
    rec = wl.recorded
    if not rec.get("chunk_size") or not rec.get("cache_blocks"):
        raise DatasetError(f"{directory}: the recorded chunk budget or KV cache size is not known")
    reqs = sorted(wl.reqs, key=lambda r: (r.arrival, r.rid))
    recorded = [engines.index(r.engine) for r in reqs]
    rows = [{"policy": "recorded", **_replay(wl, reqs, recorded, len(engines), max_num_seqs)}]
    for spec in policies:
        name, t = parse(spec)
        rows.append({"policy": spec, **_replay(wl, reqs, route(name, reqs, len(engines), wl.block_size, t),
                                               len(engines), max_num_seqs)})
    return {"dataset": str(directory), "replicas": len(engines), "requests": len(reqs), "predictions": rows}


def _replay(wl: Workload, reqs: list, to: list[int], replicas: int, max_num_seqs: int) -> dict:
    """Each replica's share replayed on its own cache; the fleet's sums."""
    rec, per = wl.recorded, []
    for k in range(replicas):
        # fresh requests, each arriving when it did (a closed loop's trigger may be on another replica)
        mine = [Req(r.rid, r.arrival, r.prompt_len, r.output, r.chain, rank=r.rank, engine=r.engine,
                    finished_at=r.finished_at) for r, t in zip(reqs, to) if t == k]
        for i, r in enumerate(sorted(mine, key=lambda r: r.rank)):
            r.rank = i
        sub = Workload(mine, wl.block_size, rec, wl.model, [], wl.storage, None, {}, kind=wl.kind, tier=wl.tier,
                       groups=wl.groups)
        s = Replay(sub, rec["chunk_size"], wl.block_size, rec["cache_blocks"], rec.get("storage_tier") or "none",
                   max_num_seqs).run() if mine else {"prompt_tokens": 0, "hit_local": 0, "hit_external": 0, "evictions": 0}
        per.append({"requests": len(mine), "prompt_tokens": s["prompt_tokens"],
                    "hit_tokens": s["hit_local"] + s["hit_external"], "evictions": s["evictions"]})
    pt, hit = sum(p["prompt_tokens"] for p in per), sum(p["hit_tokens"] for p in per)
    counts = [p["requests"] for p in per]
    return {"hit_rate": hit / pt if pt else None, "hit_tokens": hit, "prompt_tokens": pt,
            "evictions": sum(p["evictions"] for p in per), "requests_per_replica": counts,
            "imbalance": max(counts) * len(counts) / sum(counts) if sum(counts) else None, "replicas": per}
