"""Whether a vLLM (its source tree) supports the hook, role by role, and kvtrace's file
connector: the verdict ``kvtrace servers``, ``doctor`` and ``attach`` give for a server before
touching it, and that attach hands to the hook it injects.  The hook then only checks that the
files read are still the same ones (their sizes and times) and its wrapped methods on the
imported classes, instead of parsing vLLM's source while the server waits.
Standard library only.
"""
from __future__ import annotations

import os

from . import needs, plan, releases, sglang_needs
from .source import SourceTree

ROLES = {"engine": needs.ENGINE_METHODS + needs.ENGINE_READS, "worker": needs.WORKER_METHODS + needs.WORKER_READS}
SGLANG_ROLES = {"engine": sglang_needs.METHODS + sglang_needs.READS}


def engine_at(root: str) -> str:
    """"sglang" when ``root`` holds SGLang and no vLLM, else "vllm"."""
    has = lambda pkg: os.path.isfile(os.path.join(root, pkg, "__init__.py"))  # noqa: E731
    return "sglang" if has("sglang") and not has("vllm") else "vllm"


def check(root: str, engine: str | None = None) -> dict:
    """The verdict for the vLLM under ``root`` (the directory holding ``vllm/``)::

        {"version": "0.32.0" or None, "root": root, "supported": bool,
         "roles": {"engine": [differences], "worker": [...]}, "connector": [...],
         "releases": {row: newer form present}, "files": {path: [size, mtime_ns]}}

    A difference reads "target: what differs", in the order of kvtrace.hook.needs (of
    kvtrace.hook.sglang_needs for SGLang: "engine" is then "sglang", its one role "engine", and
    kvtrace's file connector does not apply)."""
    if (engine or engine_at(root)) == "sglang":
        return _check_sglang(root)
    src = SourceTree(root)
    version = src.version()
    roles = {role: plan.differences(targets, src) for role, targets in ROLES.items()}
    have = releases.forms(src)[0]
    connector = plan.differences(needs.FILE_CONNECTOR, src) + releases.forms(src, releases.CONNECTOR_ROWS)[1]
    if src.module("vllm") is None:
        roles = {role: ["vllm: no vLLM package here"] for role in roles}
        connector = ["vllm: no vLLM package here"]
    return {"version": version, "root": root, "supported": not any(roles.values()), "roles": roles,
            "connector": connector, "releases": have, "files": dict(src.files), "engine": "vllm"}


def _check_sglang(root: str) -> dict:
    src = SourceTree(root, "sglang")
    if src.module("sglang") is None:
        roles = {"engine": ["sglang: no SGLang package here"]}
    else:
        roles = {role: plan.differences(targets, src) for role, targets in SGLANG_ROLES.items()}
    return {"version": src.version(), "root": root, "supported": not roles["engine"], "roles": roles,
            "connector": ["kvtrace's file connector is a vLLM KV connector"], "releases": {},
            "files": dict(src.files), "engine": "sglang"}


def first(differences: list[str]) -> str:
    """One line: the first difference, and how many more there are."""
    if not differences:
        return ""
    more = len(differences) - 1
    return differences[0] + (f" (and {more} more)" if more else "")


def reason(verdict: dict, roles=("engine", "worker")) -> str:
    """Why the hook refuses this vLLM (empty when it does not), in one line."""
    bad = [d for r in roles for d in verdict["roles"].get(r, [])]
    return first(list(dict.fromkeys(bad)))


def check_vllm(root: str) -> dict:
    return check(root, "vllm")


def check_sglang(root: str) -> dict:
    return check(root, "sglang")
