"""The rules of probes/nvme.bpf.c, tcp.bpf.c and rdma.bpf.c written again in Python, for tests.

Each class takes tracepoint records decoded by their format (``kvtrace.capture.tpformat``) through
``feed(event, fields, ts, ...)`` and collects in ``events`` the records the BPF program would
have emitted (decode them with the probe's decoder).  The unit tests drive them with records
laid out for several kernels; tests/privileged/test_bpf_reference.py checks the real tcp
probe against TcpReference on records this kernel wrote.  NvmeReference and RdmaReference
are only checked against the kernel where those tracepoints fire (the lab, see its report).
"""
from __future__ import annotations

import numpy as np

from kvtrace.capture import nvme, rdma, tcp


class NvmeReference:
    """nvme.bpf.c's rules in Python, over tracepoint records decoded by their format.

    ``feed(event, fields, ts, pid=0, tid=0, comm="")`` takes one record (``fields`` as
    ``tpformat.Format.decode`` returns them); ``events`` collects the kv_nvme_event records
    the BPF program would have emitted, ``qstats``, ``hist`` and ``lbafix`` the map contents.
    ``ns`` maps (ctrl_id, nsid) to (dev1, dev2, lba_shift); ``block`` maps (dev, sector) to
    (tgid, tid, comm) like blockio's block_start.
    """

    def __init__(self, mode: str = "all", budget: int = 1000, slow_ns: int = 0, ns=None, block=None, qdepth=None):
        self.mode, self.budget, self.slow_ns = nvme.MODES[mode], budget, slow_ns
        self.ns = ns or {}
        self.block = block or {}
        self.qdepth = qdepth or {}
        self.start: dict[tuple, dict] = {}
        self.qstats: dict[tuple, dict] = {}
        self.hist: dict[tuple, int] = {}
        self.lbafix: dict[tuple, int] = {}   # nvme_lbafix: (ctrl, nsid, qid, opclass) -> blocks
        self.sqocc: dict[tuple, int] = {}
        self.events: list[bytes] = []
        self.rate = {"win_start": 0, "seen": 0, "shift": 0}

    def _q(self, ctrl, qid, opclass) -> dict:
        return self.qstats.setdefault((ctrl, qid, opclass), dict.fromkeys(
            ("setups", "completions", "bytes", "latency_ns", "errors", "retried", "unmatched",
             "unseen", "sq_samples", "sq_occ_sum", "sq_occ_max"), 0))

    def feed(self, event: str, f: dict, ts: int, pid: int = 0, tid: int = 0, comm: str = "", cpu: int = 0) -> None:
        getattr(self, "_" + event)(f, ts, pid, tid, comm, cpu)

    def _nvme_setup_cmd(self, f, ts, pid, tid, comm, cpu):
        qid, opcode = f["qid"], f["opcode"]
        if qid == 0 and opcode == 0x0C:
            return
        key = (f["ctrl_id"], qid, f["cid"] & 0xFFF)
        s = dict(ts=ts, cid=f["cid"], opcode=opcode, flags=f["flags"], fctype=f.get("fctype", 0xFF), nsid=f["nsid"],
                 setup_tid=tid, slba=0, nlb=0, bytes=0, issuer=0, xflags=0, tgid=0, tid=0, comm=b"")
        shift, ns = 9, None
        if qid != 0 and opcode in nvme.LBA_OPCODES:
            cdw = bytes(f["cdw10"])
            s["slba"] = int.from_bytes(cdw[0:8], "little")
            s["nlb"] = (cdw[8] | cdw[9] << 8) + 1
            ns = self.ns.get((f["ctrl_id"], f["nsid"]))
            if ns and 9 <= ns[2] <= 16:
                shift = ns[2]
            else:
                s["xflags"] |= nvme.X_NS_UNKNOWN
            if opcode in nvme.DATA_OPCODES:
                s["bytes"] = (s["nlb"] << shift) & 0xFFFFFFFF
        if ns:
            hit = self.block.get((ns[0], s["slba"] << (shift - 9)))
            if hit is None and ns[1]:
                hit = self.block.get((ns[1], s["slba"] << (shift - 9)))
            if hit:
                s["tgid"], s["tid"], s["comm"], s["issuer"] = hit[0], hit[1], hit[2].encode(), 1
        if not s["issuer"]:
            s["tgid"], s["tid"], s["comm"], s["issuer"] = pid, tid, comm.encode(), 2
        prev = self.start.get(key)
        if prev is not None:   # the tag set up again: its previous command ended unseen
            oc = nvme.opclass_of(qid, prev["opcode"])
            self._count(key, prev, oc, 0, 0, 0, seen=False)
            self.events.append(nvme.command_event(key, prev, ts, oc, nvme.REC_UNSEEN, 1, cpu).tobytes())
        self.start[key] = s
        self._q(key[0], qid, nvme.opclass_of(qid, opcode))["setups"] += 1

    def _count(self, key, s, opclass, status, retries, lat, seen=True):
        q = self._q(key[0], key[1], opclass)
        q["completions"] += 1
        if seen:
            q["latency_ns"] += lat
        else:
            q["unseen"] += 1
        if status == 0:
            q["bytes"] += s["bytes"]
            if s["xflags"] & nvme.X_NS_UNKNOWN and s["bytes"]:
                fk = (key[0], s["nsid"], key[1], opclass)
                self.lbafix[fk] = self.lbafix.get(fk, 0) + s["nlb"]
        else:
            q["errors"] += 1
        if retries:
            q["retried"] += 1


    def _sample(self, now, lat, status, retries) -> int:
        forced = status != 0 or retries != 0 or (self.slow_ns and lat >= self.slow_ns)
        if self.mode == nvme.MODES["all"]:
            return 1
        r = self.rate
        if now - r["win_start"] >= nvme.WINDOW_NS:
            s = 0
            for _ in range(nvme.MAX_SHIFT):
                if (r["seen"] >> s) > self.budget:
                    s += 1
            r.update(shift=s, seen=0, win_start=now)
        r["seen"] = (r["seen"] + 1) & 0xFFFFFFFF
        if (r["seen"] >> r["shift"]) > 2 * self.budget and r["shift"] < nvme.MAX_SHIFT:
            r["shift"] += 1
        if forced:
            return 1
        if self.mode == nvme.MODES["none"]:
            return 0
        if r["seen"] & ((1 << r["shift"]) - 1):
            return 0
        return 1 << r["shift"]

    def _nvme_complete_rq(self, f, ts, pid, tid, comm, cpu):
        key = (f["ctrl_id"], f["qid"], f["cid"] & 0xFFF)
        s = self.start.pop(key, None)
        if s is None:
            self._q(key[0], key[1], nvme.OP_UNKNOWN)["unmatched"] += 1
            return
        lat = ts - s["ts"]
        status, retries = f["status"], f["retries"]
        opclass = nvme.opclass_of(key[1], s["opcode"])
        self._count(key, s, opclass, status, retries, lat)
        slot = lat.bit_length() if lat > 0 else 0
        self.hist[(key[0], key[1], opclass, slot)] = self.hist.get((key[0], key[1], opclass, slot), 0) + 1
        weight = self._sample(ts, lat, status, retries)
        if not weight:
            return
        e = nvme.command_event(key, s, ts, opclass, nvme.REC_CMD, weight, cpu)
        e["status"], e["sq_occ"] = status, self.sqocc.get(key[:2], nvme.NO_OCC)
        e["flags"], e["retries"] = f["flags"], retries
        e["disk"] = bytes(f.get("disk", b""))[:32]
        self.events.append(e.tobytes())

    def _nvme_sq(self, f, ts, pid, tid, comm, cpu):
        depth = self.qdepth.get(f["ctrl_id"], 65536) or 65536
        occ = (f["sq_tail"] + depth - f["sq_head"]) % depth
        self.sqocc[(f["ctrl_id"], f["qid"])] = occ
        q = self._q(f["ctrl_id"], f["qid"], nvme.OP_QUEUE)
        q["sq_samples"] += 1
        q["sq_occ_sum"] += occ
        q["sq_occ_max"] = max(q["sq_occ_max"], occ)

    def _nvme_async_event(self, f, ts, pid, tid, comm, cpu):
        e = np.zeros(1, dtype=nvme.DTYPE)
        e["kind"], e["version"], e["size"], e["cpu"], e["ts"] = nvme.KIND_NVME, 1, nvme.DTYPE.itemsize, cpu, ts
        e["ctrl_id"], e["result"], e["weight"], e["sq_occ"], e["rec"] = f["ctrl_id"], f["result"], 1, nvme.NO_OCC, nvme.REC_AEN
        self.events.append(e.tobytes())


class TcpReference:
    """tcp.bpf.c's filter and probe rate limit in Python, over decoded tracepoint records
    (as NvmeReference): ``feed(event, fields, ts)`` appends kv_tcp_event records to
    ``events``.  Used by the tests on records of several kernels' layouts."""

    def __init__(self, ports=tcp.DEFAULT_PORTS, probe_interval_ns: int = 10_000_000):
        self.ports = set(ports)
        self.every = probe_interval_ns
        self.last: dict[int, list[int]] = {}
        self.events: list[bytes] = []

    def _new(self, typ: int, ts: int, pid: int = 0, tid: int = 0) -> np.ndarray:
        e = np.zeros(1, dtype=tcp.DTYPE)
        e["kind"], e["version"], e["size"], e["ts"], e["tgid"], e["tid"], e["type"] = tcp.KIND_TCP, 1, tcp.DTYPE.itemsize, ts, pid, tid, typ
        return e

    @staticmethod
    def _addrs(e, family, f, v4="saddr", v6="saddr_v6", dv4="daddr", dv6="daddr_v6"):
        if family == 10:
            e["saddr"][0][:16] = list(f[v6])
            e["daddr"][0][:16] = list(f[dv6])
        else:
            e["saddr"][0][:4] = list(f[v4])[:4]
            e["daddr"][0][:4] = list(f[dv4])[:4]

    def feed(self, event: str, f: dict, ts: int, pid: int = 0, tid: int = 0) -> None:
        if f["sport"] not in self.ports and f["dport"] not in self.ports:
            return
        if event in ("tcp_retransmit_skb", "tcp_retransmit_synack"):
            synack = event == "tcp_retransmit_synack"
            e = self._new(4 if synack else 1, ts, pid, tid)
            state = tcp.STATES.index("NEW_SYN_RECV") if synack else f["state"]
            e["skaddr"], e["state"], e["sport"], e["dport"] = f["skaddr"], state, f["sport"], f["dport"]
            e["family"] = f.get("family", 2)
            e["err"] = f.get("err", 0)
            self._addrs(e, int(e["family"][0]), f)
        elif event == "inet_sock_set_state":
            if f["protocol"] != 6:
                return
            e = self._new(2, ts, pid, tid)
            e["skaddr"], e["state"], e["newstate"] = f["skaddr"], f["oldstate"], f["newstate"]
            e["sport"], e["dport"], e["family"] = f["sport"], f["dport"], f["family"]
            self._addrs(e, f["family"], f)
        elif event == "tcp_probe":
            key = f.get("skaddr") or f.get("sock_cookie") or (f["sport"] << 16 | f["dport"])
            last = self.last.get(key)
            if last and ts - last[0] < self.every:
                last[1] += 1
                return
            probes = last[1] + 1 if last else 1
            self.last[key] = [ts, 0]
            e = self._new(3, ts, pid, tid)
            e["probes"], e["skaddr"], e["sock_cookie"] = probes, f.get("skaddr", 0), f.get("sock_cookie", 0)
            for k in ("srtt", "snd_cwnd", "ssthresh", "snd_wnd", "rcv_wnd", "data_len"):
                e["srtt_us" if k == "srtt" else k] = f[k]
            e["sport"], e["dport"] = f["sport"], f["dport"]
            sa, da = bytes(f["saddr"]), bytes(f["daddr"])
            family = sa[0] | sa[1] << 8
            e["family"] = family
            off, n = (8, 16) if family == 10 else (4, 4)
            e["saddr"][0][:n] = list(sa[off:off + n])
            e["daddr"][0][:n] = list(da[off:off + n])
        else:
            return
        self.events.append(e.tobytes())


class RdmaReference:
    """rdma.bpf.c in Python over decoded tracepoint records (for tests on several layouts)."""

    def __init__(self):
        self.events: list[bytes] = []
        self.cq: dict[int, dict] = {}

    def feed(self, event: str, f: dict, ts: int, pid: int = 0, tid: int = 0, comm: str = "") -> None:
        if event in rdma.CORE_COUNTED:
            s = self.cq.setdefault(f["cq_id"], dict.fromkeys(
                ("polls", "completions", "full_polls", "wakeups", "wakeup_lat_us", "wakeup_lat_max_us",
                 "interrupts", "reschedules"), 0))
            if event == "cq_poll":
                s["polls"] += 1
                if f["rc"] > 0:
                    s["completions"] += f["rc"]
                    s["full_polls"] += f["rc"] == f["requested"]
            elif event == "cq_process":
                s["wakeups"] += 1
                if f["latency"] > 0:
                    s["wakeup_lat_us"] += f["latency"]
                    s["wakeup_lat_max_us"] = max(s["wakeup_lat_max_us"], f["latency"])
            else:
                s["interrupts" if event == "cq_schedule" else "reschedules"] += 1
            return
        t = rdma.TYPES[event]
        e = np.zeros(1, dtype=rdma.DTYPE)
        e["kind"], e["version"], e["size"], e["ts"], e["tgid"], e["tid"] = rdma.KIND_RDMA, 1, rdma.DTYPE.itemsize, ts, pid, tid
        e["type"], e["comm"] = t, comm.encode()[:16]
        e["id"] = f.get("cm_id", f.get("cq_id", 0))
        e["tos"] = f.get("tos", 0)
        e["qp_num"] = f.get("qp_num", 0)
        e["event"] = f.get("event", 0)
        e["status"] = f.get("status", f.get("result", f.get("rc", 0)))
        if event in ("cq_alloc", "cq_alloc_error"):
            e["a"], e["b"], e["c"] = f["nr_cqe"], f["comp_vector"], f["poll_ctx"]
        elif event == "cq_modify":
            e["a"], e["b"] = f["comps"], f["usec"]
        elif event == "cm_qp_create":
            e["a"], e["b"], e["c"], e["d"] = f["pd_id"], f["send_wr"], f["recv_wr"], f["qp_type"]
        if "srcaddr" in f:
            e["srcaddr"][0][:] = list(bytes(f["srcaddr"]))
            e["dstaddr"][0][:] = list(bytes(f["dstaddr"]))
        self.events.append(e.tobytes())
