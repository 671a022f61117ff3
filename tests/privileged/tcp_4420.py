"""A TCP connection to port 4420 between two network namespaces, accepted late (TCP_DEFER_ACCEPT:
the listener sends its SYN-ACK again) and with an outage that forces retransmissions; reports
what the kernel itself counted (Tcp RetransSegs of both namespaces) and what was sent.  Run by test_fabric.py under `kvtrace attach`.

    python tcp_4420.py --ns-a A --ns-b B --addr 10.99.0.2 --result out.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import time

SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)   # a bare final ACK waits: one SYN-ACK again at 1 s
s.bind((sys.argv[1], 4420)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(65536)
    if not b: break
    n += len(b)
c.close(); print(n, flush=True)
"""


def snmp(ns: str | None) -> dict[str, int]:
    """The TCP counters of namespace ``ns`` (None: the host's, PID 1's)."""
    out = {}
    for f in ("snmp", "netstat"):
        if ns is None:
            lines = open(f"/proc/1/net/{f}").read().splitlines()
        else:
            lines = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/proc/net/{f}"], capture_output=True, text=True,
                                   check=True).stdout.splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            p, names = head.split(":", 1)
            out.update({f"{p}.{k}": int(v) for k, v in zip(names.split(), vals.split(":", 1)[1].split())})
    return out


def setns(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns-a", required=True)
    ap.add_argument("--ns-b", required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--dev-b", default="v1")
    ap.add_argument("--outage", type=float, default=1.6)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    before = {ns: snmp(ns) for ns in (a.ns_a, a.ns_b, None)}
    server = subprocess.Popen(["ip", "netns", "exec", a.ns_b, sys.executable, "-c", SERVER, a.addr],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    setns(a.ns_a)
    c = socket.create_connection((a.addr, 4420), timeout=30)
    sport = c.getsockname()[1]
    time.sleep(2.0)                       # no data yet: the listener (TCP_DEFER_ACCEPT) sends its SYN-ACK again
    sent = 0
    payload = os.urandom(65536)
    c.sendall(payload)
    sent += len(payload)
    time.sleep(0.3)                       # delivered and acknowledged
    # a permanent neighbour entry: with the peer down the segments really go out (and are
    # dropped by the veth) instead of waiting for ARP, so each timeout is a real retransmission
    mac = json.loads(subprocess.run(["ip", "-n", a.ns_b, "-j", "link", "show", a.dev_b], capture_output=True,
                                    text=True, check=True).stdout)[0]["address"]
    subprocess.run(["ip", "-n", a.ns_a, "neigh", "replace", a.addr, "lladdr", mac, "dev", "v0", "nud", "permanent"], check=True)
    subprocess.run(["ip", "-n", a.ns_b, "link", "set", a.dev_b, "down"], check=True)
    c.sendall(b"x" * 1000)                # lost: retransmitted on timeout until the link is back
    sent += 1000
    time.sleep(a.outage)
    subprocess.run(["ip", "-n", a.ns_b, "link", "set", a.dev_b, "up"], check=True)
    c.shutdown(socket.SHUT_WR)
    got = int(server.stdout.readline())
    server.wait(30)
    c.close()
    time.sleep(0.2)
    after = {ns: snmp(ns) for ns in (a.ns_a, a.ns_b, None)}
    d = lambda k, nss=(a.ns_a, a.ns_b): sum(after[ns][k] - before[ns][k] for ns in nss)
    json.dump({"pid": os.getpid(), "sport": sport, "sent": sent, "received": got,
               "retrans_segs": d("Tcp.RetransSegs"), "loss_probes": d("TcpExt.TCPLossProbes"),
               "retrans_fail": d("TcpExt.TCPRetransFail"),
               "synack_retrans": d("TcpExt.TCPSynRetrans", (a.ns_b,)),   # B only listens: its SYN retransmits are SYN-ACKs
               # the host's own, in the same time: the kernel's skips of our program are not per namespace
               "host_retrans_segs": d("Tcp.RetransSegs", (None,))}, open(a.result, "w"))


if __name__ == "__main__":
    main()
