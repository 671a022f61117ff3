"""A real OTLP receiver for tests, built from opentelemetry-proto: gRPC TraceService and
MetricsService, and an HTTP/protobuf endpoint (POST /v1/traces, /v1/metrics).  It decodes every
request with the official message classes and keeps what arrived.

Modes: "ok"; "refuse" (gRPC UNAVAILABLE / HTTP 503 for every export); "slow" (sleeps ``delay``
seconds before answering).  Ports are taken from 4400-4499.

``stop()`` goes down as a backend would: exports in flight are answered, every later one is
refused (kept-alive HTTP connections included), and ``start()`` again comes back on the same
ports, keeping what arrived before.
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests import helpers


def free_port(avoid=()) -> int:
    """A free port in 4400-4499, the range the OTLP tests use."""
    return helpers.free_port(4400, 4499, avoid)


@dataclass
class DecodedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start: int
    end: int
    attrs: dict
    events: list
    trace_state: str
    resource: dict
    dropped_events: int
    status: int
    kind: int

    def key(self):
        return (self.trace_id, self.span_id, self.parent_id, self.name, self.start, self.end,
                tuple(sorted(self.attrs.items())), tuple((t, n, tuple(sorted(a.items()))) for t, n, a in self.events),
                self.trace_state, self.dropped_events, self.status)


def _value(v):
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Received:
    spans: list = field(default_factory=list)
    metrics: list = field(default_factory=list)     # (resource attrs, Metric message)
    trace_requests: int = 0
    metric_requests: int = 0
    transports: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(self, req, transport: str) -> None:
        out = []
        for rs in req.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(DecodedSpan(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.start_time_unix_nano,
                        s.end_time_unix_nano, _attrs(s.attributes),
                        [(e.time_unix_nano, e.name, _attrs(e.attributes)) for e in s.events], s.trace_state, res,
                        s.dropped_events_count, s.status.code, s.kind))
        with self.lock:
            self.spans.extend(out)
            self.trace_requests += 1
            self.transports.add(transport)

    def add_metrics(self, req, transport: str) -> None:
        with self.lock:
            for rm in req.resource_metrics:
                res = _attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        self.metrics.append((res, m))
            self.metric_requests += 1
            self.transports.add(transport)

    def latest_metrics(self, service: str | None = None) -> dict:
        """name -> the last Metric message received (cumulative: the last one is the total)."""
        with self.lock:
            out = {}
            for res, m in self.metrics:
                if service is None or res.get("service.name") == service:
                    out[m.name] = m
            return out


class Receiver:
    def __init__(self, mode: str = "ok", delay: float = 0.0, grpc_port: int | None = None,
                 http_port: int | None = None):
        self.mode, self.delay = mode, delay
        self.got = Received()
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port(avoid=(self.grpc_port,))
        self.started = 0            # how many times start() ran: a restart keeps the ports
        self.cv = threading.Condition()
        self.closing = False
        self.inflight = 0           # HTTP exports being answered
        self.conns: set = set()     # open HTTP connections

    def _rebind(self, what: str) -> None:
        """The port was taken before we bound it: another one, unless this is a restart."""
        if self.started:
            raise RuntimeError(f"could not bind the {what} port again on restart")
        if what == "gRPC":
            self.grpc_port = free_port(avoid=(self.grpc_port, self.http_port))
        else:
            self.http_port = free_port(avoid=(self.grpc_port, self.http_port))

    # -- gRPC ----------------------------------------------------------------------------------
    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as ms
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as msg
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsg

        rx = self

        def gate(context) -> None:  # the mode: refuse, or answer late
            if rx.mode == "refuse":
                context.abort(grpc.StatusCode.UNAVAILABLE, "refusing (test)")
            if rx.mode == "slow":
                time.sleep(rx.delay)

        class Traces(tsg.TraceServiceServicer):
            def Export(self, request, context):
                gate(context)
                rx.got.add_traces(request, "grpc")
                return ts.ExportTraceServiceResponse()

        class Metrics(msg.MetricsServiceServicer):
            def Export(self, request, context):
                gate(context)
                rx.got.add_metrics(request, "grpc")
                return ms.ExportMetricsServiceResponse()

        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                options=[("grpc.max_receive_message_length", 256 << 20)])
        tsg.add_TraceServiceServicer_to_server(Traces(), self.grpc)
        msg.add_MetricsServiceServicer_to_server(Metrics(), self.grpc)
        for _ in range(20):  # another process may take a free port before we bind it
            try:
                if self.grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}"):
                    break
            except RuntimeError:
                pass
            self._rebind("gRPC")
        else:
            raise RuntimeError("could not bind a gRPC port in 4400-4499")
        self.grpc.start()

    # -- HTTP/protobuf -------------------------------------------------------------------------
    def _start_http(self) -> None:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as ms
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts

        rx = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def setup(self):
                super().setup()
                with rx.cv:
                    rx.conns.add(self.connection)

            def finish(self):
                with rx.cv:
                    rx.conns.discard(self.connection)
                super().finish()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with rx.cv:
                    if rx.closing:  # going down: no answer, the connection is closed
                        self.close_connection = True
                        return
                    rx.inflight += 1
                try:
                    self._export(body)
                finally:
                    with rx.cv:
                        rx.inflight -= 1
                        rx.cv.notify_all()

            def _export(self, body):
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    return self._reply(415, b"")
                if rx.mode == "refuse":
                    return self._reply(503, b"")
                if rx.mode == "slow":
                    time.sleep(rx.delay)
                if self.path == "/v1/traces":
                    rx.got.add_traces(ts.ExportTraceServiceRequest.FromString(body), "http")
                    return self._reply(200, ts.ExportTraceServiceResponse().SerializeToString())
                if self.path == "/v1/metrics":
                    rx.got.add_metrics(ms.ExportMetricsServiceRequest.FromString(body), "http")
                    return self._reply(200, ms.ExportMetricsServiceResponse().SerializeToString())
                self._reply(404, b"")

            def _reply(self, code, data):
                self.send_response(code)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        for _ in range(20):
            try:
                self.http = ThreadingHTTPServer(("127.0.0.1", self.http_port), H)
                break
            except OSError:
                self._rebind("HTTP")
        else:
            raise RuntimeError("could not bind an HTTP port in 4400-4499")
        self.http.daemon_threads = True
        self.http_thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.http_thread.start()

    def start(self) -> "Receiver":
        """Serve; called again after ``stop()``, comes back on the same ports."""
        self.closing = False
        self._start_grpc()
        self._start_http()
        self.started += 1
        return self

    @property
    def grpc_url(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def url(self, protocol: str) -> str:
        return self.grpc_url if protocol == "grpc" else self.http_url

    def stop(self, grace: float = 5.0) -> None:
        """Go down: answer the exports in flight (within ``grace`` seconds), refuse the rest, close
        every connection.  An export is either decoded and answered, or refused and not decoded."""
        self.grpc.stop(grace).wait(grace + 1)
        end = time.monotonic() + grace
        with self.cv:
            self.closing = True
            while self.inflight and time.monotonic() < end:
                self.cv.wait(0.05)
            conns = list(self.conns)
        self.http.shutdown()
        self.http.server_close()
        for c in conns:  # kept-alive connections would otherwise go on being served
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *a):
        self.stop()
