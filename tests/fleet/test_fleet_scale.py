"""The fleet report at fleet scale, on a real run: `analyze`'s fleet section on the recorded
fleet (tests/data/recorded/fleet-router: two vLLM replicas behind vllm-router, one attach; its
README) and on a dataset of many hosts synthesised from it (tests/fleet/synth.py: each host a
copy of that one run, with its own run id, pids and ports).

- one host: the section's numbers are the raw tables' (admit rows, token_causes, requests),
  recomputed here in Python;
- N hosts: every count is N times one host's, every rate the same, 2N servers;
- Spark gives DuckDB's whole report on the N hosts (`make test-long`).

No root, no server.  How the cost grows with the hosts: tests/fleet/bench_fleet_scale.py.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from kvtrace.analysis.report import analyze
from kvtrace.dataset.reader import Dataset
from tests.fleet.synth import replicate
from tests.unit.analysis_fixture import assert_spark_report_equals

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded" / "fleet-router"
HOSTS = 8
COUNTS = ("requests", "prompt_tokens", "hit_tokens", "routed_tokens", "workload", "routing", "eviction", "other",
          "uncaused")
RATES = ("hit_rate", "routed_hit_rate", "ideal_hit_rate", "shortfall")
WORKLOAD = ("miss_cold", "miss_unseen", "miss_tail")


@pytest.fixture(scope="module")
def recorded() -> Path:
    if not (RECORDED / "admit").is_dir():
        pytest.skip(f"no recorded fleet dataset at {RECORDED} (tests/data/recorded/README.md says how it is made)")
    return RECORDED


@pytest.fixture(scope="module")
def one(recorded) -> dict:
    return analyze(recorded)


@pytest.fixture(scope="module")
def fleet(recorded, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet-scale") / f"hosts{HOSTS}"
    replicate(recorded, out, HOSTS)
    return out


@pytest.fixture(scope="module")
def many(fleet) -> dict:
    return analyze(fleet)


def raw(root: Path) -> dict:
    """Per server port, from the raw tables: first admissions (each request once), their prompt
    and hit tokens, the longest prefix held elsewhere (requests), and token_causes' tokens by part."""
    ds = Dataset.open(root)
    port = {r["pid"]: r["server"] for r in ds.table("servers").to_pylist()}
    elsewhere = {(r["engine_pid"], r["request"]): r["cached_elsewhere"] or 0 for r in ds.table("requests").to_pylist()}
    out: dict = defaultdict(lambda: defaultdict(int))
    seen = set()
    for a in ds.table("admit").to_pylist():
        if a["attempt"] or (a["pid"], a["request"]) in seen:
            continue
        seen.add((a["pid"], a["request"]))
        s, hit = out[port[a["pid"]]], a["cached_local"] + a["cached_external"]
        s["requests"] += 1
        s["prompt_tokens"] += a["prompt_len"]
        s["hit_tokens"] += hit
        s["routed_tokens"] += max(hit, elsewhere[(a["pid"], a["request"])])
    for c in ds.table("token_causes").to_pylist():
        if c["attempt"] == 0:
            part = ("workload" if c["cause"] in WORKLOAD else "routing" if c["cause"] == "miss_other_engine"
                    else "eviction" if c["cause"] == "miss_evicted" else None)
            if part:
                out[port[c["engine_pid"]]][part] += c["tokens"]
    return {k: dict(v) for k, v in out.items()}


def test_each_host_is_its_own_agent(recorded, fleet):
    """The synthesised hosts share no run id, pid or port: in every table of every host (runs
    included), the run column, the pid columns and the servers' ports are that host's own; the
    row counts are the recorded run's."""
    from tests.fleet.synth import PID_COLUMNS

    src, ds = Dataset.open(recorded), Dataset.open(fleet)
    hosts: dict = defaultdict(lambda: defaultdict(set))
    for name in [*ds.names(), "runs"]:
        assert sorted(ds.rows(name, host=f"h{h:03d}") for h in range(HOSTS)) == [src.rows(name)] * HOSTS, name
        t = ds.table(name)
        for col in t.column_names:
            kind = ("run" if col == "run" else "pid" if col in PID_COLUMNS or col == "pids" else
                    "port" if col == "server" else None)
            if kind:
                for h, v in zip(t.column("host").to_pylist(), t.column(col).to_pylist()):
                    hosts[kind][h] |= set(v if isinstance(v, list) else [v]) - {0, None}
    for kind, per in hosts.items():
        assert len(per) == HOSTS, kind
        assert sum(len(v) for v in per.values()) == len(set().union(*per.values())), f"{kind}s shared by hosts"
    assert all(len(v) == 1 for v in hosts["run"].values()) and all(len(v) == 2 for v in hosts["port"].values())


def test_one_host_is_the_raw_tables(recorded, one):
    """DuckDB's fleet section of the recorded run: per server and for the fleet, the sums of its
    admit rows, requests and token_causes (the live test, tests/fleet/test_router.py, checked
    these against the replicas' own answers when it was recorded)."""
    want = raw(recorded)
    f = one["fleet"]
    assert f["by"] == "server" and [s["server"] for s in f["servers"]] == sorted(want)
    for s in f["servers"]:
        assert {k: s[k] for k in want[s["server"]]} == want[s["server"]], s["server"]
    x = f["fleet"]
    total = {k: sum(w[k] for w in want.values()) for k in ("requests", "prompt_tokens", "hit_tokens", "routed_tokens",
                                                          "workload", "routing", "eviction")}
    assert {k: x[k] for k in total} == total
    # the recorded run: 24 requests of 168 tokens; 864 hit, 928 lost to routing, 768 to eviction
    assert (x["requests"], x["prompt_tokens"], x["hit_tokens"], x["routing"], x["eviction"]) == (24, 4032, 864, 928, 768)
    assert x["hit_tokens"] + sum(x[p] for p in ("workload", "routing", "eviction", "other")) == x["prompt_tokens"]


def test_n_hosts_are_n_times_one_host(one, many):
    """On HOSTS copies of the run, each on its own host: the fleet's counts are HOSTS times the
    recorded run's and its rates the same; 2 × HOSTS servers, each host's pair the recorded
    pair's figures; the rest of the report scales alike (requests, tokens, evictions)."""
    f1, fn = one["fleet"], many["fleet"]
    assert {k: fn["fleet"][k] for k in COUNTS} == {k: HOSTS * f1["fleet"][k] for k in COUNTS}
    assert {k: fn["fleet"][k] for k in RATES} == {k: f1["fleet"][k] for k in RATES}
    assert len(fn["servers"]) == 2 * HOSTS and len(set(s["server"] for s in fn["servers"])) == 2 * HOSTS
    assert fn["runs"] == HOSTS and len({s["run"] for s in fn["servers"]}) == HOSTS
    assert len(fn["fleet"]["engine_pids"]) == len(set(fn["fleet"]["engine_pids"])) == 2 * HOSTS
    for i, s in enumerate(fn["servers"]):   # ports ascend with the host: each host's pair in order
        r = f1["servers"][i % 2]
        assert {k: s[k] for k in (*COUNTS, *RATES)} == {k: r[k] for k in (*COUNTS, *RATES)}, s["server"]
    r1, rn = one["reuse"], many["reuse"]
    assert (rn["requests"], rn["prompt_tokens"], rn["hit_tokens"]) == tuple(HOSTS * r1[k] for k in (
        "requests", "prompt_tokens", "hit_tokens"))
    assert rn["hit_rate"] == r1["hit_rate"]
    assert many["chunking"]["evictions"]["evictions"] == HOSTS * one["chunking"]["evictions"]["evictions"]
    assert many["misses"]["first"] == {k: HOSTS * v for k, v in one["misses"]["first"].items()}


def test_runs_repeated_on_one_host_keep_the_hosts_ports(recorded, one, tmp_path):
    """Three copies of the run on one host (the same two replicas recorded three times, each run
    with its own pids, the host's ports): a server is its port within its run, so six rows, each
    the recorded server's figures; the fleet three times the recorded one's."""
    replicate(recorded, tmp_path / "ds", 1, runs_per_host=3)
    f = analyze(tmp_path / "ds")["fleet"]
    assert [s["server"] for s in f["servers"]] == [s["server"] for s in one["fleet"]["servers"]] * 3
    assert f["runs"] == 3 and len({p for s in f["servers"] for p in s["engine_pids"]}) == 6
    for i, s in enumerate(f["servers"]):
        r = one["fleet"]["servers"][i % 2]
        assert {k: s[k] for k in (*COUNTS, *RATES)} == {k: r[k] for k in (*COUNTS, *RATES)}
    assert {k: f["fleet"][k] for k in COUNTS} == {k: 3 * one["fleet"]["fleet"][k] for k in COUNTS}
    assert {k: f["fleet"][k] for k in RATES} == {k: one["fleet"]["fleet"][k] for k in RATES}


@pytest.mark.slow
@pytest.mark.long   # Apache Spark, the second SQL engine: make test-long
def test_spark_gives_duckdbs_report_on_many_hosts(fleet, many):
    """The whole report (fleet section included) on the HOSTS-host dataset: Spark's equals
    DuckDB's but for the engine and its time."""
    assert_spark_report_equals(fleet, many)


def test_the_replicas_counters_rise_per_server(recorded, one):
    """vLLM's own counters, scraped from each replica at its own instants, rise per server and then
    sum: 864 prefix-cache hits and 4,032 queries over the two replicas, kvtrace's hit and prompt
    tokens, and no warning (summed across servers at each instant they once read 448)."""
    rises = one["metrics"]["rises"]
    assert (rises["vllm:prefix_cache_hits_total"], rises["vllm:prefix_cache_queries_total"]) == (864, 4032)
    assert one["fleet"]["fleet"]["hit_tokens"] == 864 and not one.get("warnings")
