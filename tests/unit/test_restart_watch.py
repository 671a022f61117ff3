"""The vLLM server watch behind `kvtrace attach --on-restart` without vLLM or root: real
processes stand in for the old and the new server; discovery is given.  exit stops with one
line; follow says it waits, keeps waiting while nothing (or nothing healthy) is on the port,
then adds every new process to the target set, injects again when it had, and records it."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

from kvtrace.capture.events import DecodeContext
from kvtrace.attach.restart import ServerWatch

NS = types.SimpleNamespace


def server(pid, port=8650, engines=(), workers=()):
    return NS(pid=pid, port=port, api_pids=[pid], engine_pids=list(engines), worker_pids=list(workers), other_pids=[],
              pids=[pid, *engines, *workers], metrics_url=None, kind="vllm", version="0.32.0")


class Writer:
    def __init__(self):
        self.tables = []

    def add(self, name, table):
        self.tables.append((name, table.to_pylist()))


class Source:
    def __init__(self):
        self.added = []

    def add_target(self, pid):
        self.added.append(pid)


@pytest.fixture
def procs():
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_exit_mode_stops_once_the_api_server_is_gone(procs):
    api, engine = procs[0], procs[1]
    said = []
    w = ServerWatch(server(api.pid, engines=[engine.pid]), "exit", Source(), NS(ctx=DecodeContext(), pids=[]),
                    echo=said.append, out="/data/ds", every_s=0.0, discover=lambda: [])
    assert w.poll() is None and said == []
    api.kill()
    api.wait()
    assert w.poll() == "vLLM server exited"
    (line,) = said
    assert f"port 8650 (pid {api.pid}) exited; stopping" in line and "/data/ds" in line and "\n" not in line


def test_follow_waits_then_retargets_and_reinjects(procs):
    old_api, old_engine, new_api, new_engine = procs
    said, found, injected = [], [], []
    source, pipeline = Source(), NS(ctx=DecodeContext(), pids=[old_api.pid, old_engine.pid], writer=Writer())
    new = server(new_api.pid, engines=[new_engine.pid])

    def reinject(s):
        injected.append(s.pid)
        return NS(results=[NS(pid=new_engine.pid, installed=True)])

    w = ServerWatch(server(old_api.pid, engines=[old_engine.pid]), "follow", source, pipeline, reinject=reinject,
                    echo=said.append, every_s=0.0, discover=lambda: list(found))
    old_api.kill()
    old_api.wait()
    assert w.poll() is None and w.waiting and "waiting for a vLLM server on port 8650" in said[0]
    w.next = 0
    found.append(server(new_api.pid, port=8651, engines=[new_engine.pid]))   # another port: not ours
    found.append(server(new_api.pid, engines=[]))                             # no EngineCore yet
    assert w.poll() is None and w.waiting and source.added == []
    found[:] = [new]
    w.next = 0
    assert w.poll() is None and not w.waiting
    assert source.added == [new_api.pid, new_engine.pid] and injected == [new_api.pid]
    assert pipeline.pids == [old_api.pid, old_engine.pid, new_api.pid, new_engine.pid]
    (name, rows), = pipeline.writer.tables   # the servers table joins the new pids to the port
    assert name == "servers" and [(r["pid"], r["role"], r["server"], r["api_pid"]) for r in rows] == \
        [(new_api.pid, "api", 8650, new_api.pid), (new_engine.pid, "engine", 8650, new_api.pid)]
    assert "again after" in said[-1] and f"tracing pid {new_api.pid}" in said[-1] and "injected again in 1" in said[-1]
    (r,) = w.stats()["restarts"]
    assert (r["old_pid"], r["new_pid"], r["reinjected"]) == (old_api.pid, new_api.pid, [new_engine.pid])
    assert r["found_ns"] >= r["gone_ns"] > 0
    # the new server is watched now: its exit is noticed in turn
    new_api.kill()
    new_api.wait()
    w.next = 0
    assert w.poll() is None and w.waiting and f"(pid {new_api.pid}) exited" in said[-1]


def test_on_restart_needs_a_vllm_server(tmp_path):
    from tests.conftest import run_kvtrace

    p = run_kvtrace("attach", "--on-restart", "follow", "--out", str(tmp_path / "ds"), "--", "true")
    assert p.returncode == 2 and "--on-restart applies to a vLLM server" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "ds").exists()
    p = run_kvtrace("attach", "--on-restart", "sometimes", "--out", str(tmp_path / "ds"), "--", "true")
    assert p.returncode == 2 and "sometimes" in p.stderr


def test_several_servers_stop_when_every_one_has_exited(procs):
    """attach --port A --port B: one server gone does not end the capture; the last one does."""
    from kvtrace.attach.serverset import Watches

    a, b = procs[0], procs[1]
    said = []
    ws = [ServerWatch(server(p.pid, port=port), "exit", Source(), NS(ctx=DecodeContext(), pids=[]),
                      echo=said.append, every_s=0.0, discover=lambda: []) for p, port in ((a, 8650), (b, 8651))]
    both = Watches([ws[0], None, ws[1]])   # None: a server with no port to watch
    assert both.poll() is None
    a.kill()
    a.wait()
    assert both.poll() is None and len(said) == 1 and "port 8650" in said[0]
    assert both.poll() is None and len(said) == 1   # said once
    b.kill()
    b.wait()
    assert both.poll() == "every traced server exited (vLLM server exited)"
    assert both.injections() == [None, None, None]


def test_stream_rows_name_their_server():
    """A stream's rows carry the port of the server they came from; its counters stay its own."""
    import pyarrow as pa

    from kvtrace.attach.serverset import Tagged, stated, table

    class Stream:
        name = "server_metrics"

        def drain(self):
            return {"server_metrics": pa.table({"ts_ns": pa.array([1, 2], pa.uint64())})}

        def stats(self):
            return {"scrapes": 2}

        def lost(self):
            return 3

    t = Tagged(Stream(), 8123)
    assert t.drain()["server_metrics"].column("server").to_pylist() == [8123, 8123]
    assert t.stats() == {"scrapes": 2, "server": 8123} and t.lost() == 3 and t.name == "server_metrics"
    s1, s2 = server(11, port=8001, engines=[12]), server(21, port=8002, engines=[22])
    assert table([s1, s2]).select(["server", "pid", "role"]).to_pylist() == [
        {"server": 8001, "pid": 11, "role": "api"}, {"server": 8001, "pid": 12, "role": "engine"},
        {"server": 8002, "pid": 21, "role": "api"}, {"server": 8002, "pid": 22, "role": "engine"}]
    assert stated([s1, s2]) == ("vllm", "0.32.0")
    s2.version = "0.31.0"
    assert stated([s1, s2]) == ("vllm", None)
