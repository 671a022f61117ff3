"""Scrape a server's Prometheus ``/metrics`` into the ``server_metrics`` table.

``parse()`` reads the Prometheus text exposition format (0.0.4; OpenMetrics' ``# EOF`` and
exemplars are tolerated) and never raises: a line it cannot read is counted and skipped.
``MetricsScraper`` polls one URL at a fixed interval on its own thread and keeps the samples
whose names start with the given prefixes (the server kind's ``metrics_prefix``, e.g.
``vllm:``; ``*_created`` timestamps dropped by default) as rows of (ts_ns, kind, name, labels
JSON, value, type).
"""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from kvtrace.dataset import schema
from kvtrace.host import netns as netns_mod

TABLE = "server_metrics"
# ts_ns: CLOCK_MONOTONIC when the scrape's response was complete; kind: the server kind
# (kvtrace.servers.registry name; null: not known); labels: JSON object, keys sorted; type:
# counter / gauge / histogram / summary / info / untyped (from # TYPE).
# the stream's own columns: `server` (the port) is added by the capture that knows it (kvtrace.attach.serverset)
SCHEMA = schema.TABLES[TABLE].remove(schema.TABLES[TABLE].get_field_index("server"))
DEFAULT_DROP_SUFFIXES = ("_created",)
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info", "_gcount", "_gsum")
_NAME0 = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_NAME = _NAME0 | frozenset("0123456789")
_LABEL0 = _NAME0 - {":"}
_LABEL = _NAME - {":"}
_ESC = {"n": "\n", "\\": "\\", '"': '"'}
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped", "info", "stateset", "gaugehistogram", "unknown"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int | None = None


@dataclass
class Parsed:
    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)
    errors: int = 0  # lines that could not be read (skipped)

    def type_of(self, name: str) -> str:
        t = self.types.get(name)
        if t:
            return t
        for suf in _SUFFIXES:
            if name.endswith(suf):
                t = self.types.get(name[: -len(suf)])
                if t:
                    return t
        return "untyped"

    def value(self, name: str, **labels) -> float | None:
        """The value of the first sample with this name whose labels include these."""
        for s in self.samples:
            if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items()):
                return s.value
        return None


def _parse_value(tok: str) -> float | None:
    if not tok or "_" in tok:
        return None
    try:
        return float(tok)
    except ValueError:
        return None


def _parse_sample(line: str) -> Sample | None:
    n = len(line)
    i = 0
    while i < n and line[i] in " \t":
        i += 1
    if i >= n or line[i] not in _NAME0:
        return None
    j = i + 1
    while j < n and line[j] in _NAME:
        j += 1
    name = line[i:j]
    labels: list[tuple[str, str]] = []
    i = j
    if i < n and line[i] == "{":
        i += 1
        while True:
            while i < n and line[i] in " \t":
                i += 1
            if i < n and line[i] == "}":
                i += 1
                break
            if i >= n or line[i] not in _LABEL0:
                return None
            j = i + 1
            while j < n and line[j] in _LABEL:
                j += 1
            key = line[i:j]
            i = j
            while i < n and line[i] in " \t":
                i += 1
            if i >= n or line[i] != "=":
                return None
            i += 1
            while i < n and line[i] in " \t":
                i += 1
            if i >= n or line[i] != '"':
                return None
            i += 1
            buf = []
            while True:
                if i >= n:
                    return None
                ch = line[i]
                if ch == "\\":
                    if i + 1 >= n:
                        return None
                    buf.append(_ESC.get(line[i + 1], "\\" + line[i + 1]))
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    buf.append(ch)
                    i += 1
            labels.append((key, "".join(buf)))
            while i < n and line[i] in " \t":
                i += 1
            if i < n and line[i] == ",":
                i += 1
            elif i < n and line[i] == "}":
                i += 1
                break
            else:
                return None
    rest = line[i:]
    if rest and rest[0] not in " \t":
        return None
    rest, _, _exemplar = rest.partition(" # ")
    toks = rest.split()
    if not toks or len(toks) > 2:
        return None
    value = _parse_value(toks[0])
    if value is None:
        return None
    ts = None
    if len(toks) == 2:
        try:
            ts = int(float(toks[1]) if "." in toks[1] else int(toks[1]))
        except (ValueError, OverflowError):
            return None
    if len({k for k, _ in labels}) != len(labels):
        return None
    return Sample(name, tuple(labels), value, ts)


def parse(text) -> Parsed:
    """Parse exposition text (str or bytes).  Never raises; unreadable lines are counted."""
    out = Parsed()
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        out.errors += 1
        return out
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                t = parts[3].strip().lower()
                if t in _TYPES:
                    out.types[parts[2]] = t
                else:
                    out.errors += 1
            continue
        try:
            s = _parse_sample(line)
        except Exception:  # defensive: the parser must never take the scraper down
            s = None
        if s is None:
            out.errors += 1
        else:
            out.samples.append(s)
    return out


def labels_json(labels: tuple[tuple[str, str], ...]) -> str:
    return json.dumps(dict(sorted(labels)), separators=(",", ":"), ensure_ascii=False)


def rows(parsed: Parsed, ts_ns: int, kind: str | None = None, prefixes=(),
         drop_suffixes=DEFAULT_DROP_SUFFIXES) -> dict[str, list]:
    """The samples whose names start with one of ``prefixes`` (empty: every sample) as columns,
    each of ``kind``."""
    cols = {c: [] for c in SCHEMA.names}
    for s in parsed.samples:
        if prefixes and not s.name.startswith(tuple(prefixes)):
            continue
        if drop_suffixes and s.name.endswith(tuple(drop_suffixes)):
            continue
        cols["ts_ns"].append(ts_ns)
        cols["kind"].append(kind)
        cols["name"].append(s.name)
        cols["labels"].append(labels_json(s.labels))
        cols["value"].append(s.value)
        cols["type"].append(parsed.type_of(s.name))
    return cols


def to_table(cols: dict[str, list]) -> pa.Table:
    return pa.table({c: pa.array(cols[c], SCHEMA.field(c).type) for c in SCHEMA.names}, schema=SCHEMA)


STAT_KEYS = ("scrapes", "scrape_errors", "parse_errors", "rows", "queue_drops", "internal_errors")


class MetricsScraper:
    """A sidecar source polling ``url`` every ``interval`` seconds: ``start()``, ``drain()``,
    ``stats()``, ``stop()`` (which takes one last scrape so the end state is recorded)."""

    name = TABLE

    def __init__(self, url: str, interval: float = 10.0, timeout: float = 5.0, kind: str | None = None,
                 prefixes=(), drop_suffixes=DEFAULT_DROP_SUFFIXES, queue_scrapes: int = 3600,
                 max_bytes: int = 32 << 20, netns: str | None = None, table: str = TABLE):
        """``kind``: the server kind the samples are of (their ``kind`` column; None: not known);
        ``prefixes``: the names of the samples kept (the kind's ``metrics_prefix``; empty: all);
        ``table``: the table they go to (a KV tier server's: tier_metrics)."""
        self.name = table
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.url = url
        self.kind = kind
        self.netns = netns  # /proc/PID/ns/net: scrape from inside the server's network namespace
        self.interval = interval
        self.timeout = timeout
        self.prefixes = tuple(prefixes or ())
        self.drop_suffixes = tuple(drop_suffixes or ())
        self.max_bytes = max_bytes
        self._q: queue.Queue[dict] = queue.Queue(maxsize=queue_scrapes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.c = Counter({k: 0 for k in STAT_KEYS})
        self.last_error: str | None = None
        self.last: Parsed | None = None

    def scrape_once(self) -> str | None:
        """One scrape into the queue; the error as a short string, or None."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                body = r.read(self.max_bytes + 1)
            ts = time.monotonic_ns()
        except urllib.error.HTTPError as e:
            return self._failed(f"HTTP {e.code}")
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            return self._failed(str(getattr(reason, "strerror", None) or reason))
        if len(body) > self.max_bytes:
            return self._failed(f"response larger than {self.max_bytes} bytes")
        parsed = parse(body)
        cols = rows(parsed, ts, self.kind, self.prefixes, self.drop_suffixes)
        with self._lock:
            self.c["scrapes"] += 1
            self.c["parse_errors"] += parsed.errors
            self.c["rows"] += len(cols["ts_ns"])
            self.last = parsed
        try:
            self._q.put_nowait(cols)
        except queue.Full:
            self.c["queue_drops"] += 1
        return None

    def _failed(self, why: str) -> str:
        with self._lock:
            self.c["scrape_errors"] += 1
            self.last_error = why
        return why

    def start(self) -> list[str]:
        """One scrape now (so an unreachable URL is reported at once), then the thread."""
        warnings = []
        try:
            why = netns_mod.call(self.netns, self.scrape_once, timeout=self.timeout + 5)
        except OSError as e:
            why = self._failed(str(e))
        if why:
            warnings.append(f"metrics {self.url} unreachable ({why}); will keep retrying")
        self._thread = threading.Thread(target=self._run, name="kvtrace-metrics", daemon=True)
        self._thread.start()
        return warnings

    def _run(self) -> None:
        if self.netns:
            try:
                netns_mod.enter(self.netns)
            except OSError as e:
                self._failed(str(e))
                return
        nxt = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, nxt - time.monotonic())):
            try:
                self.scrape_once()
            except Exception:
                self.c["internal_errors"] += 1
            nxt += self.interval
            if nxt < time.monotonic():  # fell behind (slow server): skip, do not burst
                nxt = time.monotonic() + self.interval

    def stop(self, final_scrape: bool = True, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
            if final_scrape:
                try:
                    netns_mod.call(self.netns, self.scrape_once, timeout=self.timeout + 5)
                except OSError as e:
                    self._failed(str(e))

    close = stop

    def drain(self) -> dict[str, pa.Table]:
        cols = {c: [] for c in SCHEMA.names}
        while True:
            try:
                chunk = self._q.get_nowait()
            except queue.Empty:
                break
            for c in cols:
                cols[c].extend(chunk[c])
        return {self.name: to_table(cols)} if cols["ts_ns"] else {}

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.c)
            out["url"] = self.url
            out["kind"] = self.kind
            out["interval_s"] = self.interval
            out["last_error"] = self.last_error
        return out

    def lost(self) -> int:
        """Scrapes that produced no rows (failed or dropped)."""
        return self.c["scrape_errors"] + self.c["queue_drops"]
