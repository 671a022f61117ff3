"""TierKind: the descriptor of one kind of KV tier that runs as a server process of its own
(LMCache's multiprocess server), which a serving engine reaches through a KV connector.  A
vLLM server's kv-transfer config names the connector and where its tier listens
(kvtrace.servers.tiers follows it); everything kvtrace does for a tier kind is read from here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TierKind:
    name: str                  # as the dataset names it ("lmcache")
    title: str                 # as people write it ("LMCache")
    package: str               # the Python package whose version is the tier server's version
    connectors: tuple          # vLLM connector class names that talk to this tier's server
    endpoint: Callable         # endpoint(connector's extra config: dict) -> (host, port) it connects to
    recognise: Callable        # recognise(argv) -> the port the server listens on, or None: not this kind
    storage: Callable          # storage(argv) -> ["fs:/dir", ...]: what its lower tiers are, from its options
    chunk_size: Callable       # chunk_size(argv) -> tokens per stored chunk (its unit of storage)
    metrics: Callable          # metrics(argv) -> the URL of its Prometheus metrics inside its network namespace, or None
    metrics_prefix: str        # its series' prefix ("lmcache_")
    hook_module: str = ""      # the hook injected into its server (install()/uninstall()), if any
    memory: Callable = lambda argv: 0   # memory(argv) -> bytes of its in-memory tier (L1), 0: not known


@dataclass
class TierInfo:
    """One tier server process found for a traced engine."""

    kind: str                  # TierKind.name
    pid: int                   # the server process
    pids: list[int]            # it and its children: what kvtrace traces
    host: str                  # as the connector's config gives it
    port: int
    connector: str             # the engine's connector that reaches it
    version: str | None
    storage: list[str]
    chunk_tokens: int          # tokens per chunk it stores (a partial chunk is never stored)
    same_netns: bool           # in the engine's network namespace (else: found by its port elsewhere)
    metrics_url: str | None = None   # its own metrics (scraped into tier_metrics), inside its network namespace
    memory_bytes: int = 0      # its in-memory tier's size (LMCache's L1), 0: not known
