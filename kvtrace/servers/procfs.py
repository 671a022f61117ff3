"""What every server kind's discovery reads the same way: the command line's options, the TCP
ports a process listens on, its environment variables, and its Python environment (read
through /proc/PID/root, confined: kvtrace.servers.pyenv)."""
from __future__ import annotations

import ipaddress
import json
import os
import re

import psutil

from kvtrace.servers.pyenv import (_Fs, _mapped_paths, _python_version, _resolve_arg0, _site_candidates, package_version,
                                   plugin_installed)

_PY_RE = re.compile(r"^python(\d(\.\d+)?)?[a-z]?$")


def _is_python(arg0: str) -> bool:
    return bool(_PY_RE.match(os.path.basename(arg0)))


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


def tcp_rows(net: str):
    """The columns of every TCP socket's line in ``net``/tcp and ``net``/tcp6 (a /proc/.../net
    directory: the network namespace of the process or thread it belongs to)."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{net}/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9:
                yield cols


def listening(pid: int) -> list[tuple[str, int]]:
    """TCP sockets this process listens on, read in its own network namespace (/proc/PID/net)."""
    inodes = _socket_inodes(pid)
    return [_hex_addr(c[1]) for c in tcp_rows(f"/proc/{pid}/net") if c[3] == "0A" and c[9] in inodes]   # 0A: LISTEN


def _port(proc: psutil.Process, cmdline: list[str], excluded: set[int], default: int) -> tuple[str | None, int | None]:
    """(host, port) of the server: --host/--port when given, else the port it listens on (``default``
    first), else ``default`` when it listens on nothing yet."""
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
        if p == default:
            return host or h, p
    if ports:
        return host or ports[0][0], ports[0][1]
    return host, default if not listens else None


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def environment(proc: psutil.Process, cmdline: list[str], env: dict, package: str,
                group: str) -> dict:
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
    vver = package_version(fs, site, package) if site else None
    if site is None and not fs.usable:
        plugin = "unknown"
    else:
        env_sites = [s for s in sites if fs.exists(s)]
        plugin = "installed" if plugin_installed(fs, env_sites, group) else "absent"
    return {"exe": exe, "python": pyver, "site": site, "version": vver, "plugin": plugin, "container": fs.container}
