"""The nvme probe's rules and decoder on tracepoint records laid out for several kernels
(tests/data/tpformats: 4.19-era, 5.15, 6.1 and 6.18 i.e. 6.8+): records are built from
each kernel's format file, read back by it (kvtrace.capture.tpformat), paired by
tests.bpf_reference.NvmeReference (nvme.bpf.c's rules), and decoded by kvtrace.capture.nvme into rows.
The same format files compile and pass the verifier in tests/privileged/test_fabric.py.
No root."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.capture import events, nvme
from kvtrace.capture.events import DecodeContext
from kvtrace.capture import tpformat
from kvtrace.fabric import topology
from kvtrace.fabric.sysfs import kernel_dev
from tests.bpf_reference import NvmeReference
from tests.sysfs_tree import materialize

FORMATS = Path(__file__).resolve().parents[1] / "data" / "tpformats"
KERNELS = ["4.19", "5.15", "6.1", "6.18"]
HEAD = kernel_dev(259, 0)


def formats(kernel):
    root = FORMATS / kernel
    return {ev: tpformat.read("nvme", ev, root) for ev in ("nvme_setup_cmd", "nvme_complete_rq", "nvme_sq", "nvme_async_event")}


def complete_cid(kernel, gen, tag):
    """What nvme_complete_rq reports as cid: the bare tag before 6.0, the command id (with
    the generation counter in bits 12-15) since."""
    return tag if kernel in ("4.19", "5.15") else (gen << 12) | tag


def cdw(slba=0, nlb=0):
    """cdw10..cdw15 of an LBA command: SLBA (cdw10-11), NLB - 1 (cdw12 bits 0-15)."""
    return slba.to_bytes(8, "little") + ((nlb - 1) & 0xFFFF).to_bytes(2, "little") + bytes(14)


class Run:
    """Records built by each kernel's format, read back by it, fed to the reference."""

    def __init__(self, kernel, **kw):
        self.kernel = kernel
        self.fmt = formats(kernel)
        self.ref = NvmeReference(**kw)
        self.raw = []

    def rec(self, event, ts, pid=0, tid=0, comm="", **values):
        fmt = self.fmt[event]
        data = fmt.encode(values, pid=pid)
        self.raw.append((event, data))
        fields = fmt.decode(data)
        assert fields["common_pid"] == pid
        self.ref.feed(event, fields, ts, pid, tid, comm)

    def setup(self, ts, ctrl, qid, gen, tag, opcode, nsid=1, disk=b"", fctype=0, pid=0, tid=0, comm="", **kw):
        self.rec("nvme_setup_cmd", ts, pid, tid, comm, ctrl_id=ctrl, qid=qid, opcode=opcode, flags=0, fctype=fctype,
                 cid=(gen << 12) | tag, nsid=nsid, disk=disk, cdw10=kw.get("cdw10", bytes(24)))

    def complete(self, ts, ctrl, qid, gen, tag, status=0, retries=0, disk=b""):
        self.rec("nvme_complete_rq", ts, ctrl_id=ctrl, qid=qid, cid=complete_cid(self.kernel, gen, tag), result=0,
                 retries=retries, flags=0, status=status, disk=disk)


def scenario(kernel, **kw):
    topo_block = {(0, 1000 * 8): (4242, 4243, "kvreader")}  # blockio's record: head dev, sector 8000
    r = Run(kernel, ns={(0, 1): (0, HEAD, 12), (2, 1): (kernel_dev(259, 2), 0, 9)},
            block={(HEAD, 8000): (4242, 4243, "kvreader")}, qdepth={2: 1024}, **kw)
    d0 = b"nvme0c0n1"
    # a 32 KiB read over TCP, issued by a traced process (found through the block layer)
    r.setup(1_000_000, 0, 2, 3, 17, 0x02, disk=d0, pid=99, tid=99, comm="kworker/1:1H", cdw10=cdw(1000, 8))
    r.complete(1_050_000, 0, 2, 3, 17, disk=d0)
    # a write failing on an inaccessible ANA path, then retried (new generation) and done
    r.setup(2_000_000, 0, 1, 5, 18, 0x01, disk=d0, pid=4242, tid=4244, comm="kvwriter", cdw10=cdw(64, 32))
    r.complete(2_400_000, 0, 1, 5, 18, status=0x302, disk=d0)
    r.setup(2_500_000, 0, 1, 6, 18, 0x01, disk=d0, pid=4242, tid=4244, comm="kvwriter", cdw10=cdw(64, 32))
    r.complete(2_900_000, 0, 1, 6, 18, retries=1, disk=d0)
    # a flush, an admin identify, a fabrics connect on an I/O queue
    r.setup(3_000_000, 0, 1, 1, 19, 0x00, disk=d0, pid=4242, tid=4244)
    r.complete(3_010_000, 0, 1, 1, 19, disk=d0)
    r.setup(3_100_000, 0, 0, 2, 5, 0x06, nsid=0, pid=1, tid=1)
    r.complete(3_105_000, 0, 0, 2, 5)
    r.setup(3_200_000, 0, 2, 0, 20, 0x7F, nsid=0, fctype=0x01, pid=1, tid=1)
    r.complete(3_260_000, 0, 2, 0, 20)
    # a completion whose setup was never seen (before the attach)
    r.complete(3_300_000, 0, 3, 4, 99, disk=d0)
    # PCIe: SQ head/tail at the CQE, then the completion; issued from its own context
    r.setup(4_000_000, 2, 1, 1, 7, 0x02, disk=b"nvme2n1", pid=777, tid=778, comm="fio", cdw10=cdw(2048, 16))
    r.rec("nvme_sq", 4_020_000, ctrl_id=2, disk=b"nvme2n1", qid=1, sq_head=1020, sq_tail=4)
    r.complete(4_030_000, 2, 1, 1, 7, disk=b"nvme2n1")
    # an ANA change notice (type 2, info 3, log page 0x0c)
    r.rec("nvme_async_event", 5_000_000, ctrl_id=0, result=0x000C0302)
    return r


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("sysfs")
    materialize("nvme.tree", root)
    c = DecodeContext()
    c.nvme_ctrls = topology.scan(root).controllers
    return c


def test_documented_offsets_and_the_old_layout():
    f61, f419 = formats("6.1"), formats("4.19")
    s = f61["nvme_setup_cmd"].fields
    assert (s["disk"].offset, s["ctrl_id"].offset, s["qid"].offset, s["opcode"].offset, s["fctype"].offset,
            s["cid"].offset, s["nsid"].offset, s["cdw10"].offset) == (8, 40, 44, 48, 50, 52, 56, 61)
    c = f61["nvme_complete_rq"].fields
    assert (c["cid"].offset, c["result"].offset, c["retries"].offset, c["status"].offset) == (48, 56, 64, 66)
    assert f61["nvme_sq"].fields["sq_head"].offset == 48
    old = f419["nvme_setup_cmd"]
    assert not old.has("fctype") and old.fields["metadata"].size == 8 and old.fields["cdw10"].offset == 64
    rec = f61["nvme_setup_cmd"].encode({"ctrl_id": 3, "cid": 0x5011, "cdw10": cdw(1000, 8)})
    assert rec[40:44] == (3).to_bytes(4, "little") and rec[52:54] == (0x5011).to_bytes(2, "little")
    assert rec[61:69] == (1000).to_bytes(8, "little")
    for k in KERNELS:
        assert formats(k)["nvme_setup_cmd"].decode(formats(k)["nvme_setup_cmd"].encode({"cid": 0xABC}))["cid"] == 0xABC


@pytest.mark.parametrize("kernel", KERNELS)
def test_commands_pair_and_decode_on_every_layout(kernel, ctx):
    r = scenario(kernel)
    out = nvme.decode(r.ref.events, ctx)
    rows = out[nvme.TABLE].to_pylist()
    by = {(x["ctrl_id"], x["qid"], x["cid"]): x for x in rows}
    read = by[(0, 2, (3 << 12) | 17)]
    assert (read["op"], read["opclass"], read["latency_ns"], read["bytes"], read["nlb"], read["slba"]) == ("read", "read", 50_000, 32768, 8, 1000)
    # the issuer is the traced reader, found through the block layer, not the kworker the setup ran on
    assert (read["pid"], read["tid"], read["comm"], read["issuer"], read["setup_tid"]) == (4242, 4243, "kvreader", "block", 99)
    assert (read["transport"], read["traddr"], read["ctrl"], read["disk"]) == ("tcp", "10.10.0.2:4420", "nvme0", "nvme0c0n1")
    failed, retried = by[(0, 1, (5 << 12) | 18)], by[(0, 1, (6 << 12) | 18)]
    assert (failed["status"], failed["status_text"], failed["retries"], failed["latency_ns"]) == (0x302, "ANA inaccessible", 0, 400_000)
    assert (retried["status"], retried["status_text"], retried["retries"], retried["bytes"]) == (0, "success", 1, 32 * 4096)
    assert by[(0, 1, (1 << 12) | 19)]["op"] == "flush"
    assert (by[(0, 0, (2 << 12) | 5)]["op"], by[(0, 0, (2 << 12) | 5)]["opclass"]) == ("identify", "admin")
    connect = by[(0, 2, 20)]
    assert connect["opclass"] == "fabrics" and connect["op"] == ("fabrics" if kernel == "4.19" else "connect")
    pcie = by[(2, 1, (1 << 12) | 7)]
    assert (pcie["transport"], pcie["sq_occupancy"], pcie["issuer"], pcie["pid"], pcie["comm"], pcie["bytes"]) == (
        "pcie", 8, "setup", 777, "fio", 16 * 512)
    assert all(x["sq_occupancy"] is None for x in rows if x["ctrl_id"] == 0)
    assert len(rows) == 7 and all(x["weight"] == 1 for x in rows)
    (aen,) = out[nvme.ASYNC_TABLE].to_pylist()
    assert (aen["ctrl"], aen["type"], aen["event"], aen["transport"]) == ("nvme0", "notice", "ANA change", "tcp")
    # the in-kernel maps: exact per-queue accounting, and histograms that add up to it
    q = r.ref.qstats
    assert q[(0, 1, 1)]["completions"] == 2 and q[(0, 1, 1)]["errors"] == 1 and q[(0, 1, 1)]["retried"] == 1
    assert q[(0, 1, 1)]["bytes"] == 32 * 4096 and q[(0, 1, 1)]["setups"] == 2
    assert q[(0, 3, nvme.OP_UNKNOWN)]["unmatched"] == 1
    assert q[(2, 1, nvme.OP_QUEUE)]["sq_samples"] == 1 and q[(2, 1, nvme.OP_QUEUE)]["sq_occ_max"] == 8
    completions = sum(v["completions"] for v in q.values())
    assert sum(r.ref.hist.values()) == completions == 7
    assert r.ref.hist[(0, 2, 0, (50_000).bit_length())] == 1  # 50 us falls in [2^15, 2^16) ns
    assert r.ref.start == {}  # every setup was completed


def test_the_generation_bits_are_why_cids_are_masked():
    """On 5.15 the completion reports the bare tag: matching the full command id would miss
    every command whose generation counter is not 0."""
    for kernel, same in (("5.15", False), ("6.1", True)):
        r = scenario(kernel)
        setups = [r.fmt["nvme_setup_cmd"].decode(d)["cid"] for e, d in r.raw if e == "nvme_setup_cmd"]
        completes = [r.fmt["nvme_complete_rq"].decode(d)["cid"] for e, d in r.raw if e == "nvme_complete_rq"]
        assert (setups[0] == completes[0]) is same
        assert setups[0] & 0xFFF == completes[0] & 0xFFF


def test_sampling_keeps_totals_exact_and_weights_honest():
    r = Run("6.1", mode="sampled", budget=100)
    n, errors = 20_000, 0
    for i in range(n):  # 20k commands over 1 s, one queue, one tag reused (completed before the next setup)
        t = i * 50_000
        r.setup(t, 0, 1, i & 0xF, 1, 0x02, cdw10=cdw(i, 1))
        status = 0x281 if i % 997 == 0 else 0
        errors += status != 0
        r.complete(t + 10_000, 0, 1, i & 0xF, 1, status=status)
    rows = nvme.decode(r.ref.events, DecodeContext())[nvme.TABLE].to_pylist()
    assert r.ref.qstats[(0, 1, 0)]["completions"] == n          # the maps are exact
    assert sum(r.ref.hist.values()) == n
    assert len(rows) < n // 5                                    # the ring buffer sees a fraction
    est = sum(x["weight"] for x in rows)
    assert abs(est - n) / n < 0.05                              # sum of weights estimates the count
    err_rows = [x for x in rows if x["status"]]
    assert len(err_rows) == errors and all(x["weight"] == 1 for x in err_rows)  # errors always kept
    r2 = Run("6.1", mode="none")
    r2.setup(0, 0, 1, 0, 1, 0x02)
    r2.complete(10, 0, 1, 0, 1)
    r2.setup(20, 0, 1, 1, 1, 0x02)
    r2.complete(30, 0, 1, 1, 1, retries=2)
    assert [x["retries"] for x in nvme.decode(r2.ref.events, DecodeContext())[nvme.TABLE].to_pylist()] == [2]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_completion_the_probe_missed_is_counted_at_the_tags_next_setup(kernel, ctx):
    """The kernel skips the completion's program (it interrupted another BPF program on that
    CPU): the tag's next setup proves the command ended.  It is counted completed and unseen,
    with its bytes, and written as a row without latency or status; in every mode."""
    for mode in ("all", "sampled", "none"):
        r = Run(kernel, mode=mode, ns={(0, 1): (0, HEAD, 12)})
        d0 = b"nvme0c0n1"
        r.setup(1_000_000, 0, 2, 3, 17, 0x02, disk=d0, pid=50, tid=51, comm="reader", cdw10=cdw(1000, 8))
        # its completion is never fed: the probe did not run for it
        r.setup(2_000_000, 0, 2, 4, 17, 0x02, disk=d0, pid=50, tid=51, comm="reader", cdw10=cdw(2000, 4))
        r.complete(2_040_000, 0, 2, 4, 17, disk=d0)
        q = r.ref.qstats[(0, 2, 0)]
        assert (q["setups"], q["completions"], q["unseen"], q["bytes"], q["latency_ns"]) == (2, 2, 1, 12 * 4096, 40_000)
        assert sum(r.ref.hist.values()) == 1          # only the completion seen has a latency
        assert r.ref.start == {}
        rows = nvme.decode(r.ref.events, ctx)[nvme.TABLE].to_pylist()
        missed = [x for x in rows if x["cid"] == (3 << 12) | 17]
        assert len(missed) == 1, mode
        m = missed[0]
        assert (m["ts_ns"], m["setup_ns"], m["latency_ns"], m["status"], m["status_text"]) == (
            2_000_000, 1_000_000, None, None, nvme.UNSEEN_TEXT)
        assert (m["bytes"], m["slba"], m["pid"], m["tid"], m["comm"], m["weight"], m["sq_occupancy"]) == (
            8 * 4096, 1000, 50, 51, "reader", 1, None)
        assert m["disk"] == "nvme0c0n1"            # no completion record: the namespace's disk in the topology
        seen = [x for x in rows if x["cid"] == (4 << 12) | 17]
        assert [x["latency_ns"] for x in seen] == ([] if mode == "none" else [40_000])


def test_config_follows_the_layout():
    def tp_for(kernel):
        return lambda c, e: (FORMATS / kernel / "events" / c / e).is_dir()

    def fields_for(kernel):
        return lambda c, e: tpformat.field_names(c, e, FORMATS / kernel)

    flags, why = nvme.config(tp_for("6.1"), fields_for("6.1"))
    assert why is None and set(flags) == {"-DKV_NVME_HAVE_FCTYPE", "-DKV_NVME_HAVE_DISK", "-DKV_NVME_HAVE_SQ", "-DKV_NVME_HAVE_AEN"}
    flags, why = nvme.config(tp_for("4.19"), fields_for("4.19"))
    assert why is None and "-DKV_NVME_HAVE_FCTYPE" not in flags
    flags, why = nvme.config(lambda c, e: False)
    assert flags == [] and "not in this kernel" in why
    flags, why = nvme.config(tp_for("6.1"), lambda c, e: {"ctrl_id", "qid"})
    assert "has no" in why


def test_records_of_other_sizes_are_not_decoded():
    r = scenario("6.1")
    good = r.ref.events[0]
    out = nvme.decode([good, good[:-8], b"\x07" * 5], DecodeContext())
    assert len(out[nvme.TABLE]) == 1
    assert nvme.DTYPE.itemsize == 136 and good[0] == events.KIND_NVME
