"""Find running vLLM servers: API server, port, EngineCore and Worker pids, versions, KV events.

Only processes that are certainly a vLLM OpenAI server are reported: a Python interpreter
running ``-m vllm.entrypoints...`` (``cli.main`` only with ``serve``), or the ``vllm``
console script with ``serve``.  EngineCore and Worker are found below it by the titles vLLM
sets (``VLLM::EngineCore*``, ``VLLM::Worker*``; the prefix follows ``VLLM_PROCESS_NAME_PREFIX``
from the API server's environment), because their own argv and environ are overwritten.

Files of the server's Python environment (pyvenv.cfg, site-packages, dist-info) are read
through ``/proc/PID/root`` so a server in a container is described from its own filesystem,
confined to it (kvtrace.vllm.pyenv._Fs: no link out of it, no FIFO or device, a size cap).
Everything else is best effort: a field that cannot be read is None.  Each process is inspected
on a worker thread within DEADLINE_S (reading /proc/PID/cmdline or environ waits for the
process's memory map lock, which a stalled page fault can hold for ever): one that does not
answer in time, or whose files are unsafe, is listed as unreadable and discovery goes on.
"""
from __future__ import annotations

import ipaddress
import itertools
import json
import os
import queue
import re
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil

from kvtrace import phases
from kvtrace.host import netns
from kvtrace.host.confined import UnsafePath
# Re-exported: reading the server's Python environment lives in its own module.
from kvtrace.vllm.pyenv import (PLUGIN_GROUP, PLUGIN_NAME, _dist_infos, _Fs, _mapped_paths,  # noqa: F401
                                _python_version, _resolve_arg0, _site_candidates, _vllm_version, plugin_installed)

DEFAULT_PORT = 8000
DEFAULT_KV_ENDPOINT = "tcp://*:5557"
_PY_RE = re.compile(r"^python(\d(\.\d+)?)?[a-z]?$")
_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
DEADLINE_S = 2.0   # one process's inspection: its /proc entries and its environment's files
WORKERS = 4        # processes inspected at once (a stalled one holds its thread, not discovery)


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
class VllmServerInfo:
    pid: int  # the API server (front end) that was started
    api_pids: list[int]  # pid plus VLLM::APIServer_<i> children (api-server-count > 1)
    engine_pids: list[int]
    worker_pids: list[int]
    other_pids: list[int]  # DP coordinator and other titled VLLM:: helpers
    host: str | None
    port: int | None
    model: str | None
    python_exe: str | None
    python_version: str | None
    vllm_version: str | None
    site_packages: str | None
    plugin: str  # "installed", "disabled" (VLLM_PLUGINS excludes it), "absent", "unknown"
    kv_events: KvEventsInfo | None
    in_container: bool
    cmdline: list[str]
    netns: str | None = None  # /proc/PID/ns/net when the server is in another network namespace
    netns_id: str | None = None  # net:[inode] of the server's network namespace
    engine: str = "vllm"  # "sglang": an SGLang server (kvtrace.sglang.discover); vllm_version is then SGLang's

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


# ---------------------------------------------------------------------------------------------
# Which processes are vLLM servers


def _is_python(arg0: str) -> bool:
    return bool(_PY_RE.match(os.path.basename(arg0)))


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


# ---------------------------------------------------------------------------------------------
# Arguments


def _arg(cmdline: list[str], *names: str) -> str | None:
    """The last value given for an option (``--x v`` or ``--x=v``, dashes or underscores)."""
    want = {n.replace("_", "-") for n in names}
    value = None
    for i, a in enumerate(cmdline):
        if not a.startswith("-"):
            continue
        key, eq, v = a.partition("=")
        if key.replace("_", "-") in want:
            if eq:
                value = v
            elif i + 1 < len(cmdline):
                value = cmdline[i + 1]
    return value


def _dotted(cmdline: list[str], prefix: str) -> dict:
    """``--prefix.key value`` / ``--prefix.key=value`` arguments as a dict (vLLM's JSON-arg form)."""
    out: dict = {}
    pre = prefix.replace("_", "-") + "."
    for i, a in enumerate(cmdline):
        if not a.startswith("--"):
            continue
        key, eq, v = a.partition("=")
        head, dot, tail = key.partition(".")
        key = head.replace("_", "-") + dot + tail
        if not key.startswith(pre):
            continue
        if not eq:
            if i + 1 >= len(cmdline):
                continue
            v = cmdline[i + 1]
        try:
            val = json.loads(v)
        except ValueError:
            val = v
        d = out
        parts = key[len(pre):].split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                break
        else:
            d[parts[-1]] = val
    return out


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


def _model(cmdline: list[str], kind: str) -> str | None:
    m = _arg(cmdline, "--model")
    if m:
        return m
    if kind == "cli" or "serve" in cmdline:
        try:
            i = cmdline.index("serve")
        except ValueError:
            return None
        if i + 1 < len(cmdline) and not cmdline[i + 1].startswith("-"):
            return cmdline[i + 1]
    return None


def _hex_addr(text: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} (little-endian hex words) as (ip, port)."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)   # ::ffff:a.b.c.d listens for IPv4: say a.b.c.d
    return str(mapped or ip), int(port, 16)


def _socket_inodes(pid: int) -> set[str]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def listening(pid: int) -> list[tuple[str, int]]:
    """TCP sockets this process listens on, read in its own network namespace (/proc/PID/net)."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:   # 0A: TCP_LISTEN
                out.append(_hex_addr(cols[1]))
    return out


def _port(proc: psutil.Process, cmdline: list[str], excluded: set[int]) -> tuple[str | None, int | None]:
    host = _arg(cmdline, "--host")
    arg = _arg(cmdline, "--port")
    listens = listening(proc.pid)
    if arg is not None:
        try:
            return host, int(arg)
        except ValueError:
            pass
    ports = [(h, p) for h, p in listens if p not in excluded]
    for h, p in ports:
        if p == DEFAULT_PORT:
            return host or h, p
    if ports:
        return host or ports[0][0], ports[0][1]
    return host, DEFAULT_PORT if not listens else None


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def describe(proc: psutil.Process) -> VllmServerInfo | None:
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
    host, port = _port(proc, cmdline, excluded)

    py = environment(proc, cmdline, env)
    plugin = py["plugin"]
    allowed = env.get("VLLM_PLUGINS")
    if plugin == "installed" and allowed is not None and PLUGIN_NAME not in [a.strip() for a in allowed.split(",")]:
        plugin = "disabled"
    return VllmServerInfo(
        pid=proc.pid, api_pids=api, engine_pids=engines, worker_pids=workers, other_pids=others,
        host=host, port=port, model=_model(cmdline, kind), python_exe=py["exe"], python_version=py["python"],
        vllm_version=py["version"], site_packages=py["site"], plugin=plugin, kv_events=kv,
        in_container=py["container"], cmdline=cmdline, netns=netns.foreign(proc.pid), netns_id=netns.ident(proc.pid),
    )


def environment(proc: psutil.Process, cmdline: list[str], env: dict, package: str = "vllm",
                group: str = PLUGIN_GROUP) -> dict:
    """The server's Python environment, read through /proc/PID/root: its interpreter ("exe",
    "python": X.Y.Z), the site-packages holding ``package`` ("site") and its "version", whether
    kvtrace's plugin is installed for entry-point ``group`` ("plugin": "installed", "absent",
    "unknown"), and whether it runs in a container ("container").  Raises UnsafePath when one of
    those files is not safe to read."""
    with _Fs(proc.pid) as fs:
        return _environment(fs, proc, cmdline, env, package, group)


def _environment(fs: _Fs, proc: psutil.Process, cmdline: list[str], env: dict, package: str, group: str) -> dict:
    try:
        exe = os.readlink(f"/proc/{proc.pid}/exe").removesuffix(" (deleted)")
    except OSError:
        exe = None
    try:
        cwd = proc.cwd()
    except (psutil.Error, OSError):
        cwd = None
    arg0 = _resolve_arg0(fs, cmdline[0], cwd, env)
    xy = None
    for s in (exe or "", arg0 or ""):
        hit = re.search(r"python(3\.\d+)", os.path.basename(s))
        if hit:
            xy = hit.group(1)
    if xy is None:
        for m in _mapped_paths(proc.pid):
            hit = re.search(r"libpython(3\.\d+)", m) or re.search(r"/lib/python(3\.\d+)/", m)
            if hit:
                xy = hit.group(1)
                break
    sites, venv = _site_candidates(fs, proc.pid, arg0, exe, xy, env, package)
    site = next((s for s in sites if fs.exists(f"{s}/{package}/__init__.py")), None)
    if xy is None and site:
        hit = re.search(r"python(3\.\d+)", site)
        xy = hit.group(1) if hit else None
    pyver = _python_version(fs, proc.pid, exe, venv, site)
    vver = _vllm_version(fs, site, package) if site else None
    if site is None and not fs.usable:
        plugin = "unknown"
    else:
        env_sites = [s for s in sites if fs.exists(s)]
        plugin = "installed" if plugin_installed(fs, env_sites, group) else "absent"
    return {"exe": exe, "python": pyver, "site": site, "version": vver, "plugin": plugin, "container": fs.container}


@dataclass
class Unreadable:
    """A process discovery could not inspect: its reads did not return within DEADLINE_S, or a
    file of its environment is not safe to read (a FIFO, a device, a link, too large)."""

    pid: int
    reason: str

    def line(self) -> str:
        return f"pid {self.pid}: unreadable ({self.reason})"

    def to_json(self) -> dict:
        return {"pid": self.pid, "port": None, "unreadable": self.reason}


class Servers(list):
    """discover()'s answer: the servers, by API-server pid; ``unreadable``: the processes that
    could not be inspected (Unreadable, by pid)."""

    def __init__(self, servers=(), unreadable=()):
        super().__init__(servers)
        self.unreadable = list(unreadable)


class _Pool:
    """``fn`` on each process on daemon threads, each call within ``deadline`` seconds: a call
    that overruns is given up (its thread left to return or hang alone) and a new thread takes
    its place, so a stalled process never holds up the others."""

    def __init__(self, fn, procs: list, deadline: float, workers: int):
        self.fn, self.deadline, self.ids = fn, deadline, itertools.count()
        self.todo, self.done = queue.SimpleQueue(), queue.SimpleQueue()
        self.running: dict[int, tuple] = {}   # thread number -> (proc, started)
        self.lock = threading.Lock()
        self.pending = {p.pid for p in procs}
        for p in procs:
            self.todo.put(p)
        for _ in range(min(workers, len(procs))):
            self._spawn()

    def _spawn(self) -> None:
        n = next(self.ids)
        threading.Thread(target=self._work, args=(n,), name=f"kvtrace-discover-{n}", daemon=True).start()

    def _work(self, n: int) -> None:
        while True:
            try:
                proc = self.todo.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.running[n] = (proc, time.monotonic())
            try:
                out = (proc, self.fn(proc), None)
            except UnsafePath as e:
                out = (proc, None, str(e))
            except Exception as e:   # one odd process must not end discovery: it is listed with why
                out = (proc, None, f"{type(e).__name__}: {e}")
            with self.lock:
                self.running.pop(n, None)
            self.done.put(out)

    def results(self):
        """(proc, fn's answer, None) or (proc, None, why it was not read), as they come."""
        while self.pending:
            try:
                proc, out, why = self.done.get(timeout=0.05)
                if proc.pid in self.pending:
                    self.pending.discard(proc.pid)
                    yield proc, out, why
            except queue.Empty:
                pass
            for proc in self._overdue():
                self.pending.discard(proc.pid)
                self._spawn()
                yield proc, None, (f"not read within {self.deadline:g} s: a read of its /proc files "
                                   "or of its environment's files did not return")

    def _overdue(self) -> list:
        now = time.monotonic()
        with self.lock:
            return [p for p, t0 in self.running.values() if now - t0 > self.deadline and p.pid in self.pending]


def discover() -> Servers:
    """Every vLLM and SGLang server on this host (in any container whose /proc is visible), by
    API-server pid, and the processes that could not be inspected (``.unreadable``)."""
    from kvtrace.vllm import sglang_discover  # lazy: that module builds on this one

    phases.mark("discover_start")
    me = os.getpid()
    procs = [p for p in psutil.process_iter() if p.pid != me]
    found, unreadable = [], []
    pool = _Pool(lambda p: describe(p) or sglang_discover.describe(p), procs, DEADLINE_S, WORKERS)
    for proc, info, why in pool.results():
        if why is not None:
            unreadable.append(Unreadable(proc.pid, why))
        elif info is not None:
            found.append(info)
    # A spawned API-server child (VLLM::APIServer_<i>) keeps no vllm argv, so no duplicates
    # arise there; but a `vllm serve` started by another vllm process would: keep the outermost.
    inner = {p for s in found for p in s.api_pids[1:] + s.engine_pids + s.worker_pids + s.other_pids}
    mine = inner | {p for s in found for p in s.api_pids}
    phases.mark("discover_end")
    return Servers(sorted((s for s in found if s.pid not in inner), key=lambda s: s.pid),
                   sorted((u for u in unreadable if u.pid not in mine), key=lambda u: u.pid))
