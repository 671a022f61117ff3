"""ServerKind: the descriptor of one kind of server (vLLM, SGLang).  Everything kvtrace does
differently for a kind is read from its descriptor (kvtrace.servers.registry), never from a
comparison of its name."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ServerKind:
    name: str                 # the kind as the dataset and ServerInfo.kind name it ("vllm")
    title: str                # as people write it ("vLLM")
    package: str              # the Python package whose version is the server's version
    recognise: Callable       # recognise(argv) -> "module" / "cli" when argv starts this kind's server, else None
    describe: Callable        # describe(psutil.Process) -> ServerInfo of this kind, or None
    default_port: int         # its HTTP port when none is given
    plugin_group: str         # the entry-point group kvtrace's in-engine plugin is declared in
    plugins_env: str          # the variable that filters that group's plugins (VLLM_PLUGINS)
    hook_module: str          # the module injection imports and calls install()/uninstall() on
    hooked: str               # the processes the hook goes into, for messages ("EngineCore or Worker")
    roles: dict = field(default_factory=dict)   # ServerInfo pid list -> the hook's role in those processes
    support: str = ""         # "module:function" of the hook's support check on the kind's source tree
    metrics_prefix: str = ""  # its Prometheus series' prefix ("vllm:")
    cache_model: str = ""     # its cache in kvtrace.analysis.whatif's models ("block_pool", "radix")

    def support_check(self) -> Callable:
        """The support check: check(root) -> verdict (kvtrace.hook.support's form)."""
        module, _, fn = self.support.partition(":")
        return getattr(importlib.import_module(module), fn)

    def hook_pids(self, info) -> list[tuple[int, str]]:
        """(pid, role) of every process of ``info`` the hook goes into, engine side first."""
        return [(p, role) for attr, role in self.roles.items() for p in getattr(info, attr)]
