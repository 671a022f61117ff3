"""Inject the hook into one vLLM server's EngineCore and Worker processes for the length of
a capture, and take it out again at the end.

Only processes discovery identified as the EngineCore or a Worker of a vLLM API server are
ever touched.  A process where the hook refuses (other vLLM version, signatures differ) or
injection fails is reported with the reason; the rest of the capture goes on without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from kvtrace.errors import KvtraceError, TargetError
from kvtrace.inject import injector


@dataclass
class Injected:
    pid: int
    role: str
    installed: bool
    reused: bool = False
    reason: str = ""


@dataclass
class InjectionSession:
    server: object  # kvtrace.vllm.discover.VllmServerInfo
    timeout: float = 10.0
    results: list[Injected] = field(default_factory=list)

    def targets(self) -> list[tuple[int, str]]:
        return [(p, "engine") for p in self.server.engine_pids] + [(p, "worker") for p in self.server.worker_pids]

    def install(self) -> list[Injected]:
        if not self.targets():
            raise TargetError(f"vLLM server {self.server.pid} has no EngineCore or Worker process to inject into")
        for pid, role in self.targets():
            self.results.append(self._one(pid, role, "install"))
        return self.results

    def _one(self, pid: int, role: str, action: str) -> Injected:
        try:
            rep = injector.hook(pid, action, self.timeout)
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
        return [f"{r.role} {r.pid}: no vLLM hook ({r.reason})" for r in self.results if not r.installed]


def inject_hook(server, inject: bool, usermark: bool, echo, flag=None) -> InjectionSession | None:
    """Inject the vLLM hook for a capture (unless refused or --no-inject); say through ``echo``
    which signals are missing and why.  ``flag``: the capture's AgentFlag, also put where a
    server in its own mount namespace (a container) looks for it."""
    if server is None:
        return None
    if not inject or not usermark:
        why = "--no-inject" if not inject else "the usermark probe is not attached"
        echo(f"kvtrace: vLLM signals missing (steps, chunks, hits, evictions, KV loads): {why}; "
             "kernel probes, KV events and /metrics still run")
        return None
    session = InjectionSession(server)
    if flag is not None:
        for pid, _ in session.targets():
            flag.add_root(f"/proc/{pid}/root")
    try:
        results = session.install()
    except TargetError as e:
        echo(f"kvtrace: vLLM signals missing: {e}")
        return None
    for r in results:
        if r.installed:
            echo(f"kvtrace: vLLM hook {'already active' if r.reused else 'injected'} in {r.role} {r.pid}")
    for line in session.missing():
        echo(f"kvtrace: vLLM signals missing in {line}")
    return session
