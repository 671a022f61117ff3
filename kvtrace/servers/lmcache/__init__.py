"""LMCache in multiprocess mode: its cache server (``python -m lmcache.v1.multiprocess.server``),
which vLLM's LMCacheMPConnector reaches at ``lmcache.mp.host`` / ``lmcache.mp.port``, with its L1 in
memory and L2 adapters (``--l2-adapter '{"type": "fs", "base_path": DIR}'``) below, its own
counters (``lmcache_mp_*``) at ``--prometheus-port``."""
from __future__ import annotations

import json
import os
from urllib.parse import urlsplit

from kvtrace.servers.procfs import _arg
from kvtrace.servers.tier import TierKind

MODULE = "lmcache.v1.multiprocess.server"
DEFAULT_HOST, DEFAULT_PORT = "tcp://localhost", 5555   # LMCacheMPConnector's and the server's defaults


def endpoint(extra: dict) -> tuple[str, int]:
    """Where LMCacheMPConnector connects: its extra config's lmcache.mp.host / lmcache.mp.port."""
    host = str(extra.get("lmcache.mp.host", DEFAULT_HOST))
    return urlsplit(host).hostname or host, int(extra.get("lmcache.mp.port", DEFAULT_PORT))


def recognise(argv: list[str]) -> int | None:
    """The port of an LMCache multiprocess server started as ``python -m lmcache.v1.multiprocess.server``
    (or that file run as a script); None for any other process."""
    script = MODULE.replace(".", "/") + ".py"
    starts = any(a == MODULE or a.endswith(script) for a in argv[1:4])
    if not starts or not argv or "python" not in os.path.basename(argv[0]):
        return None
    try:
        return int(_arg(argv, "--port") or DEFAULT_PORT)
    except ValueError:
        return None


def storage(argv: list[str]) -> list[str]:
    """Its L2 adapters from ``--l2-adapter`` JSON options: "fs:<base_path>" or "<type>"."""
    out = []
    for i, a in enumerate(argv):
        key, eq, v = a.partition("=")
        if key.replace("_", "-") != "--l2-adapter":
            continue
        raw = v if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            cfg = json.loads(raw)
        except ValueError:
            continue
        if isinstance(cfg, dict):
            kind = str(cfg.get("type", "?"))
            out.append(f"{kind}:{cfg['base_path']}" if "base_path" in cfg else kind)
    return out


def chunk_size(argv: list[str]) -> int:
    """Tokens per chunk (--chunk-size, 256 by default): LMCache stores whole chunks only."""
    try:
        return int(_arg(argv, "--chunk-size") or 256)
    except ValueError:
        return 256


def l1_bytes(argv: list[str]) -> int:
    """Its L1's size in bytes (--l1-size-gb, GiB as LMCache reads it); 0 when not given."""
    try:
        gb = float(_arg(argv, "--l1-size-gb") or 0)
    except ValueError:
        return 0
    return int(gb * (1 << 30)) if gb > 0 and gb != float("inf") else 0


def metrics(argv: list[str]) -> str | None:
    """Its Prometheus endpoint (pull mode, on every interface at --prometheus-port, 9090 by
    default); None when its metrics are off or pushed over OTLP instead."""
    if any(a.split("=", 1)[0] in ("--disable-metrics", "--disable-observability", "--otlp-endpoint") for a in argv):
        return None
    try:
        return f"http://127.0.0.1:{int(_arg(argv, '--prometheus-port') or 9090)}/metrics"
    except ValueError:
        return None


TIER = TierKind(name="lmcache", title="LMCache", package="lmcache", connectors=("LMCacheMPConnector",),
                endpoint=endpoint, recognise=recognise, storage=storage, chunk_size=chunk_size, metrics=metrics, metrics_prefix="lmcache_",
                hook_module="kvtrace.hook.lmcache.hook", memory=l1_bytes)
