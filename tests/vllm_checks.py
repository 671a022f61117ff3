"""The checks every live-attach test makes of a dataset against vLLM's own answers.

- per request (first attempt): the hook's cached tokens equal the response's
  ``prompt_tokens_details.cached_tokens`` and its prompt length the response's;
- its chunks tile the prompt from the first uncached token to the end, in order;
- the evicted block hashes are, as a multiset, vLLM's ``BlockRemoved`` events of the same time.
"""
from __future__ import annotations

from collections import Counter


def events(evs) -> list[dict]:
    """A batch's events as maps with their "type", from either of vLLM's encodings (tagged maps;
    before about 0.21, arrays whose first item is the tag: kvtrace.servers.kvdecode.FIELDS)."""
    from kvtrace.servers.kvdecode import FIELDS

    out = []
    for ev in evs:
        if isinstance(ev, (list, tuple)):
            ev = {"type": ev[0], **dict(zip(FIELDS.get(ev[0], ()), ev[1:]))}
        out.append(ev)
    return out


def removed_hashes(batches) -> Counter:
    """BlockRemoved hashes (as unsigned 64-bit) of KV-event batches ``(recv_ns, seq, [ts, events, …])``."""
    removed = Counter()
    for _, _, (_ts, evs, *_rest) in batches:
        for ev in events(evs):
            if ev["type"] == "BlockRemoved":
                removed.update(h & (2**64 - 1) for h in ev["block_hashes"])
    return removed


def check_requests(ds, results) -> dict:
    """Admissions and chunks of every request in ``results`` against vLLM's responses."""
    admit = [a for a in ds.table("admit").to_pylist() if a["attempt"] == 0]
    chunks = ds.table("chunk").to_pylist()
    by_rid = {r.rid: r for r in results}
    seen = set()
    for a in admit:
        rid = next((k for k in by_rid if a["request"].startswith(f"cmpl-{k}-")), None)
        if rid is None:
            continue
        seen.add(rid)
        r = by_rid[rid]
        assert a["cached_local"] + a["cached_external"] == r.cached_tokens, (rid, a, r)
        assert a["prompt_len"] == r.prompt_tokens, (rid, a, r)
        mine = sorted((c for c in chunks if c["request"] == a["request"] and c["attempt"] == 0),
                      key=lambda c: c["chunk_index"])
        assert [c["chunk_index"] for c in mine] == list(range(len(mine))), rid
        assert mine[0]["start"] == a["start"] == r.cached_tokens, rid
        for x, y in zip(mine, mine[1:]):
            assert x["start"] + x["length"] == y["start"], rid
        assert mine[-1]["start"] + mine[-1]["length"] == r.prompt_tokens and mine[-1]["last"] == 1, rid
    assert seen == set(by_rid), f"no admission recorded for {sorted(set(by_rid) - seen)}"
    cached = sum(r.cached_tokens for r in results)
    assert cached, "the workload's shared prefixes never hit"
    return {"requests": len(seen), "cached_tokens": cached, "chunks": sum(1 for c in chunks if c["attempt"] == 0)}


def check_evictions(ds, removed: Counter) -> int:
    """The hook's evicted hashes equal vLLM's BlockRemoved; how many there were."""
    evicted = Counter(e["block_hash"] for e in ds.table("evict").to_pylist())
    assert sum(evicted.values()) > 0, "the workload evicted nothing"
    assert evicted == removed, (f"hook only: {sum((evicted - removed).values())}, "
                                f"BlockRemoved only: {sum((removed - evicted).values())}")
    return sum(evicted.values())
