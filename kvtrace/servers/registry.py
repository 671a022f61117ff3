"""The registry of server kinds, the way kvtrace.capture registers probes: one line per kind.
``kind(name)`` is the only way from a kind's name to what kvtrace does with it; an unknown name
is an error (UnknownServerKind), never taken for vLLM."""
from __future__ import annotations

from kvtrace.errors import DatasetError
from kvtrace.servers import sglang, vllm
from kvtrace.servers.kind import ServerKind

KINDS: dict[str, ServerKind] = {k.name: k for k in (vllm.KIND, sglang.KIND)}


class UnknownServerKind(DatasetError):
    """A server kind this kvtrace does not know (in a dataset written by a newer kvtrace): exit 6."""


def kind(name: str) -> ServerKind:
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownServerKind(f"unknown server kind {name!r}: this kvtrace knows {', '.join(sorted(KINDS))} "
                                "(a dataset written by a newer kvtrace needs that kvtrace)") from None


def names() -> list[str]:
    return list(KINDS)
