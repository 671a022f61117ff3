"""The receiving side in exporters/: the collector pipeline wires OTLP in to the trace and metric
exporters, and the Grafana dashboard queries only metrics kvtrace exports, under the names the
collector's Prometheus exporter gives them.  No network."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvtrace.otlp.metrics import HISTS, SUMS

EXP = Path(__file__).resolve().parents[2] / "exporters"


def prometheus_names() -> set[str]:
    """OTLP -> Prometheus names (the collector's translator): dots to underscores, unit suffix
    (s -> seconds, By -> bytes, 1 on a gauge -> ratio, {…} dropped), _total on monotonic sums."""
    suffix = {"s": "_seconds", "By": "_bytes"}
    out = {"kvtrace_prefix_cache_hit_rate_ratio"}
    for name, (unit, _) in SUMS.items():
        out.add(name.replace(".", "_") + suffix.get(unit, "") + "_total")
    for name, (unit, _) in HISTS.items():
        base = name.replace(".", "_") + suffix.get(unit, "")
        out |= {base + "_bucket", base + "_sum", base + "_count"}
    return out


def test_collector_pipeline():
    cfg = yaml.safe_load((EXP / "otelcol.yaml").read_text())
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    p = cfg["service"]["pipelines"]
    assert p["traces"]["receivers"] == ["otlp"] and set(p["traces"]["exporters"]) == {"otlp/jaeger", "otlp/tempo"}
    assert p["metrics"]["exporters"] == ["prometheus"]
    for pipe in p.values():
        assert set(pipe["processors"]) <= set(cfg["processors"]) and set(pipe["exporters"]) <= set(cfg["exporters"])
    tempo = yaml.safe_load((EXP / "tempo.yaml").read_text())
    assert "otlp" in tempo["distributor"]["receivers"]
    prom = yaml.safe_load((EXP / "prometheus.yaml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["otelcol:8889"]
    compose = yaml.safe_load((EXP / "docker-compose.yaml").read_text())
    assert {"otelcol", "jaeger", "tempo", "prometheus", "grafana"} <= set(compose["services"])


def test_dashboard_queries_what_kvtrace_exports():
    dash = json.loads((EXP / "grafana" / "kvtrace.json").read_text())
    ds = {d["uid"] for d in yaml.safe_load((EXP / "grafana" / "datasources.yaml").read_text())["datasources"]}
    names = prometheus_names()
    used, traceql = set(), []
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] in ds
        for t in panel["targets"]:
            if "expr" in t:
                used |= set(re.findall(r"\bkvtrace_[a-z_]+", t["expr"])) - {"kvtrace_cache_source", "kvtrace_io_layer",
                                                                             "kvtrace_transfer_direction"}
            else:
                traceql.append(t["query"])
    assert used and used <= names, used - names
    # every exported metric family is on the dashboard
    families = {n.rsplit("_bucket", 1)[0] for n in used}
    assert len(families) == len(SUMS) + len(HISTS) + 1  # the sums, the histograms and the hit-rate gauge
    assert any('name = "kvtrace.prefill_chunk"' in q and "kvtrace.chunk.bottleneck" in q for q in traceql)
    assert any('name = "kvtrace.request"' in q for q in traceql)
