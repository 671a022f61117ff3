"""Inject the hook into one vLLM server's EngineCore and Worker processes for the length of
a capture, and take it out again at the end.

Only processes discovery identified as the EngineCore or a Worker of a vLLM API server are
ever touched, and only when the server's vLLM passes the hook's checks, read from its files
beforehand (kvtrace.servers.hooksupport, handed in as ``checked``): a vLLM that differs is refused in one line naming the
first difference, and nothing is injected.  A process where injection fails is reported with
the reason.  Either way the rest of the capture goes on without the hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from kvtrace.errors import KvtraceError, TargetError
from kvtrace.hook import support
from kvtrace.host.confined import UnsafePath
from kvtrace.inject import injector
from kvtrace.servers import registry

SIGNALS = "steps, chunks, hits, evictions, preemptions, KV connector loads and stores"


@dataclass
class Injected:
    pid: int
    role: str
    installed: bool
    reused: bool = False
    reason: str = ""


@dataclass
class InjectionSession:
    server: object  # kvtrace.servers.info.ServerInfo
    timeout: float = 10.0
    results: list[Injected] = field(default_factory=list)
    checked: dict | None = None   # the kind's support check of the server's source (kvtrace.servers.hooksupport)
    skip: dict = field(default_factory=dict)   # pid -> why it is not injected

    def targets(self) -> list[tuple[int, str]]:
        return [(p, r) for p, r in registry.kind(self.server.kind).hook_pids(self.server) if p not in self.skip]

    def install(self) -> list[Injected]:
        if not self.targets():
            raise TargetError(f"{engine_label(self.server)} server {self.server.pid} has no "
                              f"{registry.kind(self.server.kind).hooked} process to inject into")
        for pid, role in self.targets():
            self.results.append(self._one(pid, role, "install"))
        return self.results

    def _one(self, pid: int, role: str, action: str) -> Injected:
        try:
            rep = injector.hook(pid, action, self.timeout, checked=self.checked if action == "install" else None,
                                module=registry.kind(self.server.kind).hook_module)
        except KvtraceError as e:
            return Injected(pid, role, False, reason=str(e))
        if rep.get("error"):
            return Injected(pid, role, False, reason=f"the hook failed to load: {rep['error']}")
        status = rep.get("status") or {}
        installed = bool(rep.get("installed"))
        reason = "" if installed else (status.get("reason") or "the hook stayed inert")
        return Injected(pid, role, installed, bool(rep.get("reused")), reason)

    def uninstall(self) -> list[Injected]:
        """Remove the hook wherever this session installed it and the process still runs; a
        hook that was already active (the plugin's, or another agent's) stays."""
        out = []
        for r in self.results:
            if r.installed and not r.reused and psutil.pid_exists(r.pid):
                out.append(self._one(r.pid, r.role, "uninstall"))
        return out

    def missing(self) -> list[str]:
        """One line per process where the vLLM signals are missing, and why."""
        return [f"{r.role} {r.pid}: no {engine_label(self.server)} hook ({r.reason})" for r in self.results
                if not r.installed]


def engine_label(server) -> str:
    """"vLLM" or "SGLang": the server kind's title, as messages name it."""
    return registry.kind(server.kind).title


def inject_hook(server, inject: bool, usermark: bool, echo, flag=None, checked: dict | None = None) -> InjectionSession | None:
    """Inject the vLLM hook for a capture (unless refused or --no-inject); say through ``echo``
    which signals are missing and why.  ``flag``: the capture's AgentFlag, also put where a
    server in its own mount namespace (a container) looks for it.  ``checked``: the hook's
    verdict on the server's source files (kvtrace.servers.hooksupport), None when unread."""
    if server is None:
        return None
    name = engine_label(server)
    if not inject or not usermark:
        why = "--no-inject" if not inject else "the usermark probe is not attached"
        echo(f"kvtrace: {name} signals missing ({SIGNALS}): {why}; kernel probes, KV events and /metrics still run")
        return None
    if checked is not None and not checked["supported"]:
        echo(f"kvtrace: {name} {checked['version'] or '?'} refused by the hook: {support.reason(checked)}")
        echo(f"kvtrace: {name} signals missing ({SIGNALS}); kernel probes, KV events and /metrics still run")
        return None
    session = InjectionSession(server, checked=checked)
    if flag is not None:
        for pid, role in session.targets():
            try:
                flag.add_root(f"/proc/{pid}/root")
            except UnsafePath as e:
                session.skip[pid] = str(e)
                echo(f"kvtrace: {name} signals missing in {role} {pid}: not injected, its agent flag cannot be "
                     f"put there safely ({e})")
    try:
        results = session.install()
    except TargetError as e:
        echo(f"kvtrace: {name} signals missing: {e}")
        return None
    for r in results:
        if r.installed:
            echo(f"kvtrace: {name} hook {'already active' if r.reused else 'injected'} in {r.role} {r.pid}")
    for line in session.missing():
        echo(f"kvtrace: {name} signals missing in {line}")
    return session
