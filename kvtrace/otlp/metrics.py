"""OTLP metrics kept from correlation results (cumulative since the run started).

    kvtrace.prefix_cache.queries      Sum {token}    tokens looked up at admissions (each admission's prefill length)
    kvtrace.prefix_cache.hits         Sum {token}    of those, found cached; kvtrace.cache.source = local | external
    kvtrace.prefix_cache.hit_rate     Gauge 1        hits / queries so far
    kvtrace.kv.evictions              Sum {block}    prefix-cache blocks evicted
    kvtrace.kv.preemptions            Sum {request}  preemptions
    kvtrace.kv.transfer.size          Sum By         KV connector bytes; kvtrace.transfer.direction = load | store
    kvtrace.kv.load.duration          Histogram s    KV connector load durations; kvtrace.transfer.source
    kvtrace.storage.duration          Histogram s    kernel storage I/O latency; kvtrace.io.layer = block | file | io_uring
    kvtrace.chunk.storage_wait        Histogram s    per prefill chunk, its step's storage wait

Through the collector's Prometheus exporter they become kvtrace_prefix_cache_hits_total,
kvtrace_kv_load_duration_seconds_bucket, … (exporters/).
"""
from __future__ import annotations

import numpy as np
from kvtrace import __version__

BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_B = np.array(BOUNDS)
SUMS = {
    "kvtrace.prefix_cache.queries": ("{token}", "Prompt tokens looked up in the prefix cache at admissions"),
    "kvtrace.prefix_cache.hits": ("{token}", "Prompt tokens found cached at admissions"),
    "kvtrace.kv.evictions": ("{block}", "Prefix-cache blocks evicted"),
    "kvtrace.kv.preemptions": ("{request}", "Requests preempted"),
    "kvtrace.kv.transfer.size": ("By", "KV connector bytes moved"),
}
HISTS = {
    "kvtrace.kv.load.duration": ("s", "KV connector load duration"),
    "kvtrace.storage.duration": ("s", "Kernel storage I/O latency (block layer, file syscalls, io_uring)"),
    "kvtrace.chunk.storage_wait": ("s", "Storage wait of the step each prefill chunk ran in"),
}


class Metrics:
    def __init__(self, start_wall_ns: int):
        self.start = start_wall_ns
        self.sums: dict[tuple, float] = {}
        self.hists: dict[tuple, list] = {}  # key -> [bucket counts, sum, count, min, max]

    def _add(self, name: str, attrs: tuple, v: float) -> None:
        k = (name, attrs)
        self.sums[k] = self.sums.get(k, 0) + v

    def _observe(self, name: str, attrs: tuple, values) -> None:
        values = np.asarray(values, dtype=np.float64)
        if not len(values):
            return
        k = (name, attrs)
        h = self.hists.get(k)
        if h is None:
            h = self.hists[k] = [np.zeros(len(BOUNDS) + 1, np.int64), 0.0, 0, float("inf"), float("-inf")]
        h[0] += np.bincount(np.searchsorted(_B, values, "left"), minlength=len(BOUNDS) + 1)
        h[1] += float(values.sum())
        h[2] += len(values)
        h[3] = min(h[3], float(values.min()))
        h[4] = max(h[4], float(values.max()))

    def add(self, res) -> None:
        for a in res.admits:
            self._add("kvtrace.prefix_cache.queries", (), a["prefill_len"])
            self._add("kvtrace.prefix_cache.hits", (("kvtrace.cache.source", "local"),), a["cached_local"])
            self._add("kvtrace.prefix_cache.hits", (("kvtrace.cache.source", "external"),), a["cached_external"])
        if res.evicts:
            self._add("kvtrace.kv.evictions", (), len(res.evicts))
        if res.preempts:
            self._add("kvtrace.kv.preemptions", (), len(res.preempts))
        by_source: dict[str, list] = {}
        for t in res.transfers:
            self._add("kvtrace.kv.transfer.size", (("kvtrace.transfer.direction", t["dir"]),), t["nbytes"])
            if t["dir"] == "load":
                by_source.setdefault(t["source"], []).append((t["t_end_ns"] - t["t_start_ns"]) / 1e9)
        for src, v in by_source.items():
            self._observe("kvtrace.kv.load.duration", (("kvtrace.transfer.source", src),), v)
        at = res.attributions
        if at.num_rows:
            import pyarrow as pa

            src = at["source"].cast(pa.string()).to_numpy(zero_copy_only=False)
            how = at["how"].cast(pa.string()).to_numpy(zero_copy_only=False)
            lat = (at["ts_ns"].to_numpy().astype(np.int64) - at["start_ns"].to_numpy().astype(np.int64)) / 1e9
            for source, layer in (("block_io", "block"), ("file_io", "file"), ("io_uring", "io_uring")):
                m = (src == source) & (how != "none")
                self._observe("kvtrace.storage.duration", (("kvtrace.io.layer", layer),), lat[m])
        if res.chunks.num_rows:
            self._observe("kvtrace.chunk.storage_wait", (), res.chunks["storage_wait_ns"].to_numpy() / 1e9)

    def hit_rate(self) -> float | None:
        q = self.sums.get(("kvtrace.prefix_cache.queries", ()), 0)
        hits = sum(v for (n, _), v in self.sums.items() if n == "kvtrace.prefix_cache.hits")
        return hits / q if q else None

    def request(self, resource_attrs, now_wall_ns: int) -> bytes:
        """ExportMetricsServiceRequest bytes (cumulative temporality)."""
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as ms
        from opentelemetry.proto.common.v1 import common_pb2 as cm
        from opentelemetry.proto.metrics.v1 import metrics_pb2 as m
        from opentelemetry.proto.resource.v1 import resource_pb2 as rs


        def kvs(attrs):
            out = []
            for k, v in attrs:
                av = cm.AnyValue(string_value=v) if isinstance(v, str) else cm.AnyValue(int_value=v)
                out.append(cm.KeyValue(key=k, value=av))
            return out

        cum = m.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
        metrics = []
        for name, (unit, desc) in SUMS.items():
            pts = [m.NumberDataPoint(attributes=kvs(a), start_time_unix_nano=self.start, time_unix_nano=now_wall_ns,
                                     as_int=int(v)) for (n, a), v in sorted(self.sums.items()) if n == name]
            if pts:
                metrics.append(m.Metric(name=name, unit=unit, description=desc,
                                        sum=m.Sum(data_points=pts, aggregation_temporality=cum, is_monotonic=True)))
        rate = self.hit_rate()
        if rate is not None:
            metrics.append(m.Metric(name="kvtrace.prefix_cache.hit_rate", unit="1",
                                    description="Share of looked-up prompt tokens found cached, since the run started",
                                    gauge=m.Gauge(data_points=[m.NumberDataPoint(time_unix_nano=now_wall_ns, as_double=rate)])))
        for name, (unit, desc) in HISTS.items():
            pts = []
            for (n, a), h in sorted(self.hists.items(), key=lambda kv: kv[0]):
                if n != name:
                    continue
                pts.append(m.HistogramDataPoint(attributes=kvs(a), start_time_unix_nano=self.start,
                                                time_unix_nano=now_wall_ns, count=h[2], sum=h[1],
                                                bucket_counts=[int(x) for x in h[0]], explicit_bounds=list(BOUNDS),
                                                min=h[3], max=h[4]))
            if pts:
                metrics.append(m.Metric(name=name, unit=unit, description=desc,
                                        histogram=m.Histogram(data_points=pts, aggregation_temporality=cum)))
        req = ms.ExportMetricsServiceRequest(resource_metrics=[m.ResourceMetrics(
            resource=rs.Resource(attributes=kvs(resource_attrs)),
            scope_metrics=[m.ScopeMetrics(scope=cm.InstrumentationScope(name="kvtrace", version=__version__),
                                          metrics=metrics)])])
        return req.SerializeToString()
