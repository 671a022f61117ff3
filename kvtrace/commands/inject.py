"""`kvtrace inject`: put the hook into a running vLLM or SGLang server, take it out, or ask its state.

`kvtrace attach` does this by itself for the length of a capture; a hook put in by this command
stays until `--remove` (it records while an agent is attached, as the plugin's does).  Only
processes of a vLLM or SGLang server found by discovery are ever touched.
"""
from __future__ import annotations

import json

import click

from kvtrace.errors import PrivilegeError, TargetError
from kvtrace.host import privileges


def find_server(pid: int):
    from kvtrace.servers.discover import discover  # lazy: start-up cost: the CLI imports every command's module (cli._register)

    for server in discover():
        if pid in server.pids:
            return server
    return None


@click.command("inject")
@click.option("--pid", type=int, required=True, help="A pid of the server (vLLM: API server, EngineCore or Worker; SGLang: server or scheduler).")
@click.option("--remove", is_flag=True, help="Remove the hook instead of installing it.")
@click.option("--status", "status_only", is_flag=True, help="Only report the hook's state in each process.")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for a safe point per process.")
@click.option("--json", "as_json", is_flag=True)
def command(pid: int, remove: bool, status_only: bool, timeout: float, as_json: bool) -> int:
    """Install (default), remove or inspect the hook in a live vLLM or SGLang server.  A server
    whose engine code differs from what the hook needs is refused in one line naming the first
    difference, before any process is touched (exit 1)."""
    import os

    from kvtrace.inject import injector  # lazy: start-up cost: the CLI imports every command's module (cli._register)
    from kvtrace.inject.session import engine_label  # lazy: start-up cost, as above
    from kvtrace.servers import registry  # lazy: start-up cost, as above

    if os.geteuid() != 0 and not privileges.has_cap(privileges.CAP_SYS_PTRACE):
        raise PrivilegeError("injection needs root or CAP_SYS_PTRACE: run with sudo (target untouched)")
    server = find_server(pid)
    if server is None:
        raise TargetError(f"process {pid} is not part of a vLLM or SGLang server found on this host: not injecting (target untouched)")
    action = "uninstall" if remove else "status" if status_only else "install"
    checked = None
    if action == "install":
        from kvtrace.hook import support  # lazy: start-up cost, as above
        from kvtrace.servers import hooksupport  # lazy: start-up cost, as above

        checked = hooksupport.verdict(server)
        if checked is not None and not checked["supported"]:
            click.echo(f"kvtrace: {engine_label(server)} {checked['version'] or '?'} refused by the hook: {support.reason(checked)}", err=True)
            return 1
    rows = []
    kind = registry.kind(server.kind)
    for p, role in kind.hook_pids(server):
        rep = injector.hook(p, action, timeout, checked=checked, module=kind.hook_module,
                             owned=False)   # by hand: it stays until `--remove`
        st = rep.get("status") or {}
        rows.append({"pid": p, "role": role, "installed": st.get("installed"), "reused": rep.get("reused"),
                     "reason": rep.get("error") or st.get("reason", ""), "roles": st.get("roles"),
                     "emitted": st.get("emitted"), "errors": st.get("errors")})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "installed" if r["installed"] else "not installed"
            click.echo(f"{r['role']:6} {r['pid']:>7}  {state}" + (f"  ({r['reason']})" if r["reason"] else ""))
    if action == "install" and not all(r["installed"] for r in rows):
        return 1
    return 0
