"""SGLang: its launcher (HTTP server) with the scheduler below it (kvtrace.servers.sglang.discover),
the hook kvtrace.hook.sglang.hook in the scheduler, a radix-tree cache."""
from __future__ import annotations

from kvtrace.servers.kind import ServerKind
from kvtrace.servers.sglang import discover

KIND = ServerKind(
    name="sglang", title="SGLang", package="sglang",
    recognise=discover.server_kind, describe=discover.describe,
    default_port=discover.DEFAULT_PORT, plugin_group=discover.PLUGIN_GROUP, plugins_env=discover.PLUGINS_ENV,
    hook_module="kvtrace.hook.sglang.hook", hooked="scheduler",
    roles={"engine_pids": "engine"},
    support="kvtrace.hook.sglang.support:check", metrics_prefix="sglang:", cache_model="radix",
)
