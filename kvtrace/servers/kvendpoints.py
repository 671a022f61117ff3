"""KV-events endpoints: what kvtrace connects to or binds for the endpoint vLLM was given, per
data-parallel rank, the replay address, and a reachability probe.

Split from kvtrace.servers.kvevents, which re-exports every name here.
"""
from __future__ import annotations

import ipaddress
import os
import socket


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (ZmqEventPublisher._is_bind_endpoint): it binds these, connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_endpoint(endpoint: str, host: str = "127.0.0.1", root: str | None = None,
                        publisher_binds: bool | None = None) -> tuple[str, bool]:
    """(address kvtrace uses, whether kvtrace must bind) for a publisher endpoint as vLLM was given it.

    vLLM binds ``tcp://*:P`` and ``ipc://`` endpoints (kvtrace connects, to ``host`` for ``*``);
    for ``tcp://host:P`` vLLM connects out, so kvtrace binds that address to receive.
    ``root`` (``/proc/PID/root``) reaches an ipc socket inside a container.
    ``publisher_binds``: SGLang's explicit ``bind`` setting, which overrides that rule.
    """
    if endpoint.startswith("inproc://"):
        raise ValueError(f"{endpoint} is in-process only: it cannot be subscribed to from outside vLLM")
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"unsupported KV-events endpoint {endpoint!r} (expected tcp:// or ipc://)")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return ("ipc://" + (root.rstrip("/") + path if root and path.startswith("/") else path)), False
    if vllm_binds(endpoint) if publisher_binds is None else publisher_binds:
        return endpoint.replace("*", host).replace("//0.0.0.0:", f"//{host}:"), False
    return endpoint, True


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank ``rank`` (vLLM adds the rank to the tcp port)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp") and sep and port.isdigit() and int(port) != 0:
        return f"{head}:{int(port) + rank}"
    return endpoint


def replay_address(endpoint: str, host: str = "127.0.0.1", root: str | None = None) -> str:
    """Where to connect for replay (vLLM always binds the replay ROUTER)."""
    if endpoint.startswith("ipc://"):
        return subscriber_endpoint(endpoint, host, root)[0]
    return endpoint.replace("*", host)


def tcp_hostport(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    if host.startswith("::ffff:") and host.count(".") == 3:
        host = host[len("::ffff:"):]
    return host, int(port)


WILDCARDS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def bind_address(endpoint: str) -> tuple[str, str | None]:
    """(the tcp address kvtrace binds for ``endpoint``, a warning line or None).

    Never a wildcard: a publisher connecting out to 0.0.0.0 (or ::) reaches this host's
    loopback, so that is what kvtrace binds.  A hostname is resolved (IPv4 unless an IPv6
    literal, as ZeroMQ does).  Any address not on loopback gets one warning line."""
    hp = tcp_hostport(endpoint)
    if hp is None:
        return endpoint, None
    host, port = hp
    if host in WILDCARDS:
        ip = WILDCARDS[host]
        return _tcp(ip, port), (f"KV events: the server connects out to {host or '*'}:{port}, which lands on loopback: "
                                f"kvtrace listens on {_hp(ip, port)} only, never on a wildcard address")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ip = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        return endpoint, None
    if ipaddress.ip_address(ip).is_loopback:
        return _tcp(ip, port), None
    return _tcp(ip, port), (f"KV events: kvtrace listens on {_hp(ip, port)}, not loopback, because the server "
                            "connects out there; it accepts only the server's own processes, every other connection "
                            "is closed unread and counted (kv_events rejected_peers)")


def _hp(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tcp(host: str, port: int) -> str:
    return f"tcp://{_hp(host, port)}"


def probe(endpoint: str, timeout: float = 1.0) -> str | None:
    """A reason the publisher at a (vLLM-bound) endpoint is unreachable, or None."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return None if os.path.exists(path) else f"no socket at {path}"
    hp = tcp_hostport(endpoint)
    if hp is None:
        return f"cannot parse {endpoint}"
    try:
        with socket.create_connection(hp, timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)
