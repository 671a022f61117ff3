"""From an engine's kv-transfer config to its KV tier's server process (kvtrace.servers.tiers):
the config read as vLLM takes it (JSON, dotted keys, a MultiConnector's connectors), LMCache's
server recognised by its command line and port, and found among the host's real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import psutil
import pytest

from kvtrace.servers import lmcache, tiers
from tests.helpers import wait_for

MP = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 7311}}


def test_the_transfer_config_as_vllm_reads_it():
    argv = ["vllm", "serve", "m", "--kv-transfer-config", json.dumps(MP)]
    assert tiers.connectors(tiers.transfer_config(argv)) == [("LMCacheMPConnector", MP["kv_connector_extra_config"])]
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector"}, MP]}}
    got = tiers.connectors(tiers.transfer_config(["vllm", f"--kv_transfer_config={json.dumps(multi)}"]))
    assert [n for n, _ in got] == ["NixlConnector", "LMCacheMPConnector"]
    dotted = ["vllm", "--kv-transfer-config.kv_connector", "LMCacheMPConnector",
              "--kv-transfer-config.kv_connector_extra_config", '{"lmcache.mp.port": 7000}']
    assert tiers.connectors(tiers.transfer_config(dotted)) == [("LMCacheMPConnector", {"lmcache.mp.port": 7000})]
    assert tiers.transfer_config(["vllm", "--kv-transfer-config", "{not json"]) == {}
    assert tiers.connectors({}) == []


def test_lmcaches_server_endpoint_and_storage():
    assert lmcache.endpoint(MP["kv_connector_extra_config"]) == ("127.0.0.1", 7311)
    assert lmcache.endpoint({}) == ("localhost", 5555)   # the connector's defaults
    argv = ["/v/bin/python3", "-m", "lmcache.v1.multiprocess.server", "--port=7311",
            "--l2-adapter", '{"type": "fs", "base_path": "/d/l2"}', "--l2-adapter", '{"type": "mock"}']
    assert lmcache.recognise(argv) == 7311
    assert lmcache.storage(argv) == ["fs:/d/l2", "mock"]
    assert lmcache.recognise(["/v/bin/python", "-m", "lmcache.v1.multiprocess.server"]) == 5555
    assert lmcache.recognise(["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "7311"]) is None
    assert lmcache.recognise(["/bin/sh", "-c", "python -m lmcache.v1.multiprocess.server"]) is None
    # its L1's size, in bytes as LMCache reads --l1-size-gb (GiB); 0 when not given or not a size
    assert lmcache.l1_bytes(argv + ["--l1-size-gb", "0.25"]) == 1 << 28
    assert [lmcache.l1_bytes(argv + x) for x in ([], ["--l1-size-gb", "x"], ["--l1-size-gb=-1"], ["--l1-size-gb=inf"])] \
        == [0, 0, 0, 0]


LISTEN = ("import socket, sys, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('127.0.0.1', int(sys.argv[2]))); s.listen()\ntime.sleep(60)\n")


def _fake_server(tmp_path, port: int, listen: bool = True) -> subprocess.Popen:
    """A process whose command line is an LMCache server's (the script form) listening on its
    port (or, ``listen`` False, a decoy that only says so), which sleeps."""
    script = tmp_path / f"p{port}-{time.monotonic_ns()}" / "lmcache" / "v1" / "multiprocess" / "server.py"
    script.parent.mkdir(parents=True)
    script.write_text(LISTEN if listen else "import time\ntime.sleep(60)\n")
    return subprocess.Popen([sys.executable, str(script), "--port", str(port),
                             "--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path)})])


@pytest.fixture()
def spawned():
    procs = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_the_server_is_found_by_its_port_in_the_engines_namespace(tmp_path, spawned):
    engine = NS(pid=os.getpid(), cmdline=["vllm", "serve", "--kv-transfer-config", json.dumps(MP)])
    # another user's decoy: an LMCache server's command line on the engine's port, not listening
    decoy = _fake_server(tmp_path, 7311, listen=False)
    spawned.append(decoy)
    wait_for(lambda: lmcache.recognise(psutil.Process(decoy.pid).cmdline()) == 7311, 10, "the decoy's command line")
    assert tiers.find(engine) == []
    decoy.kill()
    decoy.wait()
    spawned.remove(decoy)
    spawned.append(_fake_server(tmp_path, 7311))
    spawned.append(_fake_server(tmp_path, 7312))     # another LMCache server: not this engine's
    (t,) = wait_for(lambda: tiers.find(engine), 10, "the fake server")
    assert (t.kind, t.pid, t.port, t.host, t.connector, t.same_netns) == \
        ("lmcache", spawned[0].pid, 7311, "127.0.0.1", "LMCacheMPConnector", True)
    assert t.pids[0] == spawned[0].pid and t.storage == [f"fs:{tmp_path}"]
    # a decoy beside the real one changes nothing
    spawned.append(_fake_server(tmp_path, 7311, listen=False))
    wait_for(lambda: lmcache.recognise(psutil.Process(spawned[-1].pid).cmdline()) == 7311, 10, "the decoy's command line")
    assert [x.pid for x in tiers.find(engine)] == [spawned[0].pid]
    # an engine without a tier connector has none
    assert tiers.find(NS(pid=os.getpid(), cmdline=["vllm", "serve"])) == []
