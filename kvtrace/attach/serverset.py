"""The servers one capture traces: one, or several on this host (a fleet's replicas behind a
router, a prefill/decode pair).  Each has its own streams, hook and restart watch; the
``servers`` table joins any row's pid to its server (its port), and the stream tables carry
the port themselves."""
from __future__ import annotations

import time

import pyarrow as pa

from kvtrace.dataset import schema


def table(servers: list, ts_ns: int | None = None) -> pa.Table:
    """One row per process of each server: the join from a pid to its server."""
    ts = time.monotonic_ns() if ts_ns is None else ts_ns
    rows = []
    for s in servers:
        roles = [(p, "api") for p in s.api_pids] + [(p, "engine") for p in s.engine_pids] + \
                [(p, "worker") for p in s.worker_pids] + [(p, "other") for p in s.other_pids]
        for pid, role in roles:
            rows.append({"ts_ns": ts, "server": s.port or 0, "kind": s.kind, "version": s.version, "pid": pid,
                         "role": role, "api_pid": s.pid})
    return pa.Table.from_pylist(rows, schema=schema.TABLES["servers"])


def stated(servers: list) -> tuple[str | None, str | None]:
    """The (kind, version) the run row states: the servers', or None where they differ."""
    kinds = {s.kind for s in servers}
    versions = {s.version for s in servers}
    return (kinds.pop() if len(kinds) == 1 else None), (versions.pop() if len(versions) == 1 else None)


class Tagged:
    """A stream sidecar whose rows say which server they came from (a ``server`` column)."""

    def __init__(self, inner, port: int | None):
        self.inner, self.port = inner, port or 0
        self.name = getattr(inner, "name", type(inner).__name__)

    def drain(self) -> dict:
        out = {}
        for name, t in self.inner.drain().items():
            if "server" not in t.column_names:
                t = t.append_column("server", pa.array([self.port] * t.num_rows, pa.uint32()))
            out[name] = t
        return out

    def stats(self) -> dict:
        return {**self.inner.stats(), "server": self.port}

    def __getattr__(self, attr):   # lost(), close(), sampling() ... as the stream has them
        return getattr(self.inner, attr)


class Watches:
    """The restart watches of several servers as one (None for a server with no port to watch):
    the capture stops once every watched server has exited (--on-restart exit); a followed
    server never ends it."""

    def __init__(self, watches: list):
        self.watches = watches
        self.ended: dict[int, str] = {}

    def injections(self) -> list:
        """Each server's latest re-injection (None: not restarted, or no watch)."""
        return [w.injection if w is not None else None for w in self.watches]

    def poll(self) -> str | None:
        live = [i for i, w in enumerate(self.watches) if w is not None]
        for i in live:
            if i not in self.ended:
                why = self.watches[i].poll()
                if why:
                    self.ended[i] = why
        if len(self.ended) == len(live):
            reasons = list(dict.fromkeys(self.ended.values()))
            return reasons[0] if len(live) == 1 else f"every traced server exited ({', '.join(reasons)})"
        return None
