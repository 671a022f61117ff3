"""Whether a SGLang (its source tree) supports the hook: the verdict ``kvtrace servers``,
``doctor`` and ``attach`` give for a server before touching it, and that attach hands to the
hook it injects (which then only checks that the files read are unchanged).  SGLang's
descriptor (kvtrace.servers.sglang) names ``check``.  Standard library only.
"""
from __future__ import annotations

from .. import plan
from ..source import SourceTree
from . import needs

ROLES = {"engine": needs.METHODS + needs.READS}


def check(root: str) -> dict:
    """The verdict for the SGLang under ``root`` (the directory holding ``sglang/``), of the form
    of kvtrace.hook.support: its one role "engine" (the scheduler), the differences in the order
    of kvtrace.hook.sglang.needs; kvtrace's file connector does not apply."""
    src = SourceTree(root, "sglang")
    if src.module("sglang") is None:
        roles = {"engine": ["sglang: no SGLang package here"]}
    else:
        roles = {role: plan.differences(targets, src) for role, targets in ROLES.items()}
    return {"version": src.version(), "root": root, "supported": not roles["engine"], "roles": roles,
            "connector": ["kvtrace's file connector is a vLLM KV connector"], "releases": {},
            "files": dict(src.files), "kind": "sglang"}
