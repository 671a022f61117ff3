"""vLLM: its API server with EngineCore and Worker processes below it (kvtrace.servers.vllm.discover),
the hook kvtrace.hook.vllm.hook in both, a block-pool cache."""
from __future__ import annotations

from kvtrace.servers.kind import ServerKind
from kvtrace.servers.vllm import discover

KIND = ServerKind(
    name="vllm", title="vLLM", package="vllm",
    recognise=discover.server_kind, describe=discover.describe,
    default_port=discover.DEFAULT_PORT, plugin_group=discover.PLUGIN_GROUP, plugins_env=discover.PLUGINS_ENV,
    hook_module="kvtrace.hook.vllm.hook", hooked="EngineCore or Worker",
    roles={"engine_pids": "engine", "worker_pids": "worker"},
    support="kvtrace.hook.vllm.support:check", metrics_prefix="vllm:", cache_model="block_pool",
)
