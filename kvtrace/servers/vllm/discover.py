"""Find running vLLM servers: API server, port, EngineCore and Worker pids, versions, KV events.

Only processes that are certainly a vLLM OpenAI server are reported: a Python interpreter
running ``-m vllm.entrypoints...`` (``cli.main`` only with ``serve``), or the ``vllm``
console script with ``serve``.  EngineCore and Worker are found below it by the titles vLLM
sets (``VLLM::EngineCore*``, ``VLLM::Worker*``; the prefix follows ``VLLM_PROCESS_NAME_PREFIX``
from the API server's environment), because their own argv and environ are overwritten.

Files of the server's Python environment (pyvenv.cfg, site-packages, dist-info) are read
through ``/proc/PID/root`` so a server in a container is described from its own filesystem,
confined to it (kvtrace.servers.pyenv._Fs: no link out of it, no FIFO or device, a size cap).
Everything else is best effort: a field that cannot be read is None.
"""
from __future__ import annotations

import json
import os
import re

import psutil

from kvtrace.host import netns
from kvtrace.servers.info import KvEventsInfo, ServerInfo
from kvtrace.servers.procfs import _arg, _dotted, _environ, _is_python, _model, _port, environment
from kvtrace.servers.pyenv import PLUGIN_NAME

DEFAULT_PORT = 8000
DEFAULT_KV_ENDPOINT = "tcp://*:5557"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGINS_ENV = "VLLM_PLUGINS"   # the variable that filters that group's plugins
_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")


def server_kind(cmdline: list[str]) -> str | None:
    """'module' or 'cli' when this argv is a vLLM OpenAI server, else None."""
    if not cmdline:
        return None
    if os.path.basename(cmdline[0]) == "vllm":
        return "cli" if len(cmdline) > 1 and cmdline[1] == "serve" else None
    if not _is_python(cmdline[0]):
        return None
    args = cmdline[1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-c",) or a == "-":
            return None
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            mod = args[i + 1] if a == "-m" and i + 1 < len(args) else a[2:]
            rest = args[i + 2:] if a == "-m" else args[i + 1:]
            if mod in _SERVER_MODULES:
                return "module"
            if mod == "vllm.entrypoints.cli.main":
                return "module" if rest[:1] == ["serve"] else None
            if mod.startswith("vllm.entrypoints.") and mod.endswith("api_server"):
                return "module"
            return None
        if a in ("-X", "-W", "--check-hash-based-pycs"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        # a script: the vllm console script run by an interpreter
        return "cli" if os.path.basename(a) == "vllm" and args[i + 1:i + 2] == ["serve"] else None
    return None


def kv_events_from_args(cmdline: list[str]) -> KvEventsInfo | None:
    """The KV-events config from ``--kv-events-config`` (JSON or dotted keys); None when absent."""
    cfg: dict = {}
    raw = _arg(cmdline, "--kv-events-config")
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            cfg.update(parsed)
    cfg.update(_dotted(cmdline, "--kv-events-config"))
    if raw is None and not cfg:
        return None
    enabled = bool(cfg.get("enable_kv_cache_events", False))
    publisher = cfg.get("publisher") or ("zmq" if enabled else "null")
    try:
        dp = int(_arg(cmdline, "--data-parallel-size", "-dp") or 1)
    except ValueError:
        dp = 1
    return KvEventsInfo(
        enabled=enabled and publisher == "zmq",
        publisher=str(publisher),
        endpoint=str(cfg.get("endpoint") or DEFAULT_KV_ENDPOINT),
        replay_endpoint=str(cfg["replay_endpoint"]) if cfg.get("replay_endpoint") else None,
        topic=str(cfg.get("topic") or ""),
        dp_size=max(dp, 1),
        raw=cfg,
    )


def describe(proc: psutil.Process) -> ServerInfo | None:
    """Describe one process if it is a vLLM server, else None.  Raises UnsafePath when a file
    of its environment is not safe to read."""
    try:
        cmdline = proc.cmdline()
        kind = server_kind(cmdline)
        if kind is None:
            return None
        children = proc.children(recursive=True)
    except (psutil.Error, OSError):
        return None
    env = _environ(proc)
    prefix = env.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"
    api, engines, workers, others = [proc.pid], [], [], []
    for c in children:
        try:
            name = c.name()
        except psutil.Error:
            continue
        if not name.startswith(prefix):
            continue
        title = name[len(prefix):]
        if title.startswith("EngineCor"):
            engines.append(c.pid)
        elif title.startswith("Worker"):
            workers.append(c.pid)
        elif title.startswith("APIServer"):
            api.append(c.pid)
        else:
            others.append(c.pid)
    kv = kv_events_from_args(cmdline)
    excluded: set[int] = set()
    if kv:
        for ep in (kv.endpoint, kv.replay_endpoint):
            hit = re.search(r":(\d+)$", ep or "")
            if hit:
                excluded.add(int(hit.group(1)))
    host, port = _port(proc, cmdline, excluded, DEFAULT_PORT)

    py = environment(proc, cmdline, env, "vllm", PLUGIN_GROUP)
    plugin = py["plugin"]
    allowed = env.get(PLUGINS_ENV)
    if plugin == "installed" and allowed is not None and PLUGIN_NAME not in [a.strip() for a in allowed.split(",")]:
        plugin = "disabled"
    return ServerInfo(
        pid=proc.pid, api_pids=api, engine_pids=engines, worker_pids=workers, other_pids=others,
        host=host, port=port, model=_model(cmdline, kind), python_exe=py["exe"], python_version=py["python"],
        version=py["version"], site_packages=py["site"], plugin=plugin, kv_events=kv,
        in_container=py["container"], cmdline=cmdline, kind="vllm",
        netns=netns.foreign(proc.pid), netns_id=netns.ident(proc.pid),
    )
