"""The KV tier section of the report: which tier served each prompt token, and what each hop cost.

A KV tier's own server as its hook saw it (LMCache's multiprocess server: the tier_lookup and
tier_op records, docs/schema.md) beside vLLM's view of the loads (kv_alloc, kv_done through the
connector section's kvloads view) and its prefix cache (admit): per request with a prompt, its
tokens served by the device (vLLM's own prefix cache), the tier's memory (L1) and disk (L2), or
recomputed; the L2 reads (disk -> CPU) and retrieves (L1 -> the engine) against recomputing;
LMCache's chunk against vLLM's block and chunk budget; the tier's own operations.  VIEWS and
FIGURES are SQL that kvtrace.analysis.queries runs with its own (same portability rules);
section() and lines() make the report's part from their rows (docs/analysis.md, "KV tier").
"""
from __future__ import annotations

from kvtrace.analysis.connector import _ms, _n, _size

DEFAULT_CHUNK_TOKENS = 256   # LMCache's --chunk-size when the tiers table does not say
OPS = ("l2_read", "l2_write", "retrieve", "store", "evict")

# Each record once.  tierct: per run with tier records, the tier's tokens per chunk (its tiers
# rows; else LMCache's default) and how many rows stated it.
VIEWS: list[tuple[str, str]] = [
    ("tierlk", """SELECT run, pid, t_ns, request, n_chunks, l1_hits, l2_hits, l2_idx, tier
              FROM (SELECT l.*, ROW_NUMBER() OVER (PARTITION BY run, pid, request, t_ns
              ORDER BY n_chunks, l1_hits, l2_hits) AS rn FROM tier_lookup l) t WHERE rn = 1"""),
    ("tierop", "SELECT DISTINCT run, pid, t_start_ns, t_end_ns, request, op, n_keys, num_tokens AS tokens, nbytes, ok, tier FROM tier_op"),
    ("tierct", f"""SELECT r.run, COALESCE(MAX(t.chunk_tokens), {DEFAULT_CHUNK_TOKENS}) AS ct, COUNT(t.chunk_tokens) AS stated
              FROM (SELECT run FROM tierlk UNION SELECT run FROM tierop) r
              LEFT JOIN (SELECT run, chunk_tokens FROM tiers WHERE chunk_tokens > 0) t ON t.run = r.run
              GROUP BY r.run"""),
]

_OPS = ", ".join(f"SUM(CASE WHEN op = '{o}' THEN {x} ELSE 0 END) AS {o}_{n}" for o in ("l2_read", "retrieve")
                 for n, x in (("n", "1"), ("ns", "t_end_ns - t_start_ns"), ("bytes", "nbytes")))

FIGURES: dict[str, str] = {
    # first admissions in runs with tier records: the request's first load (kv_alloc; at or before
    # the admission's step: not a re-admission's), the last lookup at or before it (without a
    # load: its last lookup), its L2 reads and retrieves
    "tier_requests": f"""WITH ld AS (SELECT run, pid, request, step, t_ns, tok_first, ext_tokens, is_async, wait_ns FROM (
            SELECT k.*, ROW_NUMBER() OVER (PARTITION BY run, pid, request ORDER BY t_ns, step) AS rn FROM kvloads k) t
            WHERE rn = 1),
          r AS (SELECT a.run, a.pid, a.step, a.request, a.prompt_len, a.cached_local, z.ct, d.t_ns AS alloc_ns,
                  d.tok_first, d.ext_tokens, d.is_async, d.wait_ns
                FROM adm a JOIN tierct z ON z.run = a.run
                LEFT JOIN ld d ON d.run = a.run AND d.pid = a.pid AND d.request = a.request AND d.step <= a.step
                WHERE a.attempt = 0),
          lk AS (SELECT run, pid, request, n_chunks, l1_hits, l2_hits, l2_idx FROM (
            SELECT r.run, r.pid, r.request, l.n_chunks, l.l1_hits, l.l2_hits, l.l2_idx, ROW_NUMBER() OVER (
              PARTITION BY r.run, r.pid, r.request ORDER BY l.t_ns DESC, l.n_chunks, l.l1_hits, l.l2_hits) AS rn
            FROM r JOIN tierlk l ON l.run = r.run AND l.request = r.request
              AND (r.alloc_ns IS NULL OR l.t_ns <= r.alloc_ns)) t WHERE rn = 1),
          o AS (SELECT run, request, {_OPS} FROM tierop WHERE request <> '' GROUP BY run, request)
        SELECT r.run, r.request, r.step, r.prompt_len, r.cached_local, r.ct, r.tok_first, r.ext_tokens, r.is_async,
          r.wait_ns, lk.n_chunks, lk.l1_hits, lk.l2_hits, lk.l2_idx, o.l2_read_n, o.l2_read_ns, o.l2_read_bytes,
          o.retrieve_n, o.retrieve_ns, o.retrieve_bytes
        FROM r LEFT JOIN lk ON lk.run = r.run AND lk.pid = r.pid AND lk.request = r.request
        LEFT JOIN o ON o.run = r.run AND o.request = r.request ORDER BY r.run, r.step, r.request""",
    "tier_ops": """SELECT op, COUNT(*) AS n, SUM(n_keys) AS n_keys, SUM(tokens) AS tokens, SUM(nbytes) AS nbytes,
        SUM(t_end_ns - t_start_ns) AS busy_ns, percentile_disc(0.5) WITHIN GROUP (ORDER BY t_end_ns - t_start_ns) AS ns_p50,
        MAX(t_end_ns - t_start_ns) AS ns_max, SUM(CASE WHEN ok = 0 THEN 1 ELSE 0 END) AS failed
        FROM tierop GROUP BY op ORDER BY op""",
    "tier_lookups": """SELECT COUNT(*) AS lookups, COUNT(DISTINCT run || ' ' || request) AS requests,
        SUM(n_chunks) AS n_chunks, SUM(l1_hits) AS l1_hits, SUM(l2_hits) AS l2_hits FROM tierlk""",
    "tier_runs": "SELECT run, ct, stated FROM tierct ORDER BY run",
    "tier_names": """SELECT tier FROM (SELECT tier FROM tierlk UNION SELECT tier FROM tierop) t ORDER BY tier""",
    "tier_servers": """SELECT kind, connector, version, storage, MAX(chunk_tokens) AS chunk_tokens FROM tiers
        GROUP BY kind, connector, version, storage ORDER BY kind, connector, version, storage""",
    # non-final prefill chunks (the budget ran out in their step: its tokens are the budget) and
    # those that ended inside a tier chunk
    "tier_chunking": """SELECT COUNT(*) AS chunks_not_last,
        COALESCE(SUM(CASE WHEN (c.tok_start + c.tok_len) % z.ct <> 0 THEN 1 ELSE 0 END), 0) AS mid_chunk_ends,
        MAX(s.total_tokens) AS budget
        FROM chk c JOIN tierct z ON z.run = c.run JOIN stp s ON s.run = c.run AND s.pid = c.pid AND s.step = c.step
        WHERE c.is_last = 0""",
}


def section(rows: dict[str, list[dict]], recompute: dict, block_size) -> dict | None:
    """The report's `tier` section: totals and one row per request with a prompt; None when the
    dataset has no tier_lookup or tier_op rows.  ``recompute``: the report's reload_vs_recompute
    recompute figure (compute ns per prefill token); ``block_size``: the report's."""
    lk = rows["tier_lookups"][0] if rows["tier_lookups"] else {}
    if not lk.get("lookups") and not rows["tier_ops"]:
        return None
    per = [_request(r) for r in rows["tier_requests"]]
    ops = {r["op"]: r for r in rows["tier_ops"]}
    return {"tiers": [r["tier"] for r in rows["tier_names"]], "servers": rows["tier_servers"],
            **_chunk_tokens(rows["tier_runs"]), "requests": len(per), **_served(per),
            "reload_vs_recompute": _reload(per, recompute),
            "alignment": _alignment(per, rows["tier_chunking"][0] if rows["tier_chunking"] else {}, block_size),
            "lookups": {"lookups": lk.get("lookups") or 0, "requests": lk.get("requests") or 0,
                        "chunks": lk.get("n_chunks") or 0, "l1": lk.get("l1_hits") or 0, "l2": lk.get("l2_hits") or 0},
            "ops": {o: _op(ops.get(o, {})) for o in OPS}, "l2_reads_unused": _unused(per), "per_request": per}


def _chunk_tokens(runs: list[dict]) -> dict:
    sizes = sorted({r["ct"] for r in runs})
    return {"chunk_tokens": sizes[0] if len(sizes) == 1 else (sizes or None),
            "chunk_tokens_stated": bool(runs) and all(r["stated"] for r in runs)}


def _split(first: int, n: int, ct: int, l2: set[int]) -> tuple[int, int]:
    """Tokens [first, first + n) as (from L1, from L2): chunk c holds tokens [c·ct, (c+1)·ct)."""
    t1 = t2 = 0
    for c in range(first // ct, -(-(first + n) // ct)):
        k = min((c + 1) * ct, first + n) - max(c * ct, first)
        t1, t2 = (t1, t2 + k) if c in l2 else (t1 + k, t2)
    return t1, t2


def _request(r: dict) -> dict:
    ct, loaded, first = r["ct"], r["ext_tokens"] or 0, r["tok_first"] or 0
    looked = r["n_chunks"] is not None
    l2_chunks = sorted(int(c) for c in (r["l2_idx"] or []))
    l1, l2 = _split(first, loaded, ct, set(l2_chunks)) if looked else (0, 0)
    device = r["cached_local"] or 0
    return {"run": r["run"], "request": r["request"], "step": r["step"], "prompt_len": r["prompt_len"],
            "device": device, "tier_l1": l1, "tier_l2": l2, "tier_unknown": 0 if looked else loaded,
            "recomputed": max(r["prompt_len"] - device - loaded, 0), "first": r["tok_first"], "loaded": loaded,
            "lookup_chunks": r["n_chunks"], "lookup_l1": r["l1_hits"], "lookup_l2": r["l2_hits"],
            "l2_chunks": l2_chunks if looked else None,
            "l2_reads": r["l2_read_n"] or 0, "l2_read_ms": _ms(r["l2_read_ns"] or 0), "l2_read_bytes": r["l2_read_bytes"] or 0,
            "retrieves": r["retrieve_n"] or 0, "retrieve_ms": _ms(r["retrieve_ns"] or 0),
            "retrieve_bytes": r["retrieve_bytes"] or 0, "async": r["is_async"], "wait_ms": _ms(r["wait_ns"]),
            "partial_chunk_tokens": r["prompt_len"] % ct}


SERVED = ("device", "tier_l1", "tier_l2", "tier_unknown", "recomputed")


def _served(per: list[dict]) -> dict:
    pt = sum(r["prompt_len"] for r in per)
    tokens = {k: sum(r[k] for r in per) for k in SERVED}
    waits = [r["wait_ms"] for r in per if r["wait_ms"] is not None]
    return {"prompt_tokens": pt, "tokens": tokens, "shares": {k: _ratio(v, pt) for k, v in tokens.items()},
            "loads": sum(1 for r in per if r["loaded"]), "loaded_tokens": sum(r["loaded"] for r in per),
            "async_waits": len(waits), "wait_ms": _sum_ms(waits),
            "l2_read_ms": _sum_ms(r["l2_read_ms"] for r in per), "l2_read_bytes": sum(r["l2_read_bytes"] for r in per),
            "retrieve_ms": _sum_ms(r["retrieve_ms"] for r in per), "retrieve_bytes": sum(r["retrieve_bytes"] for r in per)}


def _ratio(a, b):
    return a / b if b else None


def _sum_ms(values) -> float:
    return round(sum(values), 6)


def _hop(per: list[dict], tokens_key: str, ms_key: str | None, bytes_key: str | None) -> dict:
    """A hop's time and bytes over the tokens it moved, for the requests with such tokens."""
    rs = [r for r in per if r[tokens_key] and (ms_key != "wait_ms" or r["wait_ms"] is not None)]
    tok, ms = sum(r[tokens_key] for r in rs), _sum_ms(r[ms_key] for r in rs)
    out = {"requests": len(rs), "tokens": tok, "ms": ms, "ms_per_token": _ratio(ms, tok)}
    if bytes_key:
        b = sum(r[bytes_key] for r in rs)
        out.update(bytes=b, bytes_per_token=_ratio(b, tok))
    return out


def _reload(per: list[dict], recompute: dict) -> dict:
    """Per token: disk -> CPU (L2 reads over L2 tokens), L1 -> the engine (retrieves over loaded
    tokens), vLLM's wait; a token from L2 costs both hops, from L1 the second; against recompute."""
    l2, ret = _hop(per, "tier_l2", "l2_read_ms", "l2_read_bytes"), _hop(per, "loaded", "retrieve_ms", "retrieve_bytes")
    rc = recompute.get("ns_per_token")
    rc_ms = rc / 1e6 if rc else None
    from_l1 = ret["ms_per_token"]
    from_l2 = (l2["ms_per_token"] + from_l1) if l2["ms_per_token"] is not None and from_l1 is not None else None
    return {"l2_read": l2, "retrieve": ret, "wait": _hop(per, "loaded", "wait_ms", None),
            "recompute": {"tokens": recompute.get("tokens") or 0, "ms": _ms(recompute.get("compute_ns") or 0),
                          "ms_per_token": rc_ms, "basis": recompute.get("basis")},
            "from_l2_ms_per_token": from_l2, "from_l1_ms_per_token": from_l1,
            "cheaper_from_l2": _cheaper(from_l2, rc_ms), "cheaper_from_l1": _cheaper(from_l1, rc_ms)}


def _cheaper(reload_ms, recompute_ms):
    if reload_ms is None or recompute_ms is None:
        return None
    return "reload" if reload_ms < recompute_ms else "recompute"


def _alignment(per: list[dict], ch: dict, block_size) -> dict:
    pt = sum(r["prompt_len"] for r in per)
    partial = sum(r["partial_chunk_tokens"] for r in per)
    return {"block_size": block_size, "chunk_budget": ch.get("budget"),
            "partial_chunk_tokens": partial, "partial_chunk_share": _ratio(partial, pt),
            "requests_with_partial_chunk": sum(1 for r in per if r["partial_chunk_tokens"]),
            "prefill_chunks_not_last": ch.get("chunks_not_last") or 0, "mid_chunk_ends": ch.get("mid_chunk_ends") or 0}


def _op(r: dict) -> dict:
    return {"count": r.get("n", 0), "keys": r.get("n_keys") or 0, "tokens": r.get("tokens") or 0,
            "bytes": r.get("nbytes") or 0, "ms": _ms(r.get("busy_ns") or 0), "p50_ms": _ms(r.get("ns_p50")),
            "max_ms": _ms(r.get("ns_max")), "failed": r.get("failed") or 0}


def _unused(per: list[dict]) -> dict:
    """L2 reads for requests that loaded nothing from L2 (e.g. a hit in vLLM's own cache after)."""
    rs = [r for r in per if r["l2_reads"] and not r["tier_l2"]]
    return {"requests": len(rs), "reads": sum(r["l2_reads"] for r in rs),
            "bytes": sum(r["l2_read_bytes"] for r in rs), "ms": _sum_ms(r["l2_read_ms"] for r in rs)}


def _pct(v, total) -> str:
    return f"{100 * v / total:.2f}%" if total else "-"


def lines(sec: dict | None) -> list[str]:
    """The section in four lines: tokens by tier, reload against recompute, chunk alignment, the
    tier's own operations (the per-request rows are in --json)."""
    if not sec:
        return []
    return [_served_line(sec), _reload_line(sec["reload_vs_recompute"]), _alignment_line(sec), _ops_line(sec)]


def _chunk_words(sec: dict) -> str:
    ct = sec["chunk_tokens"]
    said = "" if sec["chunk_tokens_stated"] else ", LMCache's default: the tiers table does not say"
    return f"{ct if not isinstance(ct, list) else '/'.join(map(str, ct))}-token chunks{said}"


def _served_line(sec: dict) -> str:
    t, pt = sec["tokens"], sec["prompt_tokens"]
    unknown = f", loaded without a lookup {t['tier_unknown']:,} ({_pct(t['tier_unknown'], pt)})" if t["tier_unknown"] else ""
    waited = (f" ({sec['async_waits']:,} async: vLLM waited {sec['wait_ms']:.3f} ms for them)"
              if sec["async_waits"] else "")
    return (f"KV tier {', '.join(sec['tiers']) or '?'} ({_chunk_words(sec)}): {_n(sec['requests'], 'request')}, "
            f"{pt:,} prompt tokens: device {t['device']:,} ({_pct(t['device'], pt)}), tier L1 {t['tier_l1']:,} "
            f"({_pct(t['tier_l1'], pt)}), tier L2 {t['tier_l2']:,} ({_pct(t['tier_l2'], pt)}), recomputed "
            f"{t['recomputed']:,} ({_pct(t['recomputed'], pt)}){unknown}; {_n(sec['loads'], 'load')} of "
            f"{sec['loaded_tokens']:,} tokens{waited}")


def _per_token(h: dict, what: str) -> str:
    if h["ms_per_token"] is None:
        return f"{what} no tokens"
    b = f", {h['bytes_per_token']:,.0f} B" if h.get("bytes_per_token") is not None else ""
    return f"{what} {h['ms_per_token']:.4f} ms{b} ({h['tokens']:,} tokens)"


def _verdict(where: str, ms, rc) -> str | None:
    if ms is None or not rc:
        return None
    if ms < rc:
        return f"from {where} {ms:.4f} ms, {rc / ms:.1f}× cheaper than recomputing"
    return f"from {where} {ms:.4f} ms, {ms / rc:.1f}× dearer than recomputing"


def _reload_line(rr: dict) -> str:
    rc = rr["recompute"]["ms_per_token"]
    parts = [_per_token(rr["l2_read"], "L2 disk->CPU"), _per_token(rr["retrieve"], "L1->engine"),
             _per_token(rr["wait"], "vLLM's async-load wait")]
    rcs = f"recompute {rc:.4f} ms ({rr['recompute']['basis']})" if rc else "recompute not timed (no prefill steps)"
    says = [v for v in (_verdict("L2", rr["from_l2_ms_per_token"], rc), _verdict("L1", rr["from_l1_ms_per_token"], rc)) if v]
    return f"KV tier reload vs recompute per token: {'; '.join(parts)}; {rcs}" + (f": {'; '.join(says)}" if says else "")


def _alignment_line(sec: dict) -> str:
    a, ct = sec["alignment"], sec["chunk_tokens"]
    bs = a["block_size"]
    blocks = (f" ({ct // bs} blocks)" if isinstance(ct, int) and isinstance(bs, int) and bs and ct % bs == 0 else "")
    block = f"vLLM's {bs}-token block{blocks}" if isinstance(bs, int) else "vLLM's block (size unknown)"
    budget = (f"{a['chunk_budget']:,}-token chunk budget" if a["chunk_budget"] else
              "chunk budget (no prefill was split)")
    return (f"KV tier chunk {ct} tokens against {block} and the {budget}: "
            f"{a['partial_chunk_tokens']:,} prompt tokens ({_pct(a['partial_chunk_tokens'], sec['prompt_tokens'])}) of "
            f"{_n(a['requests_with_partial_chunk'], 'request')} in a partial tier chunk, which the tier never stores; "
            f"{a['mid_chunk_ends']:,} of {a['prefill_chunks_not_last']:,} non-final prefill chunks ended inside a tier chunk")


def _ops_line(sec: dict) -> str:
    o, lk, un = sec["ops"], sec["lookups"], sec["l2_reads_unused"]
    r = o["l2_read"]
    lat = f", p50 {r['p50_ms']:.3f} ms, max {r['max_ms']:.3f} ms" if r["count"] else ""
    unused = (f"; {un['reads']:,} of them ({_size(un['bytes'])}) for {_n(un['requests'], 'request')} that loaded "
              "nothing from L2" if un["reads"] else "")
    failed = sum(x["failed"] for x in o.values())
    return (f"KV tier server: {_n(lk['lookups'], 'lookup')} of {lk['chunks']:,} chunks ({lk['l1']:,} in L1, "
            f"{lk['l2']:,} from L2); {_n(r['count'], 'L2 read')} ({_size(r['bytes'])}{lat}){unused}; "
            f"{_n(o['l2_write']['count'], 'L2 write')} ({_size(o['l2_write']['bytes'])}); "
            f"{_n(o['store']['count'], 'store')} ({o['store']['tokens']:,} tokens, {_size(o['store']['bytes'])}); "
            f"{_n(o['retrieve']['count'], 'retrieve')} ({o['retrieve']['tokens']:,} tokens, "
            f"{_size(o['retrieve']['bytes'])}); {_n(o['evict']['count'], 'eviction')} ({o['evict']['keys']:,} keys)"
            + (f"; {_n(failed, 'failed operation')}" if failed else ""))
