"""Find running SGLang servers: the launcher (HTTP server) and its ``sglang::scheduler`` and
``sglang::detokenizer`` children, the port, SGLang's version and KV-events publisher.

A process is an SGLang server when it is a Python interpreter running ``-m sglang.launch_server``
(or ``-m sglang.cli.main serve``), or the ``sglang`` console script with ``serve``.  The
scheduler (where the hook goes: it runs the radix cache and the model) is found below it by the
title SGLang sets (``sglang::scheduler``, with a ``_DP<i>_TP<j>`` suffix when parallel).
Reported as a kvtrace.servers.info.ServerInfo of kind "sglang": the scheduler in
``engine_pids``.  With tensor parallelism (no DP attention) every TP rank runs a scheduler
holding a replica of rank 0's radix tree: only TP rank 0 is the engine, the other ranks go in
``worker_pids`` (traced, not hooked: the sglang kind hooks engines only).  Best effort; its
files are read confined, as for vLLM (an unsafe one raises UnsafePath, and discovery lists the
process as unreadable).
"""
from __future__ import annotations

import json
import os
import re

import psutil

from kvtrace.host import netns
from kvtrace.servers.info import KvEventsInfo, ServerInfo
from kvtrace.servers.procfs import _arg, _environ, _is_python, _port, environment
from kvtrace.servers.pyenv import PLUGIN_NAME

DEFAULT_PORT = 30000
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGINS_ENV = "SGLANG_PLUGINS"   # the variable that filters that group's plugins
SCHEDULER = "sglang::schedul"   # the 15-character comm of "sglang::scheduler..."
DEFAULT_KV_ENDPOINT = "tcp://*:5557"
_TP_RANK = re.compile(r"_TP(\d+)(?:_|$)")   # "sglang::scheduler_DP0_TP1" -> 1


def server_kind(cmdline: list[str]) -> str | None:
    """'module' or 'cli' when this argv is an SGLang server, else None."""
    if not cmdline:
        return None
    if os.path.basename(cmdline[0]) == "sglang":
        return "cli" if cmdline[1:2] == ["serve"] else None
    if not _is_python(cmdline[0]):
        return None
    args = cmdline[1:]
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            mod, rest = args[i + 1], args[i + 2:]
            if mod == "sglang.launch_server":
                return "module"
            if mod in ("sglang.cli.main", "sglang") and rest[:1] == ["serve"]:
                return "module"
            return None
        if a in ("-c", "-"):
            return None
        if not a.startswith("-"):
            return "cli" if os.path.basename(a) == "sglang" and args[i + 1:i + 2] == ["serve"] else None
    return None


def kv_events_from_args(cmdline: list[str]) -> KvEventsInfo | None:
    """SGLang's ``--kv-events-config`` JSON; None when absent.  Its publisher is "null" unless
    set to "zmq"; ``bind`` overrides the endpoint rule (bind ``*``, ipc; connect otherwise)."""
    raw = _arg(cmdline, "--kv-events-config")
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict):
        return KvEventsInfo(enabled=False, publisher=None, endpoint=None, replay_endpoint=None, raw={})
    publisher = str(cfg.get("publisher") or "null")
    try:
        dp = int(_arg(cmdline, "--dp-size", "--data-parallel-size", "--dp") or 1)
    except ValueError:
        dp = 1
    bind = cfg.get("bind")
    return KvEventsInfo(enabled=publisher == "zmq", publisher=publisher,
                        endpoint=str(cfg.get("endpoint") or DEFAULT_KV_ENDPOINT),
                        replay_endpoint=str(cfg["replay_endpoint"]) if cfg.get("replay_endpoint") else None,
                        topic=str(cfg.get("topic") or ""), dp_size=max(dp, 1), raw=cfg,
                        bind=bool(bind) if bind is not None else None)


def describe(proc: psutil.Process) -> ServerInfo | None:
    """Describe one process if it is an SGLang server, else None.  Raises UnsafePath when a file
    of its environment is not safe to read."""
    try:
        cmdline = proc.cmdline()
        if server_kind(cmdline) is None:
            return None
        children = proc.children(recursive=True)
    except (psutil.Error, OSError):
        return None
    schedulers, ranks, others = [], [], []
    dp_attention = "--enable-dp-attention" in cmdline
    for c in children:
        try:
            name = c.name()
        except psutil.Error:
            continue
        if name.startswith(SCHEDULER):
            tp = _TP_RANK.search(name)
            (ranks if tp and int(tp.group(1)) and not dp_attention else schedulers).append(c.pid)
        elif name.startswith("sglang::"):
            others.append(c.pid)
    kv = kv_events_from_args(cmdline)
    host, port = _port(proc, cmdline, set(), DEFAULT_PORT)
    if _arg(cmdline, "--port") is None:
        port = DEFAULT_PORT
    env = _environ(proc)
    py = environment(proc, cmdline, env, package="sglang", group=PLUGIN_GROUP)
    plugin = py["plugin"]
    allowed = env.get(PLUGINS_ENV)
    if plugin == "installed" and allowed and PLUGIN_NAME not in [a.strip() for a in allowed.split(",")]:
        plugin = "disabled"
    return ServerInfo(
        pid=proc.pid, api_pids=[proc.pid], engine_pids=schedulers, worker_pids=ranks, other_pids=others,
        host=host, port=port, model=_arg(cmdline, "--model-path", "--model"), python_exe=py["exe"],
        python_version=py["python"], version=py["version"], site_packages=py["site"], plugin=plugin,
        kv_events=kv, in_container=py["container"], cmdline=cmdline, netns=netns.foreign(proc.pid),
        netns_id=netns.ident(proc.pid), kind="sglang")
