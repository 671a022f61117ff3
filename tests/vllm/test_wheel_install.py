"""What a user installs, used as a user would: the wheel built from a clean copy of the tree,
installed (not editable) into a fresh venv that sees Debian's bcc, run from outside the
checkout: ``kvtrace doctor``, a live ``kvtrace attach --port`` on a real vLLM server (the hook
injected, its records checked against vLLM's answers, a clean stop), ``kvtrace analyze`` of
the result; and the same wheel in vLLM's own venv (``--no-deps``), whose plugin entry point
loads the hook and patches the real vLLM."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kvtrace.dataset.reader import Dataset
from kvtrace.demo import workload
from kvtrace.demo.server import VllmServer, vllm_python
from tests.helpers import reset_prefix_cache
from tests.packaging import REPO
from tests.vllm.conftest import SERVER_ARGS, KvEventSink, free_port, vllm_skip_reason
from tests.vllm_checks import check_evictions, check_requests, removed_hashes

pytestmark = pytest.mark.root


def run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd="/", **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    zport = free_port(8260, 8279)
    events = KvEventSink(zport).start()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    srv = VllmServer(args=[*SERVER_ARGS, "--kv-events-config", json.dumps(kv)], port=free_port(8240, 8259),
                     env={"VLLM_PLUGINS": "", "VLLM_SERVER_DEV_MODE": "1"}, workdir=tmp_path_factory.mktemp("wheel"))
    srv.start()
    try:
        yield srv, events
    finally:
        srv.stop()
        events.close()


def test_installed_wheel_doctor_attach_analyze(wheel_venv, server, tmp_path):
    srv, events = server
    kvtrace = wheel_venv / "bin/kvtrace"
    r = run([kvtrace, "doctor"])
    assert r.returncode == 0, r.stdout + r.stderr

    reset_prefix_cache(srv.url)
    out = tmp_path / "ds"
    agent = subprocess.Popen([str(kvtrace), "attach", "--quiet", "--port", str(srv.port), "--out", str(out)],
                             stderr=subprocess.PIPE, text=True, cwd="/")
    lines = []
    while not any("vLLM hook" in l and "engine" in l for l in lines):
        line = agent.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
    t0 = time.monotonic_ns()
    reqs = workload.shared_prefix(seed=41, groups=2, per_group=3, prefix_len=600, suffix_len=400, fillers=3, filler_len=1000)
    results = workload.run(srv.url, srv.model, reqs)
    time.sleep(1.5)
    t1 = time.monotonic_ns()
    agent.send_signal(2)
    _, rest = agent.communicate(timeout=120)
    text = "".join(lines) + rest
    assert agent.returncode == 0, text
    assert any("injected in engine" in l for l in lines), text
    assert all(not r.error for r in results)

    ds = Dataset.open(out)
    got = check_requests(ds, results)
    evicted = check_evictions(ds, removed_hashes(events.between(t0, t1)))

    r = run([kvtrace, "analyze", out, "--json"])
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    reuse = report["reuse"]   # the report's totals, against the workload's own account of vLLM's answers
    assert (reuse["requests"], reuse["prompt_tokens"], reuse["hit_tokens"]) == (
        len(results), sum(x.prompt_tokens for x in results), got["cached_tokens"])
    assert report["timing"]["chunks"] == got["chunks"]
    assert report["chunking"]["evictions"]["evictions"] == evicted
    assert report["metrics"]["rises"]["vllm:prefix_cache_hits_total"] == got["cached_tokens"]


PLUGIN_CHECK = r"""
import json, kvtrace, kvtrace.hook.vllm.plugin as plugin
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvtrace"]
load_general_plugins()                      # vLLM's own loader calls register(): no role here, nothing patched
from kvtrace.hook.vllm import hook
from kvtrace.hook import fileconnector as old_fc, plugin as old_plugin   # the earlier names, for one release
from kvtrace.hook.vllm import fileconnector as fc
before = hook.status()["installed"]
patched = hook.install(roles=["engine"])
print(json.dumps({"file": kvtrace.__file__, "ep": ep.value, "loaded": ep.load() is plugin.register,
                  "shims": old_plugin.register is plugin.register and old_fc.KvtraceFileConnector is fc.KvtraceFileConnector,
                  "before": before, "patched": patched, "status": hook.status()}, default=str))
"""


def test_wheel_in_vllms_venv_loads_the_hook(built_dist):
    """``pip install --no-deps`` of the wheel into vLLM's venv; the editable checkout is put back after."""
    if vllm_skip_reason():
        pytest.skip(vllm_skip_reason())
    py = vllm_python()
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    try:
        r = run([*pip, "--force-reinstall", built_dist[0]])
        assert r.returncode == 0, r.stderr[-2000:]
        r = run([py, "-c", PLUGIN_CHECK], env={"PATH": "/usr/bin:/bin", "VLLM_CPU_KVCACHE_SPACE": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.splitlines()[-1])
        assert "site-packages" in got["file"] and not got["file"].startswith(str(REPO)), got
        assert got["ep"] == "kvtrace.hook.vllm.plugin:register" and got["loaded"] and got["shims"], got
        assert got["before"] is False and got["patched"] is True and got["status"]["installed"] is True, got
    finally:
        r = run([*pip, "-e", REPO])
        assert r.returncode == 0, f"could not put the editable checkout back in {py}: {r.stderr[-2000:]}"
