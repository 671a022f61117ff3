"""The terminal report for a person at 80 and 200 columns: `kvtrace analyze` (every table fits,
request ids shortened to a unique suffix that maps back to one full id, columns left out by
priority and named, --wide shows everything), `kvtrace summary` and `kvtrace servers`.

The dataset is tests/unit/analysis_fixture.py's, with the NVMe and NIC rows of
test_analysis_fabric.py and its requests renamed to ids of vLLM's form
(`cmpl-<X-Request-Id>-<n>-<8 random hex>`)."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from kvtrace.analysis import render
from kvtrace.analysis.report import analyze
from kvtrace.dataset import schema

from . import analysis_fixture as fx
from .test_analysis_fabric import nic, nvme

REPO = Path(__file__).resolve().parents[2]

# A and C share an X-Request-Id and their last 8 characters (n differs), so their short forms
# must grow past the random suffix; E's client id is long; B, D, F are vLLM's uuid ids.
IDS = {"A": "cmpl-again-0-3f9a2c1e", "C": "cmpl-again-1-3f9a2c1e",
       "B": "cmpl-5c0b6e2d94a34f0c8e51a7f3d2b9c640-0-6d2e91f0",
       "D": "cmpl-9e7f1a3b2c4d4e5f8a6b7c8d9e0f1a2b-0-0c4d5e6f",
       "E": "cmpl-long-client-request-id-for-tracing-0-77aa0e12",
       "F": "cmpl-f00dfeedcafe4bd0a1b2c3d4e5f60718-0-a5b6c7d8"}
SHORT = {"A": "…0-3f9a2c1e", "C": "…1-3f9a2c1e", "B": "…6d2e91f0", "D": "…0c4d5e6f", "E": "…77aa0e12",
         "F": "…a5b6c7d8"}
# the slowest chunks, as test_analysis_fabric.py ranks them: (request, attempt, step)
SLOW = [("F", 0, 12), ("E", 1, 7), ("B", 0, 2), ("A", 0, 1), ("E", 0, 4), ("D", 0, 8), ("C", 0, 10), ("A", 0, 2),
        ("A", 0, 3), ("D", 0, 9)]

SLOW_COLS = ["request", "attempt", "index", "step", "tokens", "queue ms", "sched ms", "storage ms", "compute ms", "verdict"]
STORAGE_COLS = ["source", "device / queue", "op", "count", "bytes", "p50 ms", "p95 ms", "p99 ms", "MB/s", "IOPS", "QD"]
FABRIC_COLS = ["#", "request", "step", "total ms", "storage ms", "verdict", "NVMe queue", "cmds", "avg ms", "max ms",
               "NIC counters"]


def vllm_dataset(root: Path) -> Path:
    """The analysis fixture with NVMe/NIC rows, its request ids renamed per IDS in every table."""
    fx.build(root)
    fx.write(root, "nvme_cmd", [nvme(121, 122, "nvme1", 3, "tcp", 65536), nvme(123, 126, "nvme1", 3, "tcp", 65536, weight=2),
                                nvme(129, 130, "nvme0", 1, "pcie", 4096)], sch=schema.TABLES["nvme_cmd"])
    fx.write(root, "nic_counters", [nic(125, 5, "rcvd_pkts", 500), nic(130, 5, "rcvd_pkts", 300),
                                    nic(75, 5, "rcvd_pkts", 7)], sch=schema.TABLES["nic_counters"])
    for path in root.rglob("*.parquet"):
        t = pq.read_table(path)
        for col in ("request", "for_request"):
            if col in t.column_names:
                i = t.column_names.index(col)
                t = t.set_column(i, t.schema.field(i), pa.array([IDS.get(v, v) for v in t[col].to_pylist()], pa.string()))
        pq.write_table(t, path)
    return root


def dataset_ids(root: Path) -> set[str]:
    """Every request id the dataset holds, read from its Parquet files."""
    out = set()
    for path in root.rglob("*.parquet"):
        t = pq.read_table(path)
        for col in ("request", "for_request"):
            if col in t.column_names:
                out |= {v for v in t[col].to_pylist() if v}
    return out


def parse_tables(text: str) -> list[dict]:
    """The boxed tables of rendered text: title (the line above), headers (each column's header
    lines joined), body lines (cells per line), and the '(left out …)' note under it, if any."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        j, head = i + 1, []
        while not lines[j].startswith("┡"):
            head.append([c.strip() for c in lines[j].split("┃")[1:-1]])
            j += 1
        body, j = [], j + 1
        while not lines[j].startswith("└"):
            body.append([c.strip() for c in lines[j].split("│")[1:-1]])
            j += 1
        note = ""
        k = j + 1
        if k < len(lines) and lines[k].strip().startswith("(left out"):
            while ")" not in lines[k]:
                note += lines[k].strip() + " "
                k += 1
            note += lines[k].strip()
        headers = [" ".join(filter(None, col)) for col in zip(*head)]
        out.append({"title": lines[i - 1].strip(), "headers": headers, "body": body, "note": note})
    return out


def by_title(text: str) -> dict[str, dict]:
    return {t["title"]: t for t in parse_tables(text)}


def left_out(note: str) -> list[str]:
    m = re.match(r"\(left out at \d+ columns: (.*); .* shows them\)$", note)
    return m.group(1).split(", ") if m else []


def legend(text: str) -> dict[str, str]:
    lines = text.splitlines()
    if "request ids shown by their unique last characters:" not in lines:
        return {}
    start = lines.index("request ids shown by their unique last characters:") + 1
    return dict(line.split() for line in lines[start:] if line.strip())


def render_at(rep: dict, width: int, wide: bool = False) -> str:
    con = Console(width=width, record=True, file=io.StringIO())
    render.terminal(rep, con, wide=wide)
    return con.export_text()


def assert_fits(text: str, width: int) -> None:
    over = [line for line in text.splitlines() if len(line) > width]
    assert not over, over


def assert_nothing_truncated(tables: list[dict]) -> None:
    """rich marks a cut cell with a trailing '…'; short ids start with one."""
    for t in tables:
        cells = t["headers"] + [c for line in t["body"] for c in line]
        assert not [c for c in cells if c.endswith("…")], t


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return vllm_dataset(tmp_path_factory.mktemp("width") / "ds")


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


# ---------------------------------------------------------------------------------------------
# Short ids


def test_short_ids_are_the_shortest_unique_suffix():
    universe = list(IDS.values())
    assert render.short_ids(universe, universe) == {IDS[k]: SHORT[k] for k in IDS}
    # a suffix found inside another id (not only at its end) is not unique: it grows
    assert render.short_ids(["cmpl-x-0-12345678"], ["cmpl-x-0-12345678", "cmpl-1234567899-0-aaaaaaaa"]) == \
        {"cmpl-x-0-12345678": "…0-12345678"}
    # ids of 12 characters or fewer are shown whole, even the end of another id
    assert render.short_ids(["A", "cmpl-A-0-aaaa"], ["A", "cmpl-A-0-aaaa"]) == {"A": "A", "cmpl-A-0-aaaa": "…A-0-aaaa"}
    assert render.short_ids(["x-0-12345678"], ["x-0-12345678", "cmpl-x-0-12345678"]) == {"x-0-12345678": "x-0-12345678"}


def test_fit_wraps_then_shortens_then_drops_by_priority():
    cols = [render.Col("request", ids=True), render.Col("step", 1), render.Col("sched ms", 2), render.Col("verdict")]
    rows = [["cmpl-aaaaaaaaaaaaaaaa-0-12345678", "12", "0.500", "queueing"]]
    short = {rows[0][0]: "…12345678"}
    # natural widths 32 + 4 + 8 + 8 and 13 of borders: 65 fits whole
    assert render.fit(cols, rows, 65, short) == ([0, 1, 2, 3], [32, 4, 8, 8], False)
    # narrower, a header wraps first ("sched ms" needs 5: "sched" over "ms")
    assert render.fit(cols, rows, 64, short) == ([0, 1, 2, 3], [32, 4, 7, 8], False)
    assert render.fit(cols, rows, 62, short) == ([0, 1, 2, 3], [32, 4, 5, 8], False)
    # then short ids (9 cells), every column at its natural width again
    assert render.fit(cols, rows, 61, short) == ([0, 1, 2, 3], [9, 4, 8, 8], True)
    # then "sched ms" (priority 2) is left out, then "step" (1); priority 0 never
    assert render.fit(cols, rows, 38, short) == ([0, 1, 3], [9, 4, 8], True)
    assert render.fit(cols, rows, 28, short) == ([0, 3], [9, 8], True)


# ---------------------------------------------------------------------------------------------
# kvtrace analyze


def test_80_columns_short_ids_that_map_back(ds, rep):
    text = render_at(rep, 80)
    assert_fits(text, 80)
    tables = parse_tables(text)
    assert_nothing_truncated(tables)
    full = dataset_ids(ds)
    assert full == set(IDS.values())
    t = by_title(text)
    slow = t["Slowest chunks"]
    shown = [line[0] for line in slow["body"]]
    assert shown == [SHORT[r] for r, _, _ in SLOW]
    # each short id is the end of exactly one full id of the dataset, and the legend names it
    for s in shown:
        assert [f for f in full if f.endswith(s[1:])] == [IDS[k] for k in IDS if SHORT[k] == s]
        assert sum(s[1:] in f for f in full) == 1
    assert legend(text) == {SHORT[k]: IDS[k] for k in ("F", "E", "B", "A", "D", "C")}
    # every step shown is the step of that chunk (a row reads back to its chunk)
    steps = [line[slow["headers"].index("step")] for line in slow["body"]]
    assert steps == [str(s) for _, _, s in SLOW]


def test_80_columns_leave_out_by_priority_and_say_so(rep):
    t = by_title(render_at(rep, 80))
    for title, cols, dropped in (("Slowest chunks", SLOW_COLS, ["attempt", "sched ms"]),
                                 ("Storage", STORAGE_COLS, ["p95 ms", "IOPS", "QD"]),
                                 ("Slowest chunks: NVMe queues and NIC counters in their step", FABRIC_COLS,
                                  ["#", "total ms", "verdict", "max ms"])):
        assert t[title]["headers"] == [c for c in cols if c not in dropped], title
        assert left_out(t[title]["note"]) == dropped, title
    assert t["KV reuse (token-weighted, counted at first admission only)"]["headers"] == [
        "requests", "prompt tokens", "hit tokens", "hit rate", "local", "storage"]
    fabric = t["Slowest chunks: NVMe queues and NIC counters in their step"]
    assert fabric["body"][0][:4] == [SHORT["F"], "12", "2.000", "nvme0 q1 pcie"]
    assert fabric["body"][2][3] == "nvme1 q3 tcp"
    # the two text columns of the chunking table share the room: no figure broken over lines
    chunking = t["Chunking versus blocks (block size 32)"]
    assert ["eviction → re-reference p50 / p90 / p99", "19.700 / 29.700 / 29.700"] in chunking["body"]
    assert ["evictions / evicted blocks needed again", "6 / 5"] in chunking["body"]


def test_200_columns_full_ids_every_column(ds, rep):
    text = render_at(rep, 200)
    assert_fits(text, 200)
    tables = parse_tables(text)
    assert_nothing_truncated(tables)
    assert not [x for x in tables if x["note"]] and legend(text) == {}
    t = by_title(text)
    assert t["Slowest chunks"]["headers"] == SLOW_COLS and t["Storage"]["headers"] == STORAGE_COLS
    assert [line[:2] for line in t["Slowest chunks"]["body"]] == [[IDS[r], str(a)] for r, a, _ in SLOW]
    fabric = t["Slowest chunks: NVMe queues and NIC counters in their step"]
    assert fabric["headers"] == FABRIC_COLS
    assert [line[1] for line in fabric["body"] if line[1]] == [IDS["F"], IDS["E"]]


def test_wide_shows_everything_on_any_terminal(rep):
    text = render_at(rep, render.WIDE, wide=True)
    t = by_title(text)
    assert t["Slowest chunks"]["headers"] == SLOW_COLS and legend(text) == {}
    assert [line[0] for line in t["Slowest chunks"]["body"]] == [IDS[r] for r, _, _ in SLOW]
    # nothing wraps: one line per table row, each headline on one line
    assert len(t["Slowest chunks"]["body"]) == 10 and len(t["Storage"]["body"]) == 4
    assert all(line.startswith("  • ") for line in text.splitlines()[1:1 + len(rep["headline"])])


def test_fixture_ids_stay_whole_at_80(tmp_path):
    text = render_at(analyze(fx.build(tmp_path / "plain")), 80)
    assert_fits(text, 80)
    assert [line[0] for line in by_title(text)["Slowest chunks"]["body"]] == [r for r, _, _ in SLOW]
    assert legend(text) == {}


def cli(*args, columns: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env, timeout=300, cwd=REPO)


def test_cli_width_from_columns_else_80_and_wide(ds):
    r = cli("analyze", ds, columns="200")
    assert r.returncode == 0, r.stderr
    assert_fits(r.stdout, 200)
    assert [line[0] for line in by_title(r.stdout)["Slowest chunks"]["body"]] == [IDS[x] for x, _, _ in SLOW]
    r = cli("analyze", ds, columns=None)  # no terminal anywhere, no $COLUMNS: 80
    assert r.returncode == 0, r.stderr
    assert_fits(r.stdout, 80)
    assert [line[0] for line in by_title(r.stdout)["Slowest chunks"]["body"]] == [SHORT[x] for x, _, _ in SLOW]
    r = cli("analyze", ds, "--wide", columns="80")
    assert r.returncode == 0, r.stderr
    t = by_title(r.stdout)
    assert t["Slowest chunks"]["headers"] == SLOW_COLS
    assert [line[0] for line in t["Slowest chunks"]["body"]] == [IDS[x] for x, _, _ in SLOW]
    assert max(len(line) for line in r.stdout.splitlines()) > 80


# ---------------------------------------------------------------------------------------------
# kvtrace summary


RUN = {"run": "20261130T101500-ab12cd", "status": "complete", "start_ns": 0, "stop_ns": 3600 * 10**9,
       "pids": [1234567 + i for i in range(9)], "probes_attached": ["proc", "blockio", "fileio", "fdopen", "iouring",
                                                                   "usermark", "nvme", "tcp", "rdma"],
       "probes_skipped": {"ulib": "not selected", "rdma": "tracepoints rdma_cma:cm_* missing (load rdma_cm first)"},
       "lost_events": {"ringbuf": 12}, "dropped_events": 3,
       "sinks": json.dumps([{"name": "otlp", "protocol": "grpc", "url": "http://otel-collector.observability.svc:4317",
                             "spans_built": 123456, "sent": 123000, "dropped": 456, "dropped_queue_full": 400,
                             "failed": 50, "rejected": 6}]),
       "kernel_skips": {"block:block_rq_complete": 40, "syscalls:sys_enter_read": 2}}
SINK = ("otlp grpc http://otel-collector.observability.svc:4317: 123456 spans built, 123000 sent, 456 dropped "
        "(400 queue full, 50 failed, 6 rejected, 0 at shutdown)")


def summary_at(width: int, terminal: bool) -> str:
    from kvtrace.commands.summary import print_run, print_tables

    con = Console(width=width, record=True, file=io.StringIO(), force_terminal=terminal)
    print_run(con, RUN)
    print_tables(con, "kvtrace summary of /data/run1", {
        "block_io": {"rows": 1234567, "bytes": 36_900_000, "pids": [101] + RUN["pids"], "latency_p50_ns": 6000,
                     "latency_p99_ns": 400_000},
        "nvme_queue_hist": {"rows": 12}})
    return con.export_text()


def test_summary_at_80_columns():
    text = summary_at(80, terminal=True)
    assert_fits(text, 80)
    (t,) = parse_tables(text)
    assert_nothing_truncated([t])
    assert t["headers"] == ["table", "rows", "bytes", "pids", "p50 ms", "p99 ms"] and not t["note"]
    pids = " ".join(line[3] for line in t["body"][:-1])
    assert pids == "101, 1234567, 1234568, 1234569, 1234570, 1234571 (+4)"
    assert t["body"][-1] == ["nvme_queue_hist", "12", "-", "", "-", "-"]
    lines = text.splitlines()
    assert lines[0] == "run 20261130T101500-ab12cd (complete): 3600.0 s, lost 12, dropped 3"
    assert lines[1].startswith("  pids: 1234567, 1234568, ") and lines[2].strip() == "1234575"
    # the sink line wraps under itself, its words whole
    start = next(i for i, line in enumerate(lines) if line.startswith("  otlp grpc"))
    assert " ".join(line.strip() for line in lines[start:start + 3]) == SINK
    assert all(line.startswith("    ") for line in lines[start + 1:start + 3])


def test_summary_to_a_pipe_keeps_the_sink_line_whole():
    text = summary_at(80, terminal=False)
    assert "  " + SINK in text.splitlines()


# ---------------------------------------------------------------------------------------------
# kvtrace servers


def servers():
    from kvtrace.servers.info import KvEventsInfo, ServerInfo

    def info(pid, port, kv, workers, model, **kw):
        return ServerInfo(pid=pid, api_pids=[pid], engine_pids=[pid + 1], worker_pids=[pid + 2 + i for i in range(workers)],
                              other_pids=[], host="127.0.0.1", port=port, model=model, python_exe=None,
                              python_version="3.12.3", version="0.32.0", site_packages=None, plugin="installed",
                              kv_events=kv, in_container=kw.get("ct", False), cmdline=["vllm", "serve", model], kind="vllm",
                              netns=kw.get("netns"), netns_id=kw.get("netns_id"))

    kv = KvEventsInfo(enabled=True, publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", dp_size=2)
    return [info(1234567, 8000, kv, 4, "/models/meta-llama/Llama-3.1-8B-Instruct"),
            info(2345678, 18001, None, 1, "/models/meta-llama/Llama-3.1-8B-Instruct", ct=True,
                 netns="/proc/2345678/ns/net", netns_id="net:[4026532451]"),
            info(31, 8002, KvEventsInfo(enabled=True, publisher="zmq", endpoint="ipc:///tmp/vllm-kv-events.sock",
                                        replay_endpoint=None), 1, "Qwen/Qwen2.5-0.5B")]


def servers_at(width: int) -> str:
    from kvtrace.attach.listing import render as render_servers

    con = Console(width=width, record=True, file=io.StringIO())
    render_servers(servers(), con, hooks=["yes", "no", "?"])
    return con.export_text()


def column(t: dict, name: str) -> list[str]:
    """A column's cells, the wrapped lines of each row joined (rows start where 'API pid' has text)."""
    i, out = t["headers"].index(name), []
    for line in t["body"]:
        if line[0]:
            out.append(line[i])
        elif line[i]:
            out[-1] += ("" if out[-1].endswith(("-", "/")) or line[i][0] in "-" else " ") + line[i]
    return out


def test_servers_at_80_columns():
    text = servers_at(80)
    assert_fits(text, 80)
    (t,) = parse_tables(text)
    assert_nothing_truncated([t])
    assert t["headers"] == ["API pid", "port", "engine", "hook", "KV events", "model"]
    assert left_out(t["note"]) == ["EngineCore", "Workers", "Python", "plugin"]
    assert column(t, "port") == ["8000", "18001", "8002"]
    assert column(t, "hook") == ["yes", "no", "?"]
    assert column(t, "model") == ["Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct [container, own network net:[4026532451]]",
                                  "Qwen2.5-0.5B"]
    assert column(t, "KV events")[2].replace(" ", "") == "ipc:///tmp/vllm-kv-events.sock"


def test_servers_at_200_columns():
    text = servers_at(200)
    assert_fits(text, 200)
    (t,) = parse_tables(text)
    assert t["headers"] == ["API pid", "port", "EngineCore", "Workers", "Python", "engine", "hook", "plugin", "KV events",
                            "model"]
    assert not t["note"] and column(t, "Workers")[0] == "1234569 1234570 1234571 1234572"
