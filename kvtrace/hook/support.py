"""What every server kind's support check shares: the one line that says why the hook refuses
a server.  Each kind's check is its package's ``support.check(root)`` (kvtrace.hook.vllm.support,
kvtrace.hook.sglang.support), named by its descriptor (kvtrace.servers.kind), and gives a
verdict of one form::

    {"version": "0.32.0" or None, "root": root, "supported": bool, "kind": "vllm",
     "roles": {role: [differences]}, "connector": [...], "releases": {row: newer form present},
     "files": {path: [size, mtime_ns]}}

Standard library only.
"""
from __future__ import annotations


def first(differences: list[str]) -> str:
    """One line: the first difference, and how many more there are."""
    if not differences:
        return ""
    more = len(differences) - 1
    return differences[0] + (f" (and {more} more)" if more else "")


def reason(verdict: dict, roles=("engine", "worker")) -> str:
    """Why the hook refuses this server (empty when it does not), in one line."""
    bad = [d for r in roles for d in verdict["roles"].get(r, [])]
    return first(list(dict.fromkeys(bad)))
