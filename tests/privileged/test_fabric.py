"""The storage-fabric side with real kernels and devices (root):

* every probe, nvme/tcp/rdma included, compiles against the 4.19-era, 5.15, 6.1 and 6.18
  tracepoint layouts and passes this kernel's verifier (formats laid over tracefs in a
  private mount namespace; nothing is attached);
* capture on this machine (no NVMe, no RDMA drivers) reports those probes absent and
  loses nothing: block and file rows still equal the kernel's own account;
* link stats64 (netlink) and ethtool statistics of a real veth pair in namespaces the test
  creates equal the kernel's own numbers (`ip -s -j link`, the raw SIOCETHTOOL ioctl);
* the tcp probe sees a real connection to port 4420: its states, RTT samples, and
  exactly the retransmissions the kernel counted.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.fabric import counters
from tests.conftest import run_kvtrace
from tests.privileged.conftest import disk_stat

pytestmark = pytest.mark.root
HERE = Path(__file__).resolve().parent
PY = sys.executable


def sh(*cmd, **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


@pytest.mark.parametrize("kernel", ["4.19", "5.15", "6.1", "6.18"])
def test_probes_compile_and_verify_against_each_kernels_layouts(kernel):
    out = subprocess.run(["unshare", "-m", "--propagation", "private", PY, str(HERE / "verify_layouts.py"), kernel],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    want = {"nvme"} if kernel == "4.19" else {"nvme", "tcp", "rdma"}   # the 4.19 fixture holds nvme formats only
    assert want <= set(r["attached"])
    progs = set(r["verified"])
    assert {"tracepoint__nvme__nvme_setup_cmd", "tracepoint__nvme__nvme_complete_rq", "tracepoint__nvme__nvme_sq",
            "tracepoint__nvme__nvme_async_event"} <= progs
    assert ("-DKV_NVME_HAVE_FCTYPE" in r["cflags"]) is (kernel != "4.19")
    if kernel != "4.19":
        assert {"tracepoint__tcp__tcp_retransmit_skb", "tracepoint__tcp__tcp_probe", "tracepoint__sock__inet_sock_set_state",
                "tracepoint__rdma_cma__cm_event_handler", "tracepoint__rdma_core__cq_poll"} <= progs
        assert ("-DKV_TCP_PROBE_SKADDR" in r["cflags"]) is (kernel == "6.18")
    assert not os.path.isdir("/sys/kernel/tracing/events/nvme")  # the host's tracefs is untouched
    # the user-space side against the loaded program's real maps
    m = r["maps"]
    assert m["cfg"] == [5_000_000, 1000, 0]          # 20000 events/s over 2 CPUs = 1000 per CPU per 100 ms
    assert m["ns"] == [[0, 1, 0, 259 << 20, 12], [1, 1, 0, 259 << 20, 12], [2, 1, (259 << 20) | 2, 0, 9]]
    assert m["qdepth"] == [[2, 1024]]
    assert m["queue"] == [["nvme0", "tcp", 2, "read", 4, 16384, "1"]] and m["hist"] == [[17, 4]] and m["epoch"] == 1
    if kernel != "4.19":
        assert m["tcp_ports"] == [4420]


def test_capture_here_reports_nvme_and_rdma_absent_and_loses_nothing(tmp_path, loopdev):
    chunk, count = 131072, 32
    before = disk_stat(loopdev)
    out, result = tmp_path / "ds", tmp_path / "r.json"
    p = run_kvtrace("attach", "--quiet", "--out", str(out), "--", PY, "-m", "kvtrace.demo.io", "direct",
                    "--path", loopdev, "--chunk", str(chunk), "--count", str(count), "--result", str(result), timeout=300)
    assert p.returncode == 0, p.stderr
    after = disk_stat(loopdev)
    truth = json.loads(result.read_text())
    assert "probe nvme skipped: nvme:nvme_setup_cmd/nvme_complete_rq not in this kernel" in p.stderr
    assert "probe rdma skipped: rdma_cma and rdma_core tracepoints not in this kernel" in p.stderr
    assert "kvtrace: fabric: tcp ports 4420 (RTT samples from the first connection on one); 0 NVMe controllers; no RDMA devices" in p.stderr
    ds = Dataset.open(out)
    (run,) = ds.runs()
    assert "nvme" in run["probes_skipped"] and "rdma" in run["probes_skipped"]
    assert "tcp" in run["probes_attached"] and "nvme" not in run["probes_attached"]
    assert run["lost_events"] == {} and run["dropped_events"] == 0 and run["status"] == "complete"
    sidecars = {s["name"]: s for s in json.loads(run["sidecars"])}
    assert sidecars["nvme_topology"]["controllers"] == 0
    # no socket on 4420 here: tcp:tcp_probe never ran on this host's segments
    assert sidecars["tcp_probe_gate"] == {"name": "tcp_probe_gate", "attached": False, "attached_ns": 0, "errors": 0}
    block = [r for r in ds.table("block_io").to_pylist() if r["disk"] == os.path.basename(loopdev)]
    assert len(block) == count == after["reads"] - before["reads"]
    assert sum(r["bytes"] for r in block) == truth["bytes"] == (after["read_sectors"] - before["read_sectors"]) * 512
    assert all(r["pid"] == truth["pid"] for r in block)
    assert not {"nvme_cmd", "nvme_queue", "rdma_events", "nic_counters"} & set(ds.names())


class Netns:
    """Two network namespaces joined by a veth pair (v0 in A, v1 in B), IPv6 off so nothing
    talks unless the test does; removed afterwards."""

    def __init__(self, tag: str):
        self.a, self.b = f"kvt{tag}a", f"kvt{tag}b"
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
               "net.ipv6.conf.default.disable_ipv6=1")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.a, "link", "add", "v0", "type", "veth", "peer", "name", "v1", "netns", self.b)
        sh("ip", "-n", self.a, "addr", "add", "10.99.0.1/24", "dev", "v0")
        sh("ip", "-n", self.b, "addr", "add", "10.99.0.2/24", "dev", "v1")
        sh("ip", "-n", self.a, "link", "set", "v0", "up")
        sh("ip", "-n", self.b, "link", "set", "v1", "up")

    def run(self, ns, *cmd, **kw):
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True, text=True, **kw).stdout

    def link(self, ns, dev) -> dict:
        (j,) = json.loads(sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev))
        s = j["stats64"]
        return {"rx_bytes": s["rx"]["bytes"], "rx_packets": s["rx"]["packets"], "rx_dropped": s["rx"]["dropped"],
                "tx_bytes": s["tx"]["bytes"], "tx_packets": s["tx"]["packets"], "tx_dropped": s["tx"]["dropped"]}

    def ethtool(self, ns, dev) -> dict:
        return json.loads(self.run(ns, PY, str(HERE / "ethtool_raw.py"), dev))

    def close(self):
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def netns():
    n = Netns(str(os.getpid() % 100000))
    try:
        yield n
    finally:
        n.close()


UDP_SEND = ("import socket,sys,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            "for i in range(int(sys.argv[1])):\n s.sendto(b'k'*int(sys.argv[2]),('10.99.0.2',9999))\n"
            " if i % 50 == 49: time.sleep(0.01)\n")
UDP_RECV = ("import socket,sys\nr=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); r.setsockopt(socket.SOL_SOCKET, 33, 1<<22)\n"
            "r.bind(('10.99.0.2',9999)); r.settimeout(10)\n"
            "print('ready',flush=True)\nn=0\nwhile n<int(sys.argv[1]):\n r.recv(65536); n+=1\nprint(n,flush=True)\n")


def test_link_stats64_and_ethtool_deltas_equal_the_kernels_own(netns):
    # NAPI on v1's receive path (GRO + UDP GRO forwarding), so veth's per-queue ethtool counters move too
    netns.run(netns.b, PY, "-c", "from pyroute2.ethtool import Ethtool\ne=Ethtool(); f=e.get_features('v1')\n"
              "f.features['rx-gro'].enable=True; f.features['rx-udp-gro-forwarding'].enable=True; e.set_features('v1', f)")
    netns.run(netns.a, PY, "-c", UDP_SEND, "1", "100")   # resolve ARP before anything is measured
    time.sleep(0.3)
    poller = counters.NicPoller(interval=0.05, rdma=False, ifaces=["v1"], netns=netns.b, link_interval=0.05, full_every=3600)
    assert poller.start() == []
    link0, eth0 = netns.link(netns.b, "v1"), netns.ethtool(netns.b, "v1")
    n, size = 300, 700
    recv = subprocess.Popen(["ip", "netns", "exec", netns.b, PY, "-c", UDP_RECV, str(n)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    netns.run(netns.a, PY, "-c", UDP_SEND, str(n), str(size))
    assert recv.stdout.readline().strip() == str(n)
    recv.wait(10)
    time.sleep(0.3)
    poller.close()   # one last full poll
    link1, eth1 = netns.link(netns.b, "v1"), netns.ethtool(netns.b, "v1")
    rows = poller.drain()[counters.TABLE].to_pylist()
    assert poller.stats()["error"] is None and poller.stats()["polls"] >= 5

    def our(source, name):
        d = [r for r in rows if (r["source"], r["name"]) == (source, name)]
        return sum(r["delta"] or 0 for r in d), d[-1]["value"]

    # link stats64 over netlink: the sum of our deltas is the kernel's delta, our last value its value
    for k in ("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_dropped", "tx_dropped"):
        assert our("link", k) == (link1[k] - link0[k], link1[k]), k
    assert link1["rx_packets"] - link0["rx_packets"] == n
    # ethtool statistics through pyroute2 = the raw ioctl's, value for value and delta for delta
    for k, v in eth1.items():
        if k == "peer_ifindex":
            continue
        assert our("ethtool", k) == (v - eth0[k], v), k
    assert eth1["rx_queue_0_xdp_packets"] - eth0["rx_queue_0_xdp_packets"] == n
    assert our("ethtool", "rx_queue_0_xdp_bytes")[0] == n * (size + 28)   # IP + UDP headers, no Ethernet
    print(f"veth v1: {n} packets; link rx_bytes +{link1['rx_bytes'] - link0['rx_bytes']}, "
          f"ethtool rx_queue_0_xdp_bytes +{eth1['rx_queue_0_xdp_bytes'] - eth0['rx_queue_0_xdp_bytes']}; {len(rows)} rows")


def test_nvme_tcp_port_states_rtt_and_retransmits(tmp_path, netns):
    netns.run(netns.a, "sysctl", "-qw", "net.ipv4.tcp_early_retrans=0")   # no tail loss probes: every retransmission is one
    out, result = tmp_path / "ds", tmp_path / "tcp.json"
    p = run_kvtrace("attach", "--quiet", "--out", str(out), "--nvme-tcp-port", "4420", "--nic", "v0", "--nic-netns", netns.a,
                    "--nic-interval", "0.05", "--", PY, str(HERE / "tcp_4420.py"), "--ns-a", netns.a, "--ns-b", netns.b,
                    "--addr", "10.99.0.2", "--result", str(result), timeout=300)
    assert p.returncode == 0, p.stderr
    truth = json.loads(result.read_text())
    assert truth["received"] == truth["sent"] == 66536
    ds = Dataset.open(out)
    conn = f"10.99.0.1:{truth['sport']}->10.99.0.2:4420"
    rows = [r for r in ds.table("tcp_events").to_pylist() if r["sport"] in (truth["sport"], 4420) and r["dport"] in (truth["sport"], 4420)]
    client = [r for r in rows if r["conn"] == conn]
    # the socket is the connection: CLOSE -> SYN_SENT happens before the local port is chosen (sport 0)
    (sk,) = {r["skaddr"] for r in client if r["event"] == "state" and r["newstate"] == "ESTABLISHED"}
    states = [(r["state"], r["newstate"]) for r in ds.table("tcp_events").to_pylist() if r["skaddr"] == sk and r["event"] == "state"]
    assert states[:2] == [("CLOSE", "SYN_SENT"), ("SYN_SENT", "ESTABLISHED")]
    assert ("ESTABLISHED", "FIN_WAIT1") in states
    probes = [r for r in rows if r["event"] == "probe"]
    assert probes and all(r["srtt_us"] > 0 and r["snd_cwnd"] > 0 for r in probes)
    # a retransmission the kernel counts in RetransSegs: sent (err 0), dropped below TCP (err > 0,
    # NET_XMIT_DROP while the link goes down) or failed on the way out (other errors); not one it
    # gave up on before counting: still queued (EBUSY), no window (EAGAIN), no memory to trim or
    # split it (ENOMEM), no route (EHOSTUNREACH), already acknowledged (EINVAL)
    not_counted = (-16, -11, -12, -113, -22)
    retrans = [r for r in rows if r["event"] == "retransmit" and r["err"] not in not_counted]
    synacks = [r for r in rows if r["event"] == "synack_retransmit"]
    (run,) = ds.runs()
    # tcp:tcp_probe was attached once the connection's first events were decoded, and only then
    gate = {x["name"]: x for x in json.loads(run["sidecars"])}["tcp_probe_gate"]
    assert gate["attached"] and gate["errors"] == 0
    every = ds.table("tcp_events").to_pylist()
    assert min(r["ts_ns"] for r in every) < gate["attached_ns"] <= min(r["ts_ns"] for r in every if r["event"] == "probe")
    # the listener's SYN-ACKs again: what namespace B counted (TCPSynRetrans), at least the one
    # of the deferred accept, from the listener to the client's port
    skips = run["kernel_skips"]
    assert truth["synack_retrans"] >= 1 and len(synacks) + skips.get("tcp:tcp_retransmit_synack", 0) >= truth["synack_retrans"]
    assert all((r["sport"], r["dport"], r["state"]) == (4420, truth["sport"], "NEW_SYN_RECV") for r in synacks)
    # segments and SYN-ACKs: what the kernel counted in both namespaces (RetransSegs; at least the
    # timeouts of the outage), less the retransmissions it did not run our program for because
    # another BPF program held the CPU (a syscall program interrupted by the timer softirq): the
    # run row counts those, exactly when no other retransmission happened meanwhile (the skips
    # are not per namespace)
    skipped = skips.get("tcp:tcp_retransmit_skb", 0) + skips.get("tcp:tcp_retransmit_synack", 0)
    missing = truth["retrans_segs"] - len(retrans) - len(synacks)
    assert truth["retrans_segs"] >= 3 and missing <= skipped <= missing + truth["host_retrans_segs"], (
        f"retransmits (state, err) {[(r['state'], r['err']) for r in rows if r['event'] == 'retransmit']}, "
        f"{len(synacks)} SYN-ACKs, skips {skips}, kernel {json.dumps(truth)}")
    failed = [r for r in rows if r["event"] == "retransmit" and r["err"] not in (0, -16)]   # -EBUSY is not counted
    assert len(failed) == truth["retrans_fail"]
    assert all(r["conn"] == conn for r in retrans)
    outage = [r for r in retrans if r["state"] == "ESTABLISHED"]
    gaps = [b["ts_ns"] - a["ts_ns"] for a, b in zip(outage, outage[1:])]
    assert len(outage) >= 2 - skips.get("tcp:tcp_retransmit_skb", 0) and all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:]))   # the RTO backs off
    assert not any(run["lost_events"].values()), run["lost_events"]
    # the --nic options: v0's link stats in namespace A were polled and moved
    nic = [r for r in ds.table("nic_counters").to_pylist() if r["device"] == "v0" and r["source"] == "link"]
    assert sum(r["delta"] or 0 for r in nic if r["name"] == "tx_bytes") >= truth["sent"]
    print(f"tcp 4420: {len(client)} client events, {len(probes)} RTT samples, {len(retrans)} retransmits "
          f"(err {dict(collections.Counter(r['err'] for r in retrans))}) "
          f"+ {len(synacks)} SYN-ACKs + {skipped} skipped by the kernel = its RetransSegs {truth['retrans_segs']}")


FAKE_LIBS = {
    "libucp.so.0": r"""
#include <stddef.h>
void *ucp_put_nbx(void *ep, const void *buf, size_t count, unsigned long remote, void *rkey, const void *p) { return 0; }
void *ucp_get_nbx(void *ep, void *buf, size_t count, unsigned long remote, void *rkey, const void *p) { return 0; }
""",
    "libcufile.so.0": r"""
#include <stddef.h>
#include <sys/types.h>
ssize_t cuFileRead(void *fh, void *dev, size_t size, off_t off, off_t devoff) { return (ssize_t)size; }
ssize_t cuFileWrite(void *fh, const void *dev, size_t size, off_t off, off_t devoff) { return -5; }
""",
}
DRIVER = r"""
import ctypes, json, os, sys, threading
ucp, cuf = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])
for f in (ucp.ucp_put_nbx, ucp.ucp_get_nbx):
    f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p]
for f in (cuf.cuFileRead, cuf.cuFileWrite):
    f.restype, f.argtypes = ctypes.c_ssize_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_long]
puts = [(4096 * (i + 1), 0x7f0000000000 + i * 0x10000) for i in range(10)]
for n, remote in puts:
    ucp.ucp_put_nbx(None, None, n, remote, None, None)
for i in range(5):
    ucp.ucp_get_nbx(None, None, 65536, 0x7e0000000000, None, None)
reads = [(1 << 20, i << 20) for i in range(3)]
for n, off in reads:
    assert cuf.cuFileRead(None, None, n, off, 0) == n
assert cuf.cuFileWrite(None, None, 8192, 0, 0) == -5
json.dump({"pid": os.getpid(), "tid": threading.get_native_id(), "puts": puts, "reads": reads}, open(sys.argv[3], "w"))
"""


def test_uprobes_on_ucx_and_cufile_entry_points(tmp_path):
    """Kernel-bypass transfers are invisible to tracepoints; --uprobe sees the library calls."""
    libs = {}
    for name, src in FAKE_LIBS.items():
        c = tmp_path / f"{name}.c"
        c.write_text(src)
        libs[name] = tmp_path / name
        sh("gcc", "-shared", "-fPIC", "-O2", "-o", str(libs[name]), str(c))
    out, result = tmp_path / "ds", tmp_path / "r.json"
    p = run_kvtrace("attach", "--quiet", "--out", str(out), "--no-nic", "--uprobe", f"ucx={libs['libucp.so.0']}",
                    "--uprobe", f"cufile={libs['libcufile.so.0']}", "--", PY, "-c", DRIVER,
                    str(libs["libucp.so.0"]), str(libs["libcufile.so.0"]), str(result), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "uprobes on ucx" in p.stderr and "uprobes on cufile" in p.stderr
    truth = json.loads(result.read_text())
    rows = Dataset.open(out).table("ulib_calls").to_pylist()
    by = lambda f: [r for r in rows if r["func"] == f]
    assert [(r["bytes"], r["arg"]) for r in by("ucp_put_nbx")] == [tuple(x) for x in truth["puts"]]
    assert [r["bytes"] for r in by("ucp_get_nbx")] == [65536] * 5
    assert [(r["bytes"], r["arg"], r["ret"]) for r in by("cuFileRead")] == [(n, off, n) for n, off in truth["reads"]]
    assert [(r["bytes"], r["ret"]) for r in by("cuFileWrite")] == [(8192, -5)]
    assert all(r["pid"] == truth["pid"] and r["tid"] == truth["tid"] and r["latency_ns"] > 0 for r in rows)
    assert {r["lib"] for r in rows} == {"ucx", "cufile"} and len(rows) == 19
