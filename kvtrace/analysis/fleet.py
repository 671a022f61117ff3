"""The fleet section of `kvtrace analyze`: several engines in one dataset (replicas behind a
router, data-parallel ranks), per server and for the fleet, and the hit rate routing lost.

From the miss causes (kvtrace.correlate.causes), each first admission's prompt tokens are:
  hit          what its engine found
  workload     cold: no engine had computed them yet (miss_cold, miss_unseen, miss_tail)
  routing      cached in another engine at that moment, not in this one (miss_other_engine)
  eviction     computed here before, then evicted, and held by no other engine (miss_evicted)
  other        in flight, another key, a hybrid group's rule, a tier's partial chunk ...
and they sum to the prompt tokens.  Against one ideal cache that all requests share and that
never evicts, the shortfall is routing + eviction + other; workload is what even it misses.
``routed_hit_rate``: had each request gone to the engine holding its longest cached prefix
(the requests' ``cached_elsewhere``), the hit rate then, each cache as it stood (the routing
itself would have changed what later requests found).

FIGURES are SQL that kvtrace.analysis.queries runs with its own (same portability rules).
"""
from __future__ import annotations

PARTS = ("workload", "routing", "eviction", "other")

FIGURES: dict[str, str] = {
    # one row per engine of each run: its server (the servers table; 0 when it names none)
    "fleet_engines": """WITH srv AS (SELECT run, pid, MAX(server) AS server FROM servers GROUP BY run, pid),
        ew AS (SELECT run, pid, request, MAX(COALESCE(elsewhere, 0)) AS elsewhere,
            SUM(CASE WHEN cause IN ('miss_cold', 'miss_unseen', 'miss_tail') THEN tokens ELSE 0 END) AS workload,
            SUM(CASE WHEN cause = 'miss_other_engine' THEN tokens ELSE 0 END) AS routing,
            SUM(CASE WHEN cause = 'miss_evicted' THEN tokens ELSE 0 END) AS eviction
            FROM token_causes WHERE attempt = 0 GROUP BY run, pid, request)
        SELECT a.run, a.pid AS engine_pid, COALESCE(MAX(s.server), 0) AS server, COUNT(*) AS requests,
            SUM(a.prompt_len) AS prompt_tokens, SUM(a.cached_local + a.cached_external) AS hit_tokens,
            SUM(GREATEST(a.cached_local + a.cached_external, COALESCE(w.elsewhere, 0))) AS routed_tokens,
            SUM(COALESCE(w.workload, 0)) AS workload, SUM(COALESCE(w.routing, 0)) AS routing,
            SUM(COALESCE(w.eviction, 0)) AS eviction, SUM(CASE WHEN w.request IS NULL THEN 1 ELSE 0 END) AS uncaused
        FROM adm a LEFT JOIN srv s ON s.run = a.run AND s.pid = a.pid
            LEFT JOIN ew w ON w.run = a.run AND w.pid = a.pid AND w.request = a.request
        WHERE a.attempt = 0 GROUP BY a.run, a.pid ORDER BY a.run, a.pid""",
}


def section(rows: dict[str, list[dict]]) -> dict | None:
    """Per server and for the fleet: requests, hit rate, routed hit rate and the shortfall's
    parts (tokens and shares of the prompt tokens); None with one engine."""
    engines = rows["fleet_engines"]
    if len(engines) < 2:
        return None
    by: dict = {}
    for e in engines:   # a server is its port in its run: hosts' agents (one run each) may share ports
        key = (e["run"], e["server"] or e["engine_pid"])
        acc = by.setdefault(key, {"server": e["server"], "run": e["run"], "engine_pids": []})
        acc["engine_pids"].append(e["engine_pid"])
        for k in ("requests", "prompt_tokens", "hit_tokens", "routed_tokens", *PARTS[:3], "uncaused"):
            acc[k] = acc.get(k, 0) + int(e[k] or 0)
    servers = [_rates(v) for _, v in sorted(by.items())]
    fleet = _rates({"server": None, "run": None, "engine_pids": [p for s in servers for p in s["engine_pids"]],
                    **{k: sum(s[k] for s in servers) for k in ("requests", "prompt_tokens", "hit_tokens",
                                                               "routed_tokens", *PARTS[:3], "uncaused")}})
    return {"servers": servers, "fleet": fleet, "by": "server" if any(s["server"] for s in servers) else "engine",
            "runs": len({s["run"] for s in servers})}


def _rates(s: dict) -> dict:
    pt = s["prompt_tokens"]
    s["other"] = max(pt - s["hit_tokens"] - s["workload"] - s["routing"] - s["eviction"], 0)
    s["hit_rate"] = s["hit_tokens"] / pt if pt else None
    s["routed_hit_rate"] = s["routed_tokens"] / pt if pt else None
    s["ideal_hit_rate"] = (pt - s["workload"]) / pt if pt else None
    s["shortfall"] = {p: (s[p] / pt if pt else None) for p in PARTS}
    return s


def render(t, rep: dict, num, pct, Col) -> None:
    """The fleet tables on the terminal (kvtrace.analysis.render's Term)."""
    f = rep.get("fleet")
    if not f:
        return
    who = ("server (port)" if f["by"] == "server" else "engine pid") if f.get("runs", 1) < 2 else \
        ("run:port" if f["by"] == "server" else "run:engine pid")
    runs = f.get("runs", 1) > 1
    rows = [[(f"{s['run']}:" if runs else "") + str(s["server"] or s["engine_pids"][0]), num(s["requests"]), num(s["prompt_tokens"]), pct(s["hit_rate"]),
             pct(s["routed_hit_rate"]), pct(s["ideal_hit_rate"]), *(pct(s["shortfall"][p]) for p in PARTS)]
            for s in f["servers"]]
    x = f["fleet"]
    rows.append(["fleet", num(x["requests"]), num(x["prompt_tokens"]), pct(x["hit_rate"]), pct(x["routed_hit_rate"]),
                 pct(x["ideal_hit_rate"]), *(pct(x["shortfall"][p]) for p in PARTS)])
    t.table("Fleet: hit rate per server, had each request gone to its longest prefix, against one ideal cache; "
            "the prompt tokens missed by why (first admissions)",
            [Col(who, 1), Col("requests", 2), Col("prompt tokens", 2), Col("hit rate"), Col("routed", 1),
             Col("ideal cache", 1), Col("workload", 1), Col("routing", 1), Col("eviction", 1), Col("other", 2)], rows)
