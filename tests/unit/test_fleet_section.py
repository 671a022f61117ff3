"""analyze's fleet section (kvtrace.analysis.fleet.section) on figure rows: two hosts' agents
whose servers share a port stay two servers; the fleet sums them.  No root."""
from __future__ import annotations

from kvtrace.analysis import fleet


def row(run, pid, server, requests, prompt, hit, routed, workload, routing, eviction):
    return {"run": run, "engine_pid": pid, "server": server, "requests": requests, "prompt_tokens": prompt,
            "hit_tokens": hit, "routed_tokens": routed, "workload": workload, "routing": routing,
            "eviction": eviction, "uncaused": 0}


def test_two_hosts_on_one_port_are_two_servers():
    """Host a's run (one server on 8000, 10 requests of 100 tokens: 40 hit, 30 cold, 20 routing,
    10 evicted) and host b's (the same port, 5 requests of 100: 10 hit, 90 cold)."""
    sec = fleet.section({"fleet_engines": [row("ra", 11, 8000, 10, 1000, 400, 600, 300, 200, 100),
                                           row("rb", 11, 8000, 5, 500, 50, 50, 450, 0, 0)]})
    assert [(s["run"], s["server"], s["requests"]) for s in sec["servers"]] == [("ra", 8000, 10), ("rb", 8000, 5)]
    assert sec["runs"] == 2
    f = sec["fleet"]
    assert (f["requests"], f["prompt_tokens"], f["hit_tokens"]) == (15, 1500, 450)
    assert f["hit_rate"] == 0.3 and f["ideal_hit_rate"] == (1500 - 750) / 1500
    assert f["shortfall"] == {"workload": 0.5, "routing": 200 / 1500, "eviction": 100 / 1500, "other": 0.0}


def test_one_engine_has_no_fleet_section():
    assert fleet.section({"fleet_engines": [row("ra", 11, 8000, 10, 1000, 400, 600, 300, 200, 100)]}) is None
