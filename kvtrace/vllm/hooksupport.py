"""Whether the hook supports a vLLM (or SGLang) server that discovery found, read from outside: its vLLM
source files, through /proc/PID/root (a container's own filesystem), checked target by target
(kvtrace.hook.support).  Nothing is imported or injected; about 0.3 s a server."""
from __future__ import annotations

from kvtrace.hook import support
from kvtrace.hook.source import SourceTree
from kvtrace.vllm.pyenv import _Fs

_CACHE: dict[str, dict] = {}


def verdict(info) -> dict | None:
    """kvtrace.hook.support.check of the server's vLLM, or None when its files cannot be read."""
    if not info.site_packages:
        return None
    root = str(_Fs(info.pid).p(info.site_packages))
    engine = getattr(info, "engine", "vllm")
    key = f"{engine}:{root}"
    if key not in _CACHE or not SourceTree(root).unchanged(_CACHE[key]["files"]):
        v = support.check(root, engine)
        if v["version"] is None and not v["files"]:
            return None
        _CACHE[key] = v
    return _CACHE[key]


def label(v: dict | None) -> str:
    """"yes", "no" or "?" for a table cell."""
    return "?" if v is None else "yes" if v["supported"] else "no"


def describe(info, v: dict | None) -> str:
    """One line: the server's vLLM (or SGLang) and what the hook does with it."""
    version = (v or {}).get("version") or info.vllm_version or "?"
    name = "SGLang" if getattr(info, "engine", "vllm") == "sglang" else "vLLM"
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
