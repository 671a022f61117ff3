"""What discovery reports about one server, whatever its kind."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class KvEventsInfo:
    """The KV-events publisher as configured on the API server's command line."""

    enabled: bool
    publisher: str | None
    endpoint: str | None  # as vLLM was given it (bind if it has '*'/'::' or is ipc)
    replay_endpoint: str | None
    topic: str = ""
    dp_size: int = 1
    raw: dict = field(default_factory=dict)
    bind: bool | None = None  # SGLang's "bind": the publisher binds (True) or connects (False) its endpoint


@dataclass
class ServerInfo:
    """One server that discovery found, of any kind (kvtrace.servers.registry): its processes,
    where it listens, its Python environment and its engine's version."""

    pid: int  # the API server (front end) that was started
    api_pids: list[int]  # pid plus its API-server children (vLLM's api-server-count > 1)
    engine_pids: list[int]  # where the engine-side hook goes (vLLM's EngineCore, SGLang's scheduler)
    worker_pids: list[int]  # model workers with a hook of their own (vLLM's Worker)
    other_pids: list[int]  # DP coordinator and other titled helpers
    host: str | None
    port: int | None
    model: str | None
    python_exe: str | None
    python_version: str | None
    version: str | None  # the version of the server kind's package (vllm, sglang)
    site_packages: str | None
    plugin: str  # "installed", "disabled" (VLLM_PLUGINS excludes it), "absent", "unknown"
    kv_events: KvEventsInfo | None
    in_container: bool
    cmdline: list[str]
    kind: str  # the server kind's name in kvtrace.servers.registry ("vllm", "sglang")
    netns: str | None = None  # /proc/PID/ns/net when the server is in another network namespace
    netns_id: str | None = None  # net:[inode] of the server's network namespace

    @property
    def pids(self) -> list[int]:
        """Every process to trace: API server(s), EngineCore(s), Workers."""
        return [*self.api_pids, *self.engine_pids, *self.worker_pids]

    @property
    def metrics_url(self) -> str | None:
        if self.port is None:
            return None
        host = self.host if self.host and self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def to_json(self) -> dict:
        d = asdict(self)
        d["metrics_url"] = self.metrics_url
        if self.kv_events is not None:
            d["kv_events"].pop("raw", None)
        return d
