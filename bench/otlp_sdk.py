"""kvtrace's own OTLP span encoder and exporter against the OpenTelemetry Python SDK, on the same spans.

    .venv/bin/python bench/otlp_sdk.py [--short] [--rounds N] [--json OUT]

Needs opentelemetry-sdk, opentelemetry-exporter-otlp-proto-grpc and opentelemetry-exporter-otlp-proto-http
(pip install them into the venv; they are not kvtrace dependencies): without them it says so and exits 2.

The spans: bench/correlate.py's recorded synthetic run (12,000 requests; 1,500 with --short; a tenth of
its shared I/O rows, which are in no span), correlated once here and handed to every path as the same
correlation result (pickled), so every path sends the same 73,250 spans (request, prefill chunk, KV
load, block and file I/O; with events).

- A, the encoder: what `kvtrace export` and the live sink run.  encoded_spans_of_pass (chunk and
  request spans column-wise, the rest span by span) and kvtrace.otlp.exporter.Exporter (batches of
  512, its own gRPC / HTTP client).
- B, the SDK's Tracer: kvtrace's span model (spans_of_pass: the Span tuples the encoder's tests are
  checked against) turned into SDK spans by a TracerProvider whose IdGenerator hands out kvtrace's
  trace and span ids, parents given as span contexts, explicit start and end times, the same
  attributes, events and status (kvtrace's spans have no links); BatchSpanProcessor (batches of 512)
  and the SDK's OTLPSpanExporter (opentelemetry-exporter-otlp-proto-grpc / -http).
- B', the SDK without its Tracer: ReadableSpan objects built directly and handed to the same
  BatchSpanProcessor and OTLPSpanExporter (the cheapest way to use the SDK's export path).

Every path runs in a subprocess of its own (its CPU is process_time of that process, all its
threads: exporter, gRPC and the SDK's batch thread included; its memory is the peak RSS over the
measured work above the RSS before it, from VmHWM reset through /proc/self/clear_refs, and, in one
more subprocess per path (gRPC), tracemalloc's peak).  The receiver is tests/otlp_receiver.py in this
process: a real gRPC and HTTP/protobuf receiver that decodes every request with opentelemetry-proto;
after each run every span received is checked against kvtrace's span model (same count, ids,
parents, names, times, attributes, events, status).  The paths alternate in rounds (A B B', then
B' B A) on both transports; medians and the A/B ratios of each round are reported.  Last, one more
subprocess times the SDK exporter's steps alone on the same spans (encode_spans, serialising).

Rates are spans per CPU second of the sending process.  B is also given without its first stage
(building kvtrace's Span tuples), which an SDK integration could fold into making SDK spans: that
is the SDK's best case, and the figure the decision uses.  gc is off while spans are built, for
every path (`kvtrace export` does the same for its encoder).  Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SDK_PACKAGES = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http")
PATHS = {"encoder": "A: kvtrace encoder + exporter",
         "sdk": "B: SDK Tracer + BatchSpanProcessor + OTLPSpanExporter",
         "sdk_readable": "B': SDK ReadableSpan + BatchSpanProcessor + OTLPSpanExporter"}
TARGET = 50_000      # spans per CPU second (README: OTLP spans, encoded and sent)
BATCH = 512


def sdk_missing() -> str | None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        return (f"bench/otlp_sdk.py needs {', '.join(SDK_PACKAGES)} (not kvtrace dependencies): "
                f".venv/bin/pip install {' '.join(SDK_PACKAGES)} ({e})")
    return None


# ---------------------------------------------------------------------------------------------
# The measured side: one path, one transport, in a process of its own.

def _status() -> dict:
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f)}


def _kib(v: str) -> int:
    return int(v.split()[0])


def _no_gc():
    from kvtrace.correlate.derive import no_gc

    return no_gc()


def run_encoder(res, accs, trace_of, url: str, protocol: str, resource_attrs) -> dict:
    from kvtrace.otlp.exporter import Exporter
    from kvtrace.otlp.sink import encoded_spans_of_pass

    exp = Exporter(url, protocol, resource_attrs, max_queue=1 << 30, max_queue_bytes=1 << 40, batch_size=BATCH,
                   delay=0.05)
    c0, w0 = time.process_time(), time.perf_counter()
    with _no_gc():
        enc = encoded_spans_of_pass(res, accs, trace_of, "bench", 0)
    c1 = time.process_time()
    exp.submit(enc)
    exp.flush(timeout=600)
    stats = exp.close(5)
    c2, w2 = time.process_time(), time.perf_counter()
    return {"spans": len(enc), "sent": stats.sent, "dropped": stats.dropped(), "batches": stats.batches,
            "cpu_s": c2 - c0, "wall_s": w2 - w0, "build_cpu_s": c1 - c0, "build_stage": "encoded_spans_of_pass",
            "encoded_bytes": sum(map(len, enc))}


def _sdk_setup(url: str, protocol: str, resource_attrs, tracer: bool):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        kw = {"endpoint": url, "insecure": True, "timeout": 30}
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        kw = {"endpoint": url + "/v1/traces", "timeout": 30}

    class Counting(OTLPSpanExporter):
        """The SDK's exporter, counting what the receiver acknowledged."""
        sent = failed = batches = 0

        def export(self, spans):
            r = super().export(spans)
            if r is SpanExportResult.SUCCESS:
                Counting.sent += len(spans)
                Counting.batches += 1
            else:
                Counting.failed += len(spans)
            return r

    exporter = Counting(**kw)

    class KvtraceIds(IdGenerator):
        """kvtrace's ids: the next span's, set before it is started."""
        trace_id = span_id = 0

        def generate_span_id(self) -> int:
            return self.span_id

        def generate_trace_id(self) -> int:
            return self.trace_id

    resource = Resource(dict(resource_attrs))
    bsp = BatchSpanProcessor(exporter, max_queue_size=1 << 22, schedule_delay_millis=50, max_export_batch_size=BATCH)
    ids = KvtraceIds()
    provider = None
    if tracer:
        provider = TracerProvider(resource=resource, id_generator=ids, sampler=ALWAYS_ON,
                                  span_limits=SpanLimits(max_events=64, max_attributes=256))
        provider.add_span_processor(bsp)
    return Counting, bsp, provider, ids, resource


def run_sdk(res, accs, trace_of, url: str, protocol: str, resource_attrs, tracer: bool) -> dict:
    from opentelemetry import trace as api
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState
    from opentelemetry.trace.status import Status, StatusCode

    from kvtrace import __version__
    from kvtrace.otlp.sink import spans_of_pass

    Counting, bsp, provider, ids, resource = _sdk_setup(url, protocol, resource_attrs, tracer)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    states: dict[str, TraceState | None] = {"": None}
    error = Status(StatusCode.ERROR)
    frombytes = int.from_bytes

    def state(s: str):
        ts = states.get(s)
        if ts is None and s not in states:
            ts = states[s] = TraceState.from_header([s])
        return ts

    make = None if tracer else readable_maker(resource)
    c0, w0 = time.process_time(), time.perf_counter()
    with _no_gc():
        spans = spans_of_pass(res, accs, trace_of, "bench", 0)
    c1 = time.process_time()
    t1 = time.thread_time()
    with _no_gc():
        if tracer:
            tr = provider.get_tracer("kvtrace", __version__)
            root = Context()
            parents: dict[bytes, Context] = {}   # a parent's context, made once (as a caller holding it would)
            for s in spans:
                trace_id = frombytes(s.trace_id)
                ids.trace_id, ids.span_id = trace_id, frombytes(s.span_id)
                if s.parent_id:
                    ctx = parents.get(s.parent_id)
                    if ctx is None:
                        ctx = parents[s.parent_id] = api.set_span_in_context(NonRecordingSpan(SpanContext(
                            trace_id, frombytes(s.parent_id), is_remote=s.name == "kvtrace.request",
                            trace_flags=sampled, trace_state=state(s.trace_state))), root)
                else:
                    ctx = root
                sp = tr.start_span(s.name, context=ctx, kind=SpanKind.INTERNAL, attributes=dict(s.attrs),
                                   start_time=s.start)
                for t, name, a in s.events:
                    sp.add_event(name, dict(a), timestamp=t)
                if s.dropped_events:
                    sp._events.dropped += s.dropped_events  # kvtrace caps events itself (64)
                if s.error:
                    sp.set_status(error)
                sp.end(end_time=max(s.end, s.start))
        else:
            for s in spans:
                bsp.on_end(make(s))
    t2 = time.thread_time()
    (provider or bsp).force_flush(600_000)
    (provider or bsp).shutdown()
    c2, w2 = time.process_time(), time.perf_counter()
    return {"spans": len(spans), "sent": Counting.sent, "dropped": Counting.failed, "batches": Counting.batches,
            "cpu_s": c2 - c0, "wall_s": w2 - w0, "build_cpu_s": c1 - c0, "build_stage": "spans_of_pass (Span tuples)",
            "sdk_cpu_s": c2 - c1, "sdk_make_spans_main_thread_cpu_s": t2 - t1}


def readable_maker(resource):
    """kvtrace Span tuple -> the SDK's ReadableSpan with the same ids, parent, times, attributes,
    events and status (path B')."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util import BoundedList
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
    from opentelemetry.trace.status import Status, StatusCode

    from kvtrace import __version__

    scope = InstrumentationScope("kvtrace", __version__)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    error, unset = Status(StatusCode.ERROR), Status(StatusCode.UNSET)
    states: dict = {"": None}
    frombytes = int.from_bytes

    def make(s):
        ts = states.get(s.trace_state)
        if ts is None and s.trace_state not in states:
            ts = states[s.trace_state] = TraceState.from_header([s.trace_state])
        trace_id = frombytes(s.trace_id)
        parent = SpanContext(trace_id, frombytes(s.parent_id), is_remote=s.name == "kvtrace.request",
                             trace_flags=sampled, trace_state=ts) if s.parent_id else None
        evs = [Event(name, dict(a), t) for t, name, a in s.events]
        if s.dropped_events:
            evs = BoundedList.from_seq(None, evs)
            evs.dropped = s.dropped_events
        return ReadableSpan(
            s.name, SpanContext(trace_id, frombytes(s.span_id), is_remote=False, trace_flags=sampled, trace_state=ts),
            parent, resource, dict(s.attrs), evs, (), SpanKind.INTERNAL, None, error if s.error else unset,
            s.start, max(s.end, s.start), scope)

    return make


def run_breakdown(res, accs, trace_of, resource_attrs) -> dict:
    """Not a path: the SDK exporter's two steps timed alone on the same spans (ReadableSpans as B'
    makes them; encode_spans, which builds the opentelemetry-proto messages, then their
    serialisation), and kvtrace's span-by-span encoder (encode.span) on the same Span tuples."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource

    from kvtrace.otlp import encode
    from kvtrace.otlp.sink import spans_of_pass

    make = readable_maker(Resource(dict(resource_attrs)))
    with _no_gc():
        spans = spans_of_pass(res, accs, trace_of, "bench", 0)
        c0 = time.process_time()
        rs = [make(s) for s in spans]
        c1 = time.process_time()
        msgs = [encode_spans(rs[i:i + BATCH]) for i in range(0, len(rs), BATCH)]
        c2 = time.process_time()
        body = sum(len(m.SerializeToString()) for m in msgs)
        c3 = time.process_time()
        enc = [encode.span(s) for s in spans]
        c4 = time.process_time()
    n = len(spans)
    us = lambda a, b: round((b - a) / n * 1e6, 1)  # noqa: E731
    return {"path": "breakdown", "spans": n, "readable_span_us": us(c0, c1), "sdk_encode_spans_us": us(c1, c2),
            "sdk_serialize_us": us(c2, c3), "sdk_request_bytes_per_span": round(body / n, 1),
            "kvtrace_encode_span_us": us(c3, c4), "kvtrace_bytes_per_span": round(sum(map(len, enc)) / n, 1)}


def child(path: str, protocol: str, url: str, data: str, trace_malloc: bool) -> int:
    import tracemalloc

    from kvtrace.otlp import encode
    from kvtrace.otlp.exporter import Exporter  # noqa: F401  (imports done before the measurement)

    if path != "encoder":
        import opentelemetry.sdk.trace  # noqa: F401
    with open(data, "rb") as f:
        res, accs, traces = pickle.load(f)
    trace_of = traces.__getitem__
    resource_attrs = encode.resource_attrs("bench", "bench")
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # VmHWM := VmRSS: the peak from here on
        hwm_reset = True
    except OSError:
        hwm_reset = False
    rss0 = _kib(_status()["VmRSS"])
    if trace_malloc:
        tracemalloc.start()
    if path == "breakdown":
        print(json.dumps(run_breakdown(res, accs, trace_of, resource_attrs)), flush=True)
        return 0
    if path == "encoder":
        out = run_encoder(res, accs, trace_of, url, protocol, resource_attrs)
    else:
        out = run_sdk(res, accs, trace_of, url, protocol, resource_attrs, tracer=path == "sdk")
    st = _status()
    out.update({"path": path, "protocol": protocol, "rss_before_mib": rss0 / 1024,
                "peak_rss_mib": _kib(st["VmHWM"]) / 1024, "rss_after_mib": _kib(st["VmRSS"]) / 1024,
                "peak_rss_delta_mib": (_kib(st["VmHWM"]) - rss0) / 1024 if hwm_reset else None})
    if trace_malloc:
        out["tracemalloc_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    print(json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The orchestrating side: the spans, the receiver, the rounds, the checks, the table.

def expected_key(s) -> tuple:
    """tests.otlp_receiver.DecodedSpan.key() of kvtrace's Span tuple: what must arrive."""
    return (s.trace_id.hex(), s.span_id.hex(), s.parent_id.hex(), s.name, s.start, max(s.end, s.start),
            tuple(sorted(s.attrs)), tuple((t, n, tuple(sorted(a))) for t, n, a in s.events),
            s.trace_state, s.dropped_events, 2 if s.error else 0)


def check(received: list, expected: dict) -> dict:
    """Every expected span arrived once, equal to kvtrace's model (ids, parent, name, times, attributes,
    events, status, kind internal)."""
    got = {}
    dup = unequal = kind = 0
    example = None
    for d in received:
        k = (d.trace_id, d.span_id)
        if k in got:
            dup += 1
        key = d.key()
        got[k] = key
        if d.kind != 1:
            kind += 1
        e = expected.get(k)
        if e is not None and e != key:
            unequal += 1
            if example is None:
                example = {"expected": repr(e)[:600], "received": repr(key)[:600]}
    missing = len(expected.keys() - got.keys())
    extra = len(got.keys() - expected.keys())
    ids = hashlib.sha256("".join(sorted(a + b for a, b in got)).encode()).hexdigest()[:16]
    out = {"received": len(received), "missing": missing, "extra": extra, "duplicates": dup, "unequal": unequal,
           "not_internal": kind, "ids_sha256": ids,
           "identical": not (missing or extra or dup or unequal or kind) and len(received) == len(expected)}
    if example:
        out["example"] = example
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def summarise(trials: list[dict]) -> dict:
    out = {}
    for proto in ("grpc", "http"):
        rows = {}
        for path in PATHS:
            ts = [t for t in trials if t["protocol"] == proto and t["path"] == path]
            if not ts:
                continue
            r = {"runs": len(ts),
                 "spans_per_cpu_s": [int(t["spans"] / t["cpu_s"]) for t in ts],
                 "spans_per_wall_s": [int(t["spans"] / t["wall_s"]) for t in ts],
                 "peak_rss_delta_mib": [round(t["peak_rss_delta_mib"], 1) for t in ts if t["peak_rss_delta_mib"] is not None],
                 "build_cpu_s": [round(t["build_cpu_s"], 3) for t in ts]}
            if path != "encoder":
                r["sdk_only_spans_per_cpu_s"] = [int(t["spans"] / t["sdk_cpu_s"]) for t in ts]
                r["sdk_make_spans_us_per_span"] = [round(t["sdk_make_spans_main_thread_cpu_s"] / t["spans"] * 1e6, 1)
                                                   for t in ts]
            r["cpu_us_per_span"] = [round(t["cpu_s"] / t["spans"] * 1e6, 2) for t in ts]
            for k in list(r):
                if isinstance(r[k], list):
                    r[k + "_median"] = median(r[k])
            rows[path] = r
        # per round: A over B, both as measured in that round
        for b in ("sdk", "sdk_readable"):
            if b not in rows or "encoder" not in rows:
                continue
            ratios, ratios_sdk_only, mem = [], [], []
            for rnd in sorted({t["round"] for t in trials}):
                a = [t for t in trials if t["round"] == rnd and t["protocol"] == proto and t["path"] == "encoder"]
                x = [t for t in trials if t["round"] == rnd and t["protocol"] == proto and t["path"] == b]
                if a and x:
                    ra = a[0]["spans"] / a[0]["cpu_s"]
                    ratios.append(round(ra / (x[0]["spans"] / x[0]["cpu_s"]), 2))
                    ratios_sdk_only.append(round(ra / (x[0]["spans"] / x[0]["sdk_cpu_s"]), 2))
                    if a[0]["peak_rss_delta_mib"] and x[0]["peak_rss_delta_mib"] is not None:
                        mem.append(round(x[0]["peak_rss_delta_mib"] / a[0]["peak_rss_delta_mib"], 2))
            rows[b]["encoder_over_this"] = ratios
            rows[b]["encoder_over_this_median"] = median(ratios)
            rows[b]["encoder_over_sdk_only"] = ratios_sdk_only
            rows[b]["encoder_over_sdk_only_median"] = median(ratios_sdk_only)
            rows[b]["rss_delta_over_encoder"] = mem
            rows[b]["rss_delta_over_encoder_median"] = median(mem)
        out[proto] = rows
    return out


def decide(summary: dict) -> dict:
    """The issue's rule: the SDK if it reaches 50k spans per CPU second or comes within 2x of the
    encoder (its best variant, without the Span-tuple stage), on either transport."""
    best = {}
    for proto, rows in summary.items():
        cands = [(rows[b]["sdk_only_spans_per_cpu_s_median"], rows[b]["encoder_over_sdk_only_median"], b)
                 for b in ("sdk", "sdk_readable") if b in rows]
        rate, ratio, b = max(cands)
        best[proto] = {"variant": b, "sdk_only_spans_per_cpu_s": rate, "encoder_over_sdk": ratio,
                       "reaches_target": rate >= TARGET, "within_2x": ratio <= 2.0}
    use_sdk = any(v["reaches_target"] or v["within_2x"] for v in best.values())
    return {"use_sdk": use_sdk, "decision": "SDK" if use_sdk else "keep the encoder", "target_spans_per_cpu_s": TARGET,
            "best_sdk": best}


def markdown(out: dict) -> str:
    s = out["summary"]
    lines = [f"kvtrace encoder vs OpenTelemetry SDK {out['versions'].get('opentelemetry-sdk')} "
             f"({out['spans']:,} spans, {out['rounds']} rounds, {out['date']}, load average {out['load_average'][0]:.1f}-"
             f"{out['load_average'][1]:.1f})", "",
             "| path | transport | spans per CPU s (median; runs) | CPU µs a span | SDK stage alone, spans per CPU s | "
             "encoder / this (per round) | spans per wall s | peak RSS over the work, MiB (median) | tracemalloc peak, MiB (one more run) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for proto in ("grpc", "http"):
        for path, label in PATHS.items():
            r = s[proto].get(path)
            if r is None:
                continue
            tm = out["tracemalloc"].get(f"{path}/{proto}", {}).get("tracemalloc_peak_mib")
            lines.append(
                f"| {label} | {'gRPC' if proto == 'grpc' else 'HTTP/protobuf'} | **{r['spans_per_cpu_s_median']:,}** "
                f"({', '.join(f'{x:,}' for x in r['spans_per_cpu_s'])}) | {r['cpu_us_per_span_median']} | "
                + (f"{r['sdk_only_spans_per_cpu_s_median']:,}" if path != "encoder" else "") + " | "
                + (f"**{r['encoder_over_this_median']}×** ({', '.join(map(str, r['encoder_over_this']))}); "
                   f"SDK stage alone {r['encoder_over_sdk_only_median']}×" if path != "encoder" else "") + " | "
                f"{r['spans_per_wall_s_median']:,} | {r['peak_rss_delta_mib_median']} | "
                + (f"{tm:.1f}" if tm is not None else "") + " |")
    d = out["decision"]
    lines += ["", f"Decision (≥ {TARGET:,} spans per CPU second, or within 2× of the encoder → SDK): **{d['decision']}**"
              + "; the SDK's best: " + "; ".join(
                  f"{p} {v['variant']} {v['sdk_only_spans_per_cpu_s']:,}/CPU s, encoder {v['encoder_over_sdk']}× faster"
                  for p, v in d["best_sdk"].items()),
              f"Every run's spans arrived identical to kvtrace's model: {out['all_identical']}"]
    b = out.get("breakdown")
    if b:
        lines.append(f"The SDK exporter's steps timed alone, per span: ReadableSpan {b['readable_span_us']} µs, "
                     f"encode_spans (opentelemetry-proto messages) {b['sdk_encode_spans_us']} µs, serialising "
                     f"{b['sdk_serialize_us']} µs; kvtrace's span-by-span encoder (encode.span) {b['kvtrace_encode_span_us']} µs "
                     f"({b['kvtrace_bytes_per_span']} bytes a span, the SDK's request {b['sdk_request_bytes_per_span']})")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in ("opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp-proto-grpc",
              "opentelemetry-exporter-otlp-proto-http", "opentelemetry-proto", "protobuf", "grpcio", "requests"):
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true", help="1,500 requests instead of 12,000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="default bench/results/otlp_sdk[-short].json")
    ap.add_argument("--child", nargs=4, metavar=("PATH", "PROTOCOL", "URL", "DATA"), help=argparse.SUPPRESS)
    ap.add_argument("--tracemalloc", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    missing = sdk_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if a.child:
        return child(*a.child, a.tracemalloc)

    import correlate as bench_correlate

    from kvtrace.correlate.derive import correlate_tables
    from kvtrace.otlp.sink import spans_of_pass
    from tests.otlp_receiver import Received, Receiver

    wall0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    n_req, shared = (1500, 30_000) if a.short else (12_000, 300_000)
    tables = bench_correlate.big_run(n_req, shared)
    res, accs, _, traces = correlate_tables(tables, "bench")
    del tables
    model = spans_of_pass(res, accs, traces.__getitem__, "bench", 0)
    expected = {(s.trace_id.hex(), s.span_id.hex()): expected_key(s) for s in model}
    kinds: dict[str, int] = {}
    for s in model:
        kinds[s.name] = kinds.get(s.name, 0) + 1
    n_events = sum(len(s.events) for s in model)
    del model
    tmp = tempfile.TemporaryDirectory(prefix="kvtrace-otlp-sdk-")
    data = os.path.join(tmp.name, "correlation.pickle")
    with open(data, "wb") as f:
        pickle.dump((res, accs, traces), f, protocol=5)
    del res, accs, traces
    gc.collect()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}   # no exporter settings from outside

    rx = Receiver().start()
    trials, checks, tm, breakdown = [], [], {}, {}
    loads = [load0]

    def one(path: str, proto: str, rnd: int | None, trace_malloc: bool = False) -> dict:
        rx.got = Received()
        cmd = [sys.executable, __file__, "--child", path, proto, rx.url(proto), data] + (["--tracemalloc"] if trace_malloc else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{path}/{proto} failed ({p.returncode}): {p.stderr[-2000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        with rx.got.lock:
            received = list(rx.got.spans)
        rx.got = Received()
        c = check(received, expected)
        del received
        r.update({"round": rnd, "check": c, "tracemalloc_run": trace_malloc})
        if p.stderr.strip():
            r["stderr"] = p.stderr.strip()[-500:]
        checks.append(c["identical"])
        loads.append(os.getloadavg()[0])
        print(f"  {'tracemalloc ' if trace_malloc else ''}round {rnd} {proto} {path}: {r['spans'] / r['cpu_s']:,.0f} spans/CPU s, "
              f"{r['cpu_s']:.2f} CPU s, peak RSS +{r['peak_rss_delta_mib']:.1f} MiB, received {c['received']:,} "
              f"identical={c['identical']}", file=sys.stderr, flush=True)
        return r

    try:
        order = list(PATHS)
        for rnd in range(a.rounds):
            for proto in ("grpc", "http"):
                for path in (order if rnd % 2 == 0 else order[::-1]):
                    trials.append(one(path, proto, rnd))
        for path in order:   # memory does not depend on the transport much: gRPC only
            tm[f"{path}/grpc"] = one(path, "grpc", None, trace_malloc=True)
        p = subprocess.run([sys.executable, __file__, "--child", "breakdown", "-", "-", data], capture_output=True,
                           text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"breakdown failed ({p.returncode}): {p.stderr[-2000:]}")
        breakdown = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        rx.stop(1.0)
        tmp.cleanup()

    summary = summarise(trials)
    out = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "short": a.short,
        "cores": os.cpu_count(), "machine": platform.release(), "versions": versions(),
        "requests": n_req, "spans": len(expected), "span_kinds": kinds, "events": n_events, "rounds": a.rounds,
        "batch_size": BATCH, "load_average": [min(loads), max(loads)],
        "summary": summary, "decision": decide(summary),
        "all_identical": all(checks), "tracemalloc": tm, "breakdown": breakdown, "trials": trials,
        "runtime_s": round(time.perf_counter() - wall0, 1),
        "command": ".venv/bin/python bench/otlp_sdk.py" + (" --short" if a.short else "")
                   + (f" --rounds {a.rounds}" if a.rounds != 3 else ""),
    }
    md = markdown(out)
    out["markdown"] = md
    path = Path(a.json) if a.json else ROOT / "bench" / "results" / f"otlp_sdk{'-short' if a.short else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(md + f"\nruntime {out['runtime_s']} s; JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
