"""The hook's plan (kvtrace.hook.vllm.needs) checked against real vLLM code.

- On each release installed here (scripts/setup-vllm VERSION), the source check, which the
  agent makes from outside, and the check in vLLM's own interpreter, which install() makes,
  agree: every target as needed.
- On vLLM 0.33.0 (the GPU package, which cannot serve here; its wheel's Python files from
  scripts/setup-vllm-source): the source check passes, and so does the hook's own plan when
  0.33.0 is imported with this machine's CPU torch (0.32.0's venv, 0.33.0 first on the path).
- The check is honest: in a copy of 0.33.0's source, each changed target fails by name.
- A server whose vLLM differs is refused in one line, by `servers`, `inject` and `attach`, and
  attach goes on with the kernel probes, KV events and /metrics.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtrace.demo import workload
from kvtrace.demo.server import DEFAULT_RELEASE, VllmServer, release_python
from kvtrace.hook import support
from kvtrace.hook.vllm import support as vllm_support
from tests import helpers
from tests.vllm.conftest import SERVER_ARGS, free_port

NEWEST = "0.33.0"
NEWEST_SRC = Path(f"/var/cache/kvtrace/vllm-src-{NEWEST}")
INSTALLED = tuple(dict.fromkeys(("0.28.0", "0.30.0", "0.31.0", "0.32.0",
                                 *os.environ.get("KVTRACE_COMPAT", "").replace(",", " ").split())))

# Run in vLLM's interpreter: the plan install() makes (source and live), the file connector's.
LIVE = textwrap.dedent('''
    import json, logging, sys
    logging.disable(logging.WARNING)
    import vllm
    from kvtrace.hook import plan
    from kvtrace.hook.source import SourceTree
    from kvtrace.hook.vllm import needs, releases, targets
    src = SourceTree.of_imported_vllm()
    out = {"version": vllm.__version__, "root": src.root, "engine": targets.engine_plan()[1],
           "worker": targets.worker_plan()[1],
           "connector": plan.differences(needs.FILE_CONNECTOR, src, live=True) + releases.forms(src, releases.CONNECTOR_ROWS)[1],
           "releases": releases.forms(src)[0]}
    print("RESULT " + json.dumps(out))
''')


def run_live(python: str, pythonpath: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([python, "-c", LIVE], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[0][7:])


def site_of(python: str) -> str:
    return str(next(Path(python).parent.parent.glob("lib/python3*/site-packages")))


@pytest.mark.parametrize("version", INSTALLED)
def test_source_and_live_checks_agree_on_each_installed_release(version):
    py = release_python(version)
    if not Path(py).exists():
        pytest.skip(f"needs vLLM {version}'s venv: bash scripts/setup-vllm {version} (make compat installs all)")
    live = run_live(py)
    verdict = vllm_support.check(site_of(py))
    assert live["version"] == verdict["version"] == version
    assert (live["engine"], live["worker"], live["connector"]) == ([], [], []), live
    assert verdict["supported"] and verdict["roles"] == {"engine": [], "worker": []} and verdict["connector"] == []
    assert verdict["releases"] == live["releases"]
    # the rows of kvtrace.hook.vllm.releases, as the release notes say they came
    assert verdict["releases"]["connector_block_state"] == (version >= "0.30")
    assert verdict["releases"]["cache_hit_source"] == (version >= "0.32")


def newest_src() -> Path:
    if not (NEWEST_SRC / "vllm" / "_version.py").exists():
        pytest.skip(f"needs vLLM {NEWEST}'s source: bash scripts/setup-vllm-source {NEWEST}")
    return NEWEST_SRC


def test_newest_release_plan_from_its_source():
    verdict = vllm_support.check(str(newest_src()))
    assert verdict["version"] == NEWEST
    assert verdict["supported"], verdict["roles"]
    assert verdict["connector"] == [], verdict["connector"]
    assert all(verdict["releases"].values()), verdict["releases"]
    # what was read: the scheduler, the KV cache manager and block pool, the GPU model runner and
    # the connector mixin, the second-generation runner's connector, the attention layer's wait
    read = set(verdict["files"])
    for f in ("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/kv_cache_manager.py", "vllm/v1/core/block_pool.py",
              "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/kv_connector_model_runner_mixin.py",
              "vllm/v1/worker/gpu/kv_connector.py", "vllm/model_executor/layers/attention/kv_transfer_utils.py"):
        assert f in read, f


def test_newest_release_plan_imported_with_the_cpu_torch():
    src = newest_src()
    py = release_python(DEFAULT_RELEASE)
    if not Path(py).exists():
        pytest.skip(f"needs the vLLM venv ({py}; make setup-vllm)")
    live = run_live(py, pythonpath=str(src))
    assert live["version"] == NEWEST and live["root"] == str(src)
    assert (live["engine"], live["worker"], live["connector"]) == ([], [], []), live


# (file, text, replacement, the difference the check must name)
CHANGES = [
    ("vllm/v1/core/kv_cache_manager.py", "        new_computed_blocks: KVCacheBlocks | None = None,",
     "        computed_blocks: KVCacheBlocks | None = None,",
     "KVCacheManager.allocate_slots: parameter 'new_computed_blocks' missing"),
    ("vllm/v1/core/block_pool.py", "def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:",
     "def _maybe_evict_cached_block(self, blk: KVCacheBlock) -> bool:",
     "BlockPool._maybe_evict_cached_block: parameter 'block' missing (takes self, blk)"),
    ("vllm/v1/core/sched/scheduler.py", "def schedule(self, throttle_prefills: bool = False)",
     "def schedule(self, *, throttle_prefills: bool = False)",
     "Scheduler.schedule: has a keyword-only parameter 'throttle_prefills'"),
    ("vllm/v1/core/sched/scheduler.py", "        self, request: Request, timestamp: float, drop_stale_output: bool = False",
     "        self, req: Request, timestamp: float, drop_stale_output: bool = False",
     "Scheduler._preempt_request: parameter 'request' missing (takes self, req, timestamp, drop_stale_output)"),
    ("vllm/v1/request.py", "        self.num_preemptions = 0", "        self.preemptions = 0",
     "Request: attribute 'num_preemptions' missing"),
    ("vllm/v1/core/sched/output.py", "    preempted_req_ids: set[str]", "    preempted_ids: set[str]",
     "SchedulerOutput: field 'preempted_req_ids' missing"),
    ("vllm/v1/worker/kv_connector_model_runner_mixin.py", "kv_connector.bind_connector_metadata(",
     "kv_connector.bind_metadata(",
     "KVConnectorModelRunnerMixin._get_kv_connector_output: no longer calls bind_connector_metadata()"),
    ("vllm/distributed/kv_transfer/kv_connector/factory.py", "    @classmethod\n    def create_connector(",
     "    @staticmethod\n    def create_connector(",
     "KVConnectorFactory.create_connector: is not a classmethod"),
]


@pytest.fixture(scope="module")
def newest_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("vllm-src") / "tree"
    shutil.copytree(newest_src(), dst)
    return dst


@pytest.mark.parametrize("change", CHANGES, ids=[c[3].split(":")[0] for c in CHANGES])
def test_newest_plan_fails_when_a_target_changes(newest_copy, change):
    rel, old, new, want = change
    path = newest_copy / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel} no longer holds {old!r}: update this test row"
    assert vllm_support.check(str(newest_copy))["supported"]
    path.write_text(text.replace(old, new))
    try:
        verdict = vllm_support.check(str(newest_copy))
        found = [d for r in verdict["roles"].values() for d in r]
        assert not verdict["supported"] and len(found) == 1 and found[0].startswith(want), found
        assert support.reason(verdict) == found[0]
    finally:
        path.write_text(text)


def test_newest_plan_fails_live_when_a_signature_changes(newest_copy):
    """The same change seen by the hook in vLLM's interpreter (0.33.0 imported, then checked)."""
    py = release_python(DEFAULT_RELEASE)
    if not Path(py).exists():
        pytest.skip(f"needs the vLLM venv ({py}; make setup-vllm)")
    rel, old, new, want = CHANGES[0]
    path = newest_copy / rel
    text = path.read_text()
    path.write_text(text.replace(old, new).replace("new_computed_blocks", "computed_blocks"))
    try:
        live = run_live(py, pythonpath=str(newest_copy))
    finally:
        path.write_text(text)
    assert live["version"] == NEWEST
    assert live["engine"] and live["engine"][0].startswith(want), live["engine"]
    assert live["worker"] == []


# ---------------------------------------------------------------------------------------------
# A server whose vLLM differs: 0.32.0 with Scheduler._preempt_request's first parameter renamed
# (its callers pass it by position, so the server runs as before)


def shadow_vllm(site: Path, dst: Path) -> Path:
    """A vLLM package at dst/.../site-packages/vllm whose files are links to ``site``'s, but for
    a changed copy of the scheduler; the server imports it through PYTHONPATH."""
    root = dst / "lib" / "python3.11" / "site-packages"
    helpers.link_tree(site / "vllm", root / "vllm", hard=True)
    sched = root / "vllm/v1/core/sched/scheduler.py"
    text = sched.read_text()
    old = "        self, request: Request, timestamp: float, drop_stale_output: bool = False\n    ) -> None:\n"
    assert text.count(old) == 1
    doc_end = text.index('"""', text.index('"""', text.index(old)) + 3) + 3
    text = text[:doc_end] + "\n        request = req" + text[doc_end:]
    sched.unlink()   # a hard link: the real file stays as it was
    sched.write_text(text.replace(old, old.replace("request: Request", "req: Request")))
    return root


@pytest.mark.root
def test_a_release_that_differs_is_refused_and_capture_goes_on(tmp_path):
    py = release_python(DEFAULT_RELEASE)
    if not Path(py).exists():
        pytest.skip(f"needs the vLLM venv ({py}; make setup-vllm)")
    root = shadow_vllm(Path(site_of(py)), tmp_path / "shadow")
    zport = free_port(8180, 8199)
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}"}
    server = VllmServer(args=[*SERVER_ARGS, "--kv-events-config", json.dumps(kv)], python=py,
                        port=free_port(8100, 8179, avoid=(zport,)), env={"PYTHONPATH": str(root)},
                        workdir=tmp_path / "server")
    server.start()
    want = "Scheduler._preempt_request: parameter 'request' missing (takes self, req, timestamp, drop_stale_output)"
    try:
        # the plugin, in vLLM's interpreter at start, refused it (nothing patched)
        assert f"kvtrace hook inactive (nothing patched): vLLM 0.32.0 differs: {want}" in server.log_path.read_text()
        # kvtrace servers, from outside
        p = subprocess.run([sys.executable, "-m", "kvtrace", "servers", "--json"], capture_output=True, text=True, timeout=120)
        (info,) = [s for s in json.loads(p.stdout) if s["port"] == server.port]
        assert info["site_packages"] == str(root) and info["hook"]["supported"] is False
        assert info["hook"]["reason"] == want, info["hook"]
        p = subprocess.run([sys.executable, "-m", "kvtrace", "servers"], capture_output=True, text=True, timeout=120)
        assert f"server {server.proc.pid}: vLLM 0.32.0: hook refused: {want}" in p.stdout, p.stdout
        # kvtrace inject: refused before touching the process
        engine = server.processes()["engine"][0]
        p = subprocess.run([sys.executable, "-m", "kvtrace", "inject", "--pid", str(engine)], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 1 and p.stderr.strip() == f"kvtrace: vLLM 0.32.0 refused by the hook: {want}", p.stderr
        # kvtrace attach: one line says so, and the capture goes on without the hook
        out = tmp_path / "ds"
        agent = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--quiet", "--port", str(server.port),
                                  "--out", str(out)], stderr=subprocess.PIPE, text=True)
        lines = []
        while not any("signals missing" in x for x in lines):
            line = agent.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        results = workload.run(server.url, server.model, workload.shared_prefix(seed=5, groups=2, per_group=2, fillers=1))
        time.sleep(1.5)
        agent.send_signal(signal.SIGINT)
        _, rest = agent.communicate(timeout=120)
        assert agent.returncode == 0, "".join(lines) + rest
    finally:
        server.stop()
    refusals = [x for x in lines if "refused by the hook" in x]
    assert refusals == [f"kvtrace: vLLM 0.32.0 refused by the hook: {want}\n"], lines
    assert not any("injected" in x for x in lines)
    assert not any(r.error for r in results)
    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(out)
    assert "hook_start" not in ds.names() and "step" not in ds.names(), ds.names()
    assert ds.table("file_io").num_rows > 0 and ds.table("server_metrics").num_rows > 0
    assert sum(1 for e in ds.table("kv_events").to_pylist() if e["event"] == "BlockStored") > 0
