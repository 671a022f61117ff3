"""The KV connector section of the report, and kvtrace's hit counts checked against the engine's.

Any vLLM KV connector as its scheduler sees it (the hook's kv_alloc, kv_done, kv_finish and
kv_invalid records, docs/schema.md): per connector, the admissions granted tokens to load from
it (external hits), the blocks and bytes they load into, the asynchronous loads' wait, failed
loads and invalid blocks, and at the requests' end the blocks handed to it and the asynchronous
stores that finished; per load one row.  VIEWS and FIGURES are SQL that kvtrace.analysis.queries
runs with its own (same portability rules); section() and hit_warnings() make the report's
parts from their rows.
"""
from __future__ import annotations

# Each record once (a record sent twice never counts twice).  kvloads: one row per load (an
# admission's kv_alloc) with its kv_done "load" and invalid blocks: those of its request after
# it and before the request's next load.
_WINDOW = "x.run = a.run AND x.pid = a.pid AND x.request = a.request AND x.t_ns >= a.t_ns AND " \
          "(a.next_ns IS NULL OR x.t_ns < a.next_ns)"
VIEWS: list[tuple[str, str]] = [
    ("kva", """SELECT run, pid, step, t_ns, request, tok_first, ext_tokens, blocks, nbytes, is_async, connector
              FROM (SELECT k.*, ROW_NUMBER() OVER (PARTITION BY run, pid, request, step ORDER BY t_ns) AS rn
              FROM kv_alloc k) t WHERE rn = 1"""),
    ("kvd", "SELECT DISTINCT run, pid, step, t_ns, request, direction, ok, connector FROM kv_done"),
    ("kvi", "SELECT DISTINCT run, pid, step, t_ns, request, blocks, connector FROM kv_invalid"),
    ("kvf", """SELECT run, pid, step, t_ns, request, blocks, nbytes, delay_free, connector
              FROM (SELECT f.*, ROW_NUMBER() OVER (PARTITION BY run, pid, request, step ORDER BY t_ns) AS rn
              FROM kv_finish f) t WHERE rn = 1"""),
    ("kvloads", f"""WITH a AS (SELECT k.*, LEAD(t_ns) OVER (PARTITION BY run, pid, request ORDER BY t_ns, step) AS next_ns
                    FROM kva k),
                  d AS (SELECT a.run, a.pid, a.request, a.step, MIN(x.t_ns) AS done_ns, MIN(x.ok) AS done_ok
                        FROM a JOIN kvd x ON {_WINDOW} AND x.direction = 'load' GROUP BY a.run, a.pid, a.request, a.step),
                  v AS (SELECT a.run, a.pid, a.request, a.step, SUM(x.blocks) AS blocks
                        FROM a JOIN kvi x ON {_WINDOW} GROUP BY a.run, a.pid, a.request, a.step)
                  SELECT a.run, a.pid, a.connector, a.request, a.step, a.t_ns, a.tok_first, a.ext_tokens, a.blocks,
                    a.nbytes, a.is_async, CASE WHEN a.is_async = 1 THEN d.done_ns - a.t_ns ELSE NULL END AS wait_ns,
                    COALESCE(v.blocks, 0) AS invalid_blocks,
                    CASE WHEN d.done_ok = 0 OR COALESCE(v.blocks, 0) > 0 THEN 0
                         WHEN a.is_async = 1 AND d.done_ns IS NULL THEN NULL ELSE 1 END AS ok
                  FROM a LEFT JOIN d ON d.run = a.run AND d.pid = a.pid AND d.request = a.request AND d.step = a.step
                  LEFT JOIN v ON v.run = a.run AND v.pid = a.pid AND v.request = a.request AND v.step = a.step"""),
]

# vLLM's counters of hit tokens, and what each counts in kvtrace's first admissions.
COUNTERS = {"vllm:external_prefix_cache_hits_total": "cached_external", "vllm:prefix_cache_hits_total": "cached_local"}
_IN = ", ".join(f"'{n}'" for n in COUNTERS)
_KV = " ".join(f"WHEN '{n}' THEN a.{c}" for n, c in COUNTERS.items())

FIGURES: dict[str, str] = {
    "kv_conn_loads": """SELECT run, connector, request, step, tok_first, ext_tokens, blocks, nbytes, is_async, wait_ns, ok,
        invalid_blocks FROM kvloads ORDER BY run, t_ns, request, step""",
    "kv_conn_totals": """SELECT connector, COUNT(DISTINCT run || ' ' || request) AS requests, COUNT(*) AS loads,
        SUM(ext_tokens) AS ext_tokens, SUM(blocks) AS blocks, SUM(nbytes) AS nbytes, SUM(is_async) AS async_loads,
        SUM(CASE WHEN ok = 0 THEN 1 ELSE 0 END) AS failed, SUM(CASE WHEN ok IS NULL THEN 1 ELSE 0 END) AS pending
        FROM kvloads GROUP BY connector ORDER BY connector""",
    "kv_conn_waits": """SELECT connector, COUNT(*) AS n, percentile_disc(0.5) WITHIN GROUP (ORDER BY wait_ns) AS wait_p50,
        MAX(wait_ns) AS wait_max FROM kvloads WHERE is_async = 1 AND wait_ns IS NOT NULL
        GROUP BY connector ORDER BY connector""",
    "kv_conn_ends": """SELECT connector, SUM(fin) AS finished, SUM(fblocks) AS blocks, SUM(fbytes) AS nbytes,
        SUM(delayed) AS async_stores, SUM(stores) AS stores_done, SUM(invalid) AS invalid_blocks FROM (
          SELECT connector, 1 AS fin, blocks AS fblocks, nbytes AS fbytes, delay_free AS delayed, 0 AS stores, 0 AS invalid
          FROM kvf
          UNION ALL SELECT connector, 0, 0, 0, 0, CASE WHEN direction = 'store' THEN 1 ELSE 0 END, 0 FROM kvd
          UNION ALL SELECT connector, 0, 0, 0, 0, 0, blocks FROM kvi) t GROUP BY connector ORDER BY connector""",
    # per counter: its rise from its first to its last scrape (per run, summed over labels) beside
    # the hits of kvtrace's first admissions whose step started in that window
    # per server (its port; 0: the run's one server), the counters' rise from its first to its last
    # scrape, against kvtrace's hits in that server's engines' admissions in that window: servers
    # are scraped at different instants, so a rise never mixes two servers' samples
    "hit_window": f"""WITH m AS (SELECT run, COALESCE(server, 0) AS server, name, ts_ns, SUM(value) AS v FROM server_metrics
          WHERE kind = 'vllm' AND name IN ({_IN}) GROUP BY run, COALESCE(server, 0), name, ts_ns),
        w AS (SELECT run, server, name, MIN(ts_ns) AS t0, MAX(ts_ns) AS t1 FROM m GROUP BY run, server, name
              HAVING COUNT(*) >= 2),
        c AS (SELECT w.run, w.server, w.name, w.t0, w.t1, l.v - f.v AS rise FROM w
              JOIN m f ON f.run = w.run AND f.server = w.server AND f.name = w.name AND f.ts_ns = w.t0
              JOIN m l ON l.run = w.run AND l.server = w.server AND l.name = w.name AND l.ts_ns = w.t1),
        sv AS (SELECT run, pid, MAX(server) AS server FROM servers GROUP BY run, pid),
        a AS (SELECT a.run, COALESCE(sv.server, 0) AS server, s.t_start_ns AS t, a.cached_local, a.cached_external
              FROM adm a JOIN stp s ON s.run = a.run AND s.pid = a.pid AND s.step = a.step
              LEFT JOIN sv ON sv.run = a.run AND sv.pid = a.pid WHERE a.attempt = 0),
        x AS (SELECT x.run, COALESCE(sv.server, 0) AS server, x.t_ns, x.ext_tokens FROM kva x
              LEFT JOIN sv ON sv.run = x.run AND sv.pid = x.pid),
        k AS (SELECT c.run, c.server, c.name, MAX(c.rise) AS rise, COALESCE(SUM(CASE c.name {_KV} END), 0) AS hits,
                     COUNT(a.t) AS admissions
              FROM c LEFT JOIN a ON a.run = c.run AND (c.server = 0 OR a.server = c.server) AND a.t >= c.t0 AND a.t <= c.t1
              GROUP BY c.run, c.server, c.name),
        g AS (SELECT c.run, c.server, c.name, COALESCE(SUM(x.ext_tokens), 0) AS granted, COUNT(x.t_ns) AS allocs
              FROM c LEFT JOIN x ON x.run = c.run AND (c.server = 0 OR x.server = c.server) AND x.t_ns >= c.t0
                   AND x.t_ns <= c.t1 GROUP BY c.run, c.server, c.name)
        SELECT k.name, SUM(k.rise) AS engine, SUM(k.hits) AS kvtrace, SUM(k.admissions) AS admissions,
               SUM(g.granted) AS granted, SUM(g.allocs) AS allocs
        FROM k JOIN g ON g.run = k.run AND g.server = k.server AND g.name = k.name GROUP BY k.name ORDER BY k.name""",
}


def section(rows: dict[str, list[dict]]) -> dict | None:
    """The report's `connector` section: per connector name its totals, and per load one row;
    None when the dataset has no connector records."""
    by = {f: {r["connector"]: r for r in rows[f]} for f in ("kv_conn_totals", "kv_conn_waits", "kv_conn_ends")}
    names = sorted(set(by["kv_conn_totals"]) | set(by["kv_conn_ends"]))
    if not names:
        return None
    return {"connectors": [_totals(n, *(by[f].get(n, {}) for f in by)) for n in names],
            "per_request": [_load(r) for r in rows["kv_conn_loads"]]}


def _ms(ns):
    """ns in ms, as the report gives numbers (kvtrace.analysis.report._norm: 6 decimals, integral as int)."""
    if ns is None:
        return None
    v = round(ns / 1e6, 6)
    return int(v) if v.is_integer() else v


def _totals(name: str, t: dict, w: dict, e: dict) -> dict:
    return {"name": name, "requests": t.get("requests", 0), "loads": t.get("loads", 0),
            "external_tokens": t.get("ext_tokens") or 0, "blocks": t.get("blocks") or 0, "bytes": t.get("nbytes") or 0,
            "async_loads": t.get("async_loads") or 0, "async_waits": w.get("n", 0),
            "wait_p50_ms": _ms(w.get("wait_p50")), "wait_max_ms": _ms(w.get("wait_max")),
            "failed_loads": t.get("failed") or 0, "unfinished_loads": t.get("pending") or 0,
            "invalid_blocks": e.get("invalid_blocks") or 0,
            "finished": {"requests": e.get("finished") or 0, "blocks": e.get("blocks") or 0,
                         "bytes": e.get("nbytes") or 0, "async_stores": e.get("async_stores") or 0,
                         "stores_done": e.get("stores_done") or 0}}


def _load(r: dict) -> dict:
    return {"run": r["run"], "connector": r["connector"], "request": r["request"], "step": r["step"],
            "first": r["tok_first"], "external": r["ext_tokens"], "blocks": r["blocks"], "bytes": r["nbytes"],
            "async": r["is_async"], "wait_ms": _ms(r["wait_ns"]), "ok": r["ok"], "invalid_blocks": r["invalid_blocks"]}


def _size(n: int) -> str:
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n:,} B"


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def lines(sec: dict | None) -> list[str]:
    """The section in one line per connector (totals only; the per-load rows are in --json)."""
    out = []
    for c in (sec or {}).get("connectors", []):
        f = c["finished"]
        wait = (f", waited p50 {c['wait_p50_ms']:.3f} ms, max {c['wait_max_ms']:.3f} ms over {c['async_waits']:,} done"
                if c["async_waits"] else "")
        out.append(f"KV connector {c['name']}: {_n(c['requests'], 'request')} loaded {c['external_tokens']:,} "
                   f"external tokens into {_n(c['blocks'], 'block')} ({_size(c['bytes'])}); "
                   f"{c['async_loads']:,} of {_n(c['loads'], 'load')} async{wait}; "
                   f"{_n(c['failed_loads'], 'failed load')}, {_n(c['invalid_blocks'], 'invalid block')}; at the end "
                   f"{_n(f['requests'], 'request')} handed it {_n(f['blocks'], 'block')} ({_size(f['bytes'])}), "
                   f"{f['async_stores']:,} stored async ({f['stores_done']:,} done)")
    return out


# Each counter checked: (what kvtrace counted, the counter's name in the warning, the rate of the report that
# kvtrace's count gives, its key in the report's `reuse`)
_CHECKED = {"vllm:external_prefix_cache_hits_total": ("external hit tokens", "vllm:external_prefix_cache_hits",
                                                      "storage hit rate", "external_rate"),
            "vllm:prefix_cache_hits_total": ("local prefix-cache hit tokens", "vllm:prefix_cache_hits",
                                             "local hit rate", "local_rate")}


def hit_warnings(rows: dict[str, list[dict]], reuse: dict) -> list[str]:
    """One line per vLLM hit counter whose rise between its first and last scrape differs from
    kvtrace's hits of the first admissions in that window."""
    out = []
    for r in rows["hit_window"]:
        kv, eng = r["kvtrace"] or 0, round(r["engine"] or 0)
        if kv == eng:
            continue
        what, counter, rate, key = _CHECKED[r["name"]]
        share = "-" if reuse[key] is None else f"{100 * reuse[key]:.2f}%"
        granted = (f"; the connector's kv_alloc records granted {r['granted']:,} external tokens in "
                   f"{_n(r['allocs'], 'load')} in that window" if key == "external_rate" and r["allocs"] else "")
        out.append(f"warning: kvtrace counted {kv:,} {what}, vLLM counted {eng:,} ({counter}) over the same window "
                   f"({_n(r['admissions'], 'first admission')} between its first and last /metrics scrape): the "
                   f"report's {rate} ({share}) is computed from kvtrace's count{granted}")
    return out
