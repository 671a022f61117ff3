"""Whether a vLLM (its source tree) supports the hook, role by role, and kvtrace's file
connector: the verdict ``kvtrace servers``, ``doctor`` and ``attach`` give for a server before
touching it, and that attach hands to the hook it injects.  The hook then only checks that the
files read are still the same ones (their sizes and times) and its wrapped methods on the
imported classes, instead of parsing vLLM's source while the server waits.  vLLM's descriptor
(kvtrace.servers.vllm) names ``check``.  Standard library only.
"""
from __future__ import annotations

from .. import plan
from ..source import SourceTree
from . import needs, releases

ROLES = {"engine": needs.ENGINE_METHODS + needs.ENGINE_READS, "worker": needs.WORKER_METHODS + needs.WORKER_READS}


def check(root: str) -> dict:
    """The verdict for the vLLM under ``root`` (the directory holding ``vllm/``)::

        {"version": "0.32.0" or None, "root": root, "supported": bool, "kind": "vllm",
         "roles": {"engine": [differences], "worker": [...]}, "connector": [...],
         "releases": {row: newer form present}, "files": {path: [size, mtime_ns]}}

    A difference reads "target: what differs", in the order of kvtrace.hook.vllm.needs."""
    src = SourceTree(root)
    version = src.version()
    roles = {role: plan.differences(targets, src) for role, targets in ROLES.items()}
    have = releases.forms(src)[0]
    connector = plan.differences(needs.FILE_CONNECTOR, src) + releases.forms(src, releases.CONNECTOR_ROWS)[1]
    if src.module("vllm") is None:
        roles = {role: ["vllm: no vLLM package here"] for role in roles}
        connector = ["vllm: no vLLM package here"]
    return {"version": version, "root": root, "supported": not any(roles.values()), "roles": roles,
            "connector": connector, "releases": have, "files": dict(src.files), "kind": "vllm"}
