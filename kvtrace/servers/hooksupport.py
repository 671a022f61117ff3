"""Whether the hook supports a server that discovery found, read from outside: its engine's
source files, through /proc/PID/root (a container's own filesystem), checked target by target
by the kind's support check (its descriptor's ``support``: kvtrace.hook.vllm.support.check,
kvtrace.hook.sglang.support.check).  Nothing is imported or injected; about 0.3 s a server.

The site-packages directory is resolved inside the server's root (kvtrace.host.confined) and
its source read from that descriptor (/proc/self/fd/N), confined (kvtrace.hook.source): no
link below it is followed, no FIFO or device read, no file over 4 MiB.  A file that cannot be
read so gives a verdict that refuses the hook, naming the file and why."""
from __future__ import annotations

import os

from kvtrace.hook import support
from kvtrace.hook.source import SourceTree, Unreadable
from kvtrace.host.confined import UnsafePath
from kvtrace.servers import registry
from kvtrace.servers.pyenv import _Fs

_CACHE: dict[str, dict] = {}


def verdict(info) -> dict | None:
    """The server kind's support check of the server's source, or None when its files cannot be read
    (a refusal naming the file when one is unsafe to read)."""
    if not info.site_packages:
        return None
    kind = registry.kind(info.kind)
    with _Fs(info.pid) as fs:
        shown = fs.show(info.site_packages)
        try:
            fd = fs.opendir(info.site_packages)
        except UnsafePath as e:
            return _unreadable(kind.name, shown, str(e))
        if fd is None:
            return None
        try:
            return _checked(f"{kind.name}:{shown}", f"/proc/self/fd/{fd}", kind, shown)
        except Unreadable as e:
            return _unreadable(kind.name, shown, f"{shown}/{e}")
        finally:
            os.close(fd)


def _checked(key: str, root: str, kind, shown: str) -> dict | None:
    if key not in _CACHE or not SourceTree(root).unchanged(_CACHE[key]["files"]):
        v = kind.support_check()(root)
        if v["version"] is None and not v["files"]:
            return None
        _CACHE[key] = {**v, "root": shown}
    return _CACHE[key]


def _unreadable(kind: str, shown: str, why: str) -> dict:
    """A verdict that refuses the hook because the server's files are not safe to read."""
    return {"version": None, "root": shown, "supported": False, "roles": {"engine": [why], "worker": [why]},
            "connector": [why], "releases": {}, "files": {}, "kind": kind, "unreadable": why}


def label(v: dict | None) -> str:
    """"yes", "no" or "?" for a table cell."""
    return "?" if v is None else "yes" if v["supported"] else "no"


def describe(info, v: dict | None) -> str:
    """One line: the server's vLLM (or SGLang) and what the hook does with it."""
    version = (v or {}).get("version") or info.version or "?"
    name = registry.kind(info.kind).title
    if v is None:
        return f"{name} {version}: hook support unknown (its {name} files cannot be read here)"
    if v["supported"]:
        return f"{name} {version}: hook supported (every target checked)"
    return f"{name} {version}: hook refused: {support.reason(v)}"


def to_json(v: dict | None) -> dict | None:
    if v is None:
        return None
    return {"version": v["version"], "supported": v["supported"], "reason": support.reason(v),
            "differences": v["roles"], "file_connector": v["connector"], "releases": v["releases"]}
