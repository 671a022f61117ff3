"""`kvtrace analyze`: the slowest chunks with the NVMe commands (per controller and queue) and
NIC counter deltas of their step's window.  The constructed dataset of test_analysis.py
(tests/unit/analysis_fixture.py) plus hand-placed nvme_cmd and nic_counters rows; every
number below is worked out by hand.  DuckDB and Spark give the same report.  No root."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.analysis.render import terminal, to_html
from kvtrace.analysis.report import analyze
from kvtrace.dataset import schema

from . import analysis_fixture as fx
from .analysis_fixture import MS


def nvme(setup_ms: float, done_ms: float, ctrl: str, qid: int, transport: str, nbytes: int, weight: int = 1) -> dict:
    return {"ts_ns": int(done_ms * MS), "setup_ns": int(setup_ms * MS), "latency_ns": int((done_ms - setup_ms) * MS),
            "pid": fx.WORKER, "tid": fx.WORKER, "ctrl": ctrl, "ctrl_id": int(ctrl[4:]), "transport": transport,
            "traddr": "10.0.0.2:4420" if transport == "tcp" else "0000:00:04.0", "qid": qid, "opclass": "read",
            "op": "read", "bytes": nbytes, "status": 0, "weight": weight}


def nic(ts_ms: float, interval_ms: float, name: str, delta: int) -> dict:
    return {"ts_ns": int(ts_ms * MS), "interval_ns": int(interval_ms * MS), "source": "rdma", "device": "rxe0", "port": 1,
            "netdev": "eth0", "name": name, "raw": 0, "value": 0, "delta": delta, "unit": "packets", "status": "ok"}


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    root = fx.build(tmp_path_factory.mktemp("fabric") / "ds")
    # F's chunk (the slowest: 19.5 ms) ran in step 12, window [120, 129.5] ms
    fx.write(root, "nvme_cmd", [
        nvme(121, 122, "nvme1", 3, "tcp", 65536),               # 1 ms
        nvme(123, 126, "nvme1", 3, "tcp", 65536, weight=2),     # 3 ms, sampled: stands for 2
        nvme(129, 130, "nvme0", 1, "pcie", 4096),               # starts inside the window, ends after it
        nvme(200, 201, "nvme1", 3, "tcp", 4096),                # in no step
        nvme(60, 61, "nvme1", 2, "tcp", 4096),                  # step 6: decode only, no chunk
    ], sch=schema.TABLES["nvme_cmd"])
    fx.write(root, "nic_counters", [
        nic(125, 5, "rcvd_pkts", 500), nic(130, 5, "rcvd_pkts", 300),   # [120, 125] and [125, 130]: step 12
        nic(130, 5, "send_pkts", 0),                                   # did not move
        nic(75, 5, "rcvd_pkts", 7),                                    # [70, 75]: step 7, E's re-admission
        nic(119, 1, "rcvd_pkts", 1000),                                # [118, 119]: between steps 11 and 12
    ], sch=schema.TABLES["nic_counters"])
    return root


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


def test_slow_chunks_carry_nvme_queue_latency_and_nic_counters(rep):
    sc = rep["storage"]["slow_chunks"]
    # the 10 chunks by total time: F 19.5, E (re-admitted) 17.8, B 16, then the 13 ms ones by step
    assert [(x["rank"], x["request"], x["attempt"], x["step"]) for x in sc] == [
        (1, "F", 0, 12), (2, "E", 1, 7), (3, "B", 0, 2), (4, "A", 0, 1), (5, "E", 0, 4), (6, "D", 0, 8),
        (7, "C", 0, 10), (8, "A", 0, 2), (9, "A", 0, 3), (10, "D", 0, 9)]
    f = sc[0]
    assert (f["total_ns"], f["storage_ns"], f["verdict"]) == (int(19.5 * MS), 2 * MS, "queueing")
    # nvme0 q1: one 1 ms command; nvme1 q3: 1 + 2 x 3 ms over 3 commands = 7/3 ms on average
    assert f["nvme"] == [
        {"ctrl": "nvme0", "qid": 1, "transport": "pcie", "commands": 1, "bytes": 4096, "latency_avg_ns": 1_000_000,
         "latency_max_ns": 1_000_000},
        {"ctrl": "nvme1", "qid": 3, "transport": "tcp", "commands": 3, "bytes": 3 * 65536,
         "latency_avg_ns": round(7e6 / 3, 6), "latency_max_ns": 3_000_000}]
    assert f["nic"] == [{"device": "rxe0", "name": "rcvd_pkts", "delta": 800}]
    assert sc[1]["nvme"] == [] and sc[1]["nic"] == [{"device": "rxe0", "name": "rcvd_pkts", "delta": 7}]
    assert all(x["nvme"] == [] and x["nic"] == [] for x in sc[2:])


def test_slow_chunks_in_the_terminal_and_html(rep):
    from rich.console import Console

    con = Console(record=True, width=250)
    terminal(rep, con)
    out = con.export_text()
    assert "Slowest chunks: NVMe queues and NIC counters in their step" in out
    assert "nvme1 q3 tcp" in out and "rxe0/rcvd_pkts 800" in out
    page = to_html(rep)
    assert "nvme1 q3 tcp: 3 cmds, avg 2.333 ms, max 3.000 ms" in page and "rxe0/rcvd_pkts 800" in page


def test_without_nvme_or_nic_tables_the_section_is_empty(tmp_path):
    sc = analyze(fx.build(tmp_path / "plain"))["storage"]["slow_chunks"]
    assert len(sc) == 10 and all(x["nvme"] == [] and x["nic"] == [] for x in sc)


@pytest.mark.slow
@pytest.mark.long   # Apache Spark, the second SQL engine: make test-long
def test_spark_gives_the_same_section(ds, rep):
    fx.assert_spark_report_equals(ds, rep)
