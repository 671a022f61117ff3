"""The gate that keeps tcp:tcp_probe off until a connection is on a watched port, on a
/proc tree made here and a stand-in for bcc's attach calls."""
import os

from kvtrace.capture import tcp
from kvtrace.capture.events import DecodeContext
from kvtrace.fabric import tcpgate
from tests.bpf_reference import TcpReference

HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def fake_proc(root, tables: dict[str, dict[str, str]]):
    """One process per network namespace: tables[pid] = {"tcp": text, "tcp6": text}; each pid's
    ns/net is a file of its own (its inode stands for the namespace)."""
    for pid, t in tables.items():
        (root / pid / "ns").mkdir(parents=True)
        (root / pid / "ns" / "net").write_text(pid)
        (root / pid / "net").mkdir()
        for name, text in t.items():
            (root / pid / "net" / name).write_text(HEAD + text)
    (root / "self").mkdir()
    return str(root)


LISTEN_4420 = "   0: 0100000A:1144 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 0 1\n"
CLIENT_TO_4420 = ("   0: 0200000A:9C40 0100000A:1144 01 00000000:00000000 00:00000000 00000000     0        0 0 1\n")
HTTP = "   0: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 0 1\n"
V6_4420 = ("   0: 00000000000000000000000000000000:1144 00000000000000000000000000000000:0000 0A "
           "00000000:00000000 00:00000000 00000000     0        0 0 1\n")


def test_sockets_on_any_namespace_either_end(tmp_path):
    assert not tcpgate.sockets_on([4420], fake_proc(tmp_path / "a", {"1": {"tcp": HTTP}}))
    assert tcpgate.sockets_on([4420], fake_proc(tmp_path / "b", {"1": {"tcp": HTTP}, "7": {"tcp": LISTEN_4420}}))
    assert tcpgate.sockets_on([4420], fake_proc(tmp_path / "c", {"1": {"tcp": CLIENT_TO_4420}}))
    assert tcpgate.sockets_on([4420], fake_proc(tmp_path / "d", {"1": {"tcp": "", "tcp6": V6_4420}}))
    assert tcpgate.sockets_on([8080], fake_proc(tmp_path / "e", {"1": {"tcp": HTTP}}))
    assert not tcpgate.sockets_on([4420], fake_proc(tmp_path / "f", {"1": {}}))   # no tables: nothing to find


class FakeBPF:
    def __init__(self, fail_attach=False):
        self.calls = []
        self.fail_attach = fail_attach

    def detach_tracepoint(self, tp):
        self.calls.append(("detach", tp))

    def attach_tracepoint(self, tp, fn_name):
        if self.fail_attach:
            raise Exception("attach failed")
        self.calls.append(("attach", tp, fn_name))


def test_gate_detaches_then_attaches_once_on_the_first_tcp_event(tmp_path):
    proc = fake_proc(tmp_path, {"1": {"tcp": HTTP}})
    bpf = FakeBPF()
    gate = tcpgate.TcpProbeGate(bpf, [4420], proc)
    assert bpf.calls == [("detach", b"tcp:tcp_probe")] and gate.stats() == {"attached": False, "attached_ns": 0, "errors": 0}
    ctx = DecodeContext(tcp_seen=gate.wake)
    tcp.decode([], ctx)                      # no event: still off
    assert len(bpf.calls) == 1
    ref = TcpReference()
    ref.feed("inet_sock_set_state", {"protocol": 6, "skaddr": 1, "oldstate": 7, "newstate": 10, "sport": 4420,
                                      "dport": 0, "family": 2, "saddr": [10, 0, 0, 1], "daddr": [0, 0, 0, 0],
                                      "saddr_v6": [0] * 16, "daddr_v6": [0] * 16}, 5)
    assert tcp.decode(ref.events, ctx).num_rows == 1
    tcp.decode(ref.events, ctx)
    assert bpf.calls[1:] == [("attach", b"tcp:tcp_probe", b"tracepoint__tcp__tcp_probe")]
    s = gate.stats()
    assert s["attached"] and s["attached_ns"] > 0 and s["errors"] == 0


def test_gate_leaves_it_attached_when_a_socket_exists_and_counts_failures(tmp_path):
    bpf = FakeBPF()
    gate = tcpgate.TcpProbeGate(bpf, [4420], fake_proc(tmp_path / "a", {"1": {"tcp": LISTEN_4420}}))
    assert bpf.calls == [] and gate.attached and gate.attached_ns == 0
    gate.wake()
    assert bpf.calls == []
    gate = tcpgate.TcpProbeGate(FakeBPF(), [4420], str(tmp_path / "no-proc"))   # cannot tell: left on
    assert gate.attached and gate.bpf.calls == []
    bad = FakeBPF(fail_attach=True)
    gate = tcpgate.TcpProbeGate(bad, [4420], fake_proc(tmp_path / "b", {"1": {"tcp": HTTP}}))
    gate.wake()
    gate.wake()
    assert gate.stats() == {"attached": False, "attached_ns": 0, "errors": 2}
