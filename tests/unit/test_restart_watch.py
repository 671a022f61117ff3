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
    return NS(pid=pid, port=port, engine_pids=list(engines), worker_pids=list(workers),
              pids=[pid, *engines, *workers], metrics_url=None)


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
    source, pipeline = Source(), NS(ctx=DecodeContext(), pids=[old_api.pid, old_engine.pid])
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
