"""The server kind stated once (docs/schema.md, runs and server_metrics): the writer puts the kind
and version discovery found in every run row, the /metrics scraper writes one server_metrics
table with a kind column (null without a discovered server, never vLLM), and the analysis reads
the kind from the run row alone.  A kind this kvtrace does not know is one line, exit 6."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from kvtrace.analysis import load
from kvtrace.analysis.compare import compare
from kvtrace.analysis.report import COUNTS, NO_KIND, analyze
from kvtrace.attach.streams import start_vllm_streams
from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.dataset.writer import DatasetWriter

from . import analysis_fixture as fx

REPO = Path(__file__).resolve().parents[2]
BODY = (b"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 5\n"
        b"# TYPE sglang:cached_tokens_total counter\nsglang:cached_tokens_total 7\nprocess_cpu_seconds_total 1\n")


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def url():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


def server(kind: str, url: str) -> SimpleNamespace:
    """A discovered server as streams reads it (kvtrace.servers.info.ServerInfo's fields)."""
    return SimpleNamespace(kind=kind, version="0.5.23", pid=1, in_container=False, netns=None, netns_id=None,
                           kv_events=None, metrics_url=url)


def scraped(srv, url: str) -> tuple[pa.Table, dict, list[str]]:
    said: list[str] = []
    (scraper,) = start_vllm_streams(srv, None, None, url if srv is None else None, 60.0, echo=said.append)
    scraper.stop()
    return scraper.drain()["server_metrics"], scraper.stats(), said


def test_the_scraper_writes_the_servers_kind(url):
    t, stats, said = scraped(server("sglang", url), url)
    assert t.schema == schema.TABLES["server_metrics"].remove(schema.TABLES["server_metrics"].get_field_index("server"))  # + the port: serverset.Tagged
    assert set(t.column("kind").to_pylist()) == {"sglang"} and stats["kind"] == "sglang"
    assert set(t.column("name").to_pylist()) == {"sglang:cached_tokens_total"}   # its kind's series only
    assert said[0].startswith("kvtrace: SGLang streams: ") and f"server_metrics from {url}" in said[0], said


def test_without_a_server_the_kind_is_null_not_vllm(url):
    t, stats, said = scraped(None, url)
    assert t.column("kind").to_pylist() == [None] * t.num_rows and t.num_rows and stats["kind"] is None
    assert set(t.column("name").to_pylist()) == {"vllm:prefix_cache_hits_total", "sglang:cached_tokens_total"}
    assert said == [f"kvtrace: streams: server_metrics from {url} every 60s"]   # no server named


def run_row(**kw) -> dict:
    return {"run": "r1", "status": "running", "schema_version": schema.SCHEMA_VERSION, "kvtrace_version": "t",
            "kernel": "k", "start_ns": 1, "stop_ns": 2, "clock_offset_ns": 3, "start_wall": "w", "pids": [1], **kw}


def test_the_writer_states_the_server_in_every_run_row(tmp_path, url):
    w = DatasetWriter(tmp_path / "ds", "r1", "h")
    w.state_server("sglang", "0.5.23")
    for _ in range(2):
        w.add("server_metrics", scraped(server("sglang", url), url)[0])
        w.flush(run_row())
    w.compact()
    ds = Dataset.open(tmp_path / "ds")
    (run,) = ds.runs()
    assert (run["server_kind"], run["server_version"]) == ("sglang", "0.5.23")
    assert ds.run_versions() == {"r1": schema.SCHEMA_VERSION} == {"r1": 2}
    t = ds.table("server_metrics")
    assert t.num_rows == 4 and set(t.column("kind").cast(pa.string()).to_pylist()) == {"sglang"}  # 2 scrapes a flush


def test_a_writer_without_a_server_states_none(tmp_path):
    w = DatasetWriter(tmp_path / "ds", "r1", "h")
    w.flush(run_row())
    (run,) = Dataset.open(tmp_path / "ds").runs()
    assert run["server_kind"] is None and run["server_version"] is None


def metrics_rows(kind: str | None, name: str, values=(10.0, 25.0)) -> list[dict]:
    return [{"ts_ns": (i + 1) * fx.MS, "kind": kind, "name": name, "labels": "{}", "value": v, "type": "counter"}
            for i, v in enumerate(values)]


def test_the_analysis_reads_the_kind_from_the_run_row(tmp_path):
    root = fx.build(tmp_path / "ds")
    fx.write(root, "engine", [fx.hook({"t_ns": 0, "name": "sglang", "version": "x", "block_size": 1})])
    fx.write(root, "server_metrics", metrics_rows("vllm", "vllm:prefix_cache_queries_total"))
    inp = load.scan(root)
    assert load.server_kinds(inp) == ["vllm"]   # the run row's, not the engine record's
    m = load.server_metrics(inp)
    assert m.column("kind").to_pylist() == ["vllm", "vllm"] and m.column("run").to_pylist() == ["r1", "r1"]
    rep = analyze(root)
    assert rep["server"]["counts"] == COUNTS["block_pool"].format(title="vLLM")
    assert rep["metrics"]["rises"] == {"vllm:prefix_cache_queries_total": 15}
    fx.write(root, "runs", [fx.run_row(server_kind="sglang", server_version="0.5.23")], sch=schema.RUNS)
    rep = analyze(root)
    assert rep["server"]["counts"] == COUNTS["radix"].format(title="SGLang")
    assert rep["headline"][0].startswith("engine: sglang x; SGLang's radix cache")


def test_a_run_row_naming_no_server_is_not_taken_for_vllm(tmp_path):
    root = fx.build(tmp_path / "ds")
    fx.write(root, "runs", [fx.run_row(server_kind=None, server_version=None)], sch=schema.RUNS)
    fx.write(root, "server_metrics", metrics_rows(None, "vllm:prefix_cache_hits_total"))
    assert load.server_kinds(load.scan(root)) == []
    rep = analyze(root)
    assert rep["server"] == {"engines": [], "counts": NO_KIND}
    assert rep["metrics"]["local_hit_rate"] is None and "name no server kind" in rep["metrics"]["why_different"][0]
    assert compare(rep, rep)["base"]["engine"] is None
    # a server kvtrace started itself (attach -- CMD): discovery found none, its hook names it
    fx.write(root, "engine", [fx.hook({"t_ns": 0, "name": "sglang", "version": "x", "block_size": 1})])
    assert load.server_kinds(load.scan(root)) == ["sglang"]


def one_line_error(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 6, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["run row", "server_metrics", "engine record"])
def test_an_unknown_kind_is_one_line_exit_6(tmp_path, where):
    root = fx.build(tmp_path / "ds")
    if where == "run row":
        fx.write(root, "runs", [fx.run_row(server_kind="tgi")], sch=schema.RUNS)
    elif where == "server_metrics":
        fx.write(root, "server_metrics", metrics_rows("tgi", "tgi:hits_total"))
    else:   # the correlator reads each engine's cache model from its engine record
        fx.write(root, "engine", [fx.hook({"t_ns": 0, "name": "tgi", "version": "x", "block_size": 0})])
    command = "correlate" if where == "engine record" else "analyze"
    assert "unknown server kind 'tgi'" in one_line_error(command, root)


@pytest.mark.slow   # Spark's start-up takes minutes here
@pytest.mark.long   # Apache Spark, the second SQL engine: make test-long
def test_spark_reads_server_metrics_as_duckdb(tmp_path):
    """The samples load builds are given to Spark as to DuckDB (engine.load), to the same figures."""
    root = fx.build(tmp_path / "ds")
    fx.write(root, "server_metrics", metrics_rows("vllm", "vllm:prefix_cache_hits_total") +
             metrics_rows("vllm", "vllm:prefix_cache_queries_total", (100.0, 400.0)))
    rep = analyze(root)
    assert rep["metrics"]["rises"] == {"vllm:prefix_cache_hits_total": 15, "vllm:prefix_cache_queries_total": 300}
    fx.assert_spark_report_equals(root, rep)
