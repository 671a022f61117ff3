"""Network namespaces: the listening sockets of a process read from its own /proc/PID/net, and
the helpers that run work inside another process's namespace (the root part is in
tests/privileged/test_netns.py)."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from kvtrace.host import netns
from kvtrace.servers.procfs import _hex_addr, listening


@pytest.mark.parametrize("text, want", [
    ("0100007F:1F40", ("127.0.0.1", 8000)),
    ("00000000:15B5", ("0.0.0.0", 5557)),
    ("00000000000000000000000000000000:1F40", ("::", 8000)),
    ("00000000000000000000000001000000:0050", ("::1", 80)),
    ("0000000000000000FFFF00000100007F:15B5", ("127.0.0.1", 5557)),
])
def test_proc_net_addresses(text, want):
    assert _hex_addr(text) == want


def test_listening_names_this_process_sockets_only():
    with socket.socket() as s, socket.socket() as idle:
        s.bind(("127.0.0.1", 0))
        s.listen()
        idle.bind(("127.0.0.1", 0))    # bound, not listening
        port = s.getsockname()[1]
        got = listening(os.getpid())
        assert ("127.0.0.1", port) in got
        assert all(p != idle.getsockname()[1] for _, p in got)
    assert ("127.0.0.1", port) not in listening(os.getpid())


def test_own_namespace_is_not_foreign_and_call_runs_in_place():
    assert netns.foreign(os.getpid()) is None
    assert netns.ident(os.getpid()) == os.readlink("/proc/self/ns/net")
    assert netns.call(None, threading.get_ident) == threading.get_ident()


def test_call_hands_back_the_error_of_a_namespace_that_is_not_there():
    with pytest.raises(netns.NetnsError) as e:
        netns.call("/proc/0/ns/net", lambda: 1, timeout=5)
    assert "cannot open /proc/0/ns/net" in str(e.value) and "\n" not in str(e.value)
