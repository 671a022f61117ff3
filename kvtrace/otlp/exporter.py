"""OTLP export on its own thread: a bounded queue of encoded spans, batches, gRPC or HTTP/protobuf.

Never blocks the caller: ``submit`` appends to the queue or, when it is full (by span count or
bytes), drops and counts.  The sender thread takes up to ``batch_size`` spans (or what is there
after ``delay`` seconds), sends one ExportTraceServiceRequest with a timeout, retries a
retryable failure (gRPC UNAVAILABLE/RESOURCE_EXHAUSTED/DEADLINE_EXCEEDED, HTTP 429/502/503/504)
at most twice with a short backoff, then drops the batch and counts its spans as failed.  After a
failure it waits (exponential, up to 5 s) before the next attempt, so an endpoint that is down,
slow or refusing costs a bounded queue and counters, never capture.  gRPC's own reconnect backoff
is capped the same way, so export resumes within seconds of an endpoint coming back.

Every span submitted ends up in exactly one counter: sent, dropped (queue full, failed, rejected,
at shutdown), or still queued / in flight while running.
"""
from __future__ import annotations

import collections
import http.client
import ipaddress
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from kvtrace.errors import UsageError
from kvtrace.otlp import encode

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
RETRYABLE_HTTP = {429, 502, 503, 504}


@dataclass
class Stats:
    submitted: int = 0
    sent: int = 0
    dropped_queue_full: int = 0
    failed: int = 0
    rejected: int = 0           # spans the receiver reported rejected (partial success)
    dropped_at_shutdown: int = 0
    batches: int = 0
    batch_failures: int = 0
    metrics_sent: int = 0
    metrics_failed: int = 0
    last_error: str = ""
    queue_high_water: int = 0          # spans
    queue_bytes_high_water: int = 0    # bytes of encoded spans
    extra: dict = field(default_factory=dict)

    def dropped(self) -> int:
        return self.dropped_queue_full + self.failed + self.rejected + self.dropped_at_shutdown

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        d["dropped"] = self.dropped()
        return d


class SendError(Exception):
    def __init__(self, msg: str, retryable: bool):
        super().__init__(msg)
        self.retryable = retryable


_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?")
_EXAMPLE = "give e.g. http://localhost:4317 (gRPC) or http://localhost:4318 (HTTP)"


def _split_url(url: str) -> tuple[urllib.parse.SplitResult, int | None]:
    """The URL's parts and its port (None when it names none); UsageError when it is no
    http(s)://host[:port] URL.  Nothing is looked up: a bad URL fails here, not at the first send."""
    raw = url.strip()
    try:
        u = urllib.parse.urlsplit(raw)
    except ValueError:  # a bracketed host that is no IPv6 address, an unclosed bracket
        raise UsageError(f"--otlp {url!r} is not an http(s)://host:port URL (bad [address]): {_EXAMPLE}") from None
    if u.scheme not in ("http", "https") or not raw.lower().startswith(u.scheme + "://") or not u.hostname:
        raise UsageError(f"--otlp {url!r} is not an http(s)://host:port URL: {_EXAMPLE}")
    if u.username is not None or u.password is not None:
        raise UsageError(f"--otlp {url!r}: credentials in the URL are not sent; give http(s)://host:port")
    host = u.hostname
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"--otlp {url!r} has a bad IPv6 address {host!r}: {_EXAMPLE}") from None
    elif not _HOST.fullmatch(host):
        raise UsageError(f"--otlp {url!r} has a bad host name {host!r}: {_EXAMPLE}")
    try:
        port = u.port
    except ValueError:
        port = 0
    if port == 0:
        raise UsageError(f"--otlp {url!r} has a bad port: give a number from 1 to 65535")
    return u, port


def parse_endpoint(url: str, protocol: str) -> dict:
    """What to connect to, from --otlp URL (http://host:4317 for gRPC, http://host:4318 for HTTP).
    Both commands check it before anything else (`attach --otlp`, `export --otlp`)."""
    if protocol not in ("grpc", "http"):
        raise UsageError(f"--otlp-protocol must be grpc or http, not {protocol!r}")
    u, port = _split_url(url)
    port = port or (4317 if protocol == "grpc" else (443 if u.scheme == "https" else 4318))
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    if protocol == "grpc":
        return {"protocol": "grpc", "target": f"{host}:{port}", "secure": u.scheme == "https"}
    path = u.path.rstrip("/")
    for suffix in ("/v1/traces", "/v1/metrics"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return {"protocol": "http", "scheme": u.scheme, "host": u.hostname, "port": port,
            "traces": path + "/v1/traces", "metrics": path + "/v1/metrics"}


class _Grpc:
    def __init__(self, ep: dict, timeout: float, max_backoff: float = 5.0):
        try:
            import grpc
        except ImportError:
            raise UsageError("--otlp-protocol grpc needs the grpcio package (pip install grpcio)") from None
        self.grpc = grpc
        # gRPC reconnects a failed channel with its own backoff (up to 120 s by default): capped
        # like the exporter's, or export would resume up to two minutes after the endpoint is back
        cap = max(100, int(max_backoff * 1000))
        opts = [("grpc.enable_retries", 0), ("grpc.max_send_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", min(1000, cap)), ("grpc.max_reconnect_backoff_ms", cap)]
        if ep["secure"]:
            self.channel = grpc.secure_channel(ep["target"], grpc.ssl_channel_credentials(), options=opts)
        else:
            self.channel = grpc.insecure_channel(ep["target"], options=opts)
        # raw bytes in and out: the request is already encoded
        self.traces = self.channel.unary_unary(TRACE_METHOD)
        self.metrics = self.channel.unary_unary(METRICS_METHOD)
        self.timeout = timeout

    def send(self, kind: str, body: bytes) -> bytes:
        fn = self.traces if kind == "traces" else self.metrics
        try:
            return fn(body, timeout=self.timeout)
        except self.grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            retry = code in (self.grpc.StatusCode.UNAVAILABLE, self.grpc.StatusCode.RESOURCE_EXHAUSTED,
                             self.grpc.StatusCode.DEADLINE_EXCEEDED, self.grpc.StatusCode.ABORTED)
            name = code.name if code is not None else "error"
            detail = e.details() if hasattr(e, "details") else str(e)
            raise SendError(f"gRPC {name}: {detail}", retry) from None

    def close(self) -> None:
        self.channel.close()


class _Http:
    def __init__(self, ep: dict, timeout: float):
        self.ep = ep
        self.timeout = timeout
        self.conn = None

    def _connect(self):
        cls = http.client.HTTPSConnection if self.ep["scheme"] == "https" else http.client.HTTPConnection
        return cls(self.ep["host"], self.ep["port"], timeout=self.timeout)

    def send(self, kind: str, body: bytes) -> bytes:
        path = self.ep[kind]
        for attempt in (0, 1):  # one reconnect if a kept-alive connection was closed by the server
            if self.conn is None:
                self.conn = self._connect()
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/x-protobuf"})
                r = self.conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as e:
                self.conn.close()
                self.conn = None
                if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    continue
                raise SendError(f"HTTP {type(e).__name__}: {e}", True) from None
            if r.status == 200:
                return data
            if r.getheader("Connection", "").lower() == "close":
                self.conn.close()
                self.conn = None
            raise SendError(f"HTTP {r.status} {r.reason}", r.status in RETRYABLE_HTTP)
        raise SendError("HTTP: connection closed", True)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def _rejected(kind: str, body: bytes) -> int:
    """Rejected items of an Export*ServiceResponse's partial_success (0 when absent)."""
    if not body:
        return 0
    try:
        if kind == "traces":
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as s

            return s.ExportTraceServiceResponse.FromString(body).partial_success.rejected_spans
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as s

        return s.ExportMetricsServiceResponse.FromString(body).partial_success.rejected_data_points
    except Exception:
        return 0


class Exporter:
    def __init__(self, url: str, protocol: str = "grpc", resource_attrs: tuple = (), *, max_queue: int = 8192,
                 max_queue_bytes: int = 32 << 20, batch_size: int = 512, delay: float = 0.5, timeout: float = 5.0,
                 max_backoff: float = 5.0):
        self.ep = parse_endpoint(url, protocol)
        self.url = url
        self.protocol = protocol
        self.resource = tuple(resource_attrs)
        self.max_queue, self.max_queue_bytes = max_queue, max_queue_bytes
        self.batch_size, self.delay, self.timeout = batch_size, delay, timeout
        self.max_backoff = max_backoff
        self.client = _Grpc(self.ep, timeout, max_backoff) if protocol == "grpc" else _Http(self.ep, timeout)
        self.q: collections.deque = collections.deque()
        self.q_bytes = 0
        self.metrics_pending: bytes | None = None
        self.stats = Stats()
        self.cv = threading.Condition()
        self.stopping = False
        self.busy = False
        self.in_flight = 0      # spans taken from the queue, not yet counted sent or dropped
        self.abandoned = False  # close() gave up waiting for the sender: it counts nothing more
        self.backoff_until = 0.0
        self.backoff = 0.0
        self.thread = threading.Thread(target=self._run, name="kvtrace-otlp", daemon=True)
        self.thread.start()

    # -- producer side (never blocks) ---------------------------------------------------------------

    def submit(self, spans: list[bytes]) -> int:
        """Queue encoded spans; returns how many were dropped because the queue was full."""
        dropped = 0
        with self.cv:
            for s in spans:
                if len(self.q) >= self.max_queue or self.q_bytes + len(s) > self.max_queue_bytes:
                    dropped += 1
                    continue
                self.q.append(s)
                self.q_bytes += len(s)
            self.stats.submitted += len(spans)
            self.stats.dropped_queue_full += dropped
            self.stats.queue_high_water = max(self.stats.queue_high_water, len(self.q))
            self.stats.queue_bytes_high_water = max(self.stats.queue_bytes_high_water, self.q_bytes)
            if len(self.q) >= self.batch_size or self.metrics_pending is not None:
                self.cv.notify()
        return dropped

    def queued(self) -> tuple[int, int]:
        """(spans, bytes) waiting in the queue now; bounded by max_queue and max_queue_bytes."""
        with self.cv:
            return len(self.q), self.q_bytes

    def submit_metrics(self, body: bytes) -> None:
        """Cumulative metrics: only the latest pending export matters (it replaces an unsent one)."""
        with self.cv:
            self.metrics_pending = body
            self.cv.notify()

    # -- sender thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cv:
                deadline = time.monotonic() + self.delay
                while not self.stopping and len(self.q) < self.batch_size and self.metrics_pending is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cv.wait(left)
                if self.stopping and not self.q and self.metrics_pending is None:
                    return
                wait = self.backoff_until - time.monotonic()
            if wait > 0:  # backing off after a failure: the queue fills and drops meanwhile
                with self.cv:
                    self.cv.wait(wait)
                continue
            with self.cv:
                batch = [self.q.popleft() for _ in range(min(self.batch_size, len(self.q)))]
                self.q_bytes -= sum(len(s) for s in batch)
                metrics, self.metrics_pending = self.metrics_pending, None
                self.busy = True
                self.in_flight = len(batch)
            try:
                if batch:
                    self._send_batch(batch)
                if metrics is not None:
                    self._send_metrics(metrics)
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()

    def _send(self, kind: str, body: bytes) -> bytes:
        tries = 0
        while True:
            try:
                out = self.client.send(kind, body)
                self.backoff = 0.0
                return out
            except SendError as e:
                self.stats.last_error = str(e)[:300]
                tries += 1
                if not e.retryable or tries > 2 or self.stopping:
                    self.backoff = min(max(self.backoff * 2, 0.2), self.max_backoff)
                    self.backoff_until = time.monotonic() + self.backoff
                    raise
                time.sleep(0.05 * tries)

    def _send_batch(self, batch: list[bytes]) -> None:
        body = encode.trace_request(self.resource, batch)
        try:
            resp = self._send("traces", body)
        except SendError:
            with self.cv:
                if not self.abandoned:
                    self.stats.failed += len(batch)
                    self.stats.batch_failures += 1
                    self.in_flight = 0
            return
        rej = _rejected("traces", resp)
        with self.cv:
            if not self.abandoned:
                self.stats.rejected += rej
                self.stats.sent += len(batch) - rej
                self.stats.batches += 1
                self.in_flight = 0

    def _send_metrics(self, body: bytes) -> None:
        try:
            self._send("metrics", body)
            self.stats.metrics_sent += 1
        except SendError:
            self.stats.metrics_failed += 1

    # -- shutdown -------------------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued was sent (or failed); False on timeout."""
        end = time.monotonic() + timeout
        with self.cv:
            self.cv.notify_all()
            while self.q or self.metrics_pending is not None or self.busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(min(left, 0.1))
                self.cv.notify_all()
        return True

    def close(self, timeout: float = 10.0) -> Stats:
        """Send what is queued within ``timeout``, drop and count the rest, stop the thread."""
        self.flush(timeout)
        with self.cv:
            self.stopping = True
            self.stats.dropped_at_shutdown += len(self.q)
            self.q.clear()
            self.q_bytes = 0
            if self.metrics_pending is not None:
                self.stats.metrics_failed += 1
                self.metrics_pending = None
            self.cv.notify_all()
        self.thread.join(self.timeout * 3 + 1)
        with self.cv:
            if self.thread.is_alive() and self.in_flight:  # its fate is unknown: counted, never twice
                self.abandoned = True
                self.stats.dropped_at_shutdown += self.in_flight
                self.in_flight = 0
        self.client.close()
        return self.stats

    def describe(self) -> str:
        s = self.stats
        line = (f"otlp {self.protocol} {self.url}: {s.sent} spans sent in {s.batches} batches, "
                f"{s.dropped()} dropped ({s.dropped_queue_full} queue full, {s.failed} failed, "
                f"{s.rejected} rejected, {s.dropped_at_shutdown} at shutdown); metrics {s.metrics_sent} sent, "
                f"{s.metrics_failed} failed")
        if s.last_error and (s.failed or s.metrics_failed):
            line += f"; last error: {s.last_error}"
        return line
