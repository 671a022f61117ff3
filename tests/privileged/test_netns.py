"""A server in a network namespace of its own (``unshare --net``, loopback only): unreachable
from kvtrace's namespace, found listening through /proc/PID/net, and scraped from inside by
the /metrics scraper, whose thread enters it (setns)."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvtrace.host import netns
from kvtrace.servers.procfs import listening
from kvtrace.servers.metrics import MetricsScraper
from tests.helpers import wait_for

pytestmark = pytest.mark.root

METRICS = "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 2304.0\n"
SERVE = f"""
import http.server, subprocess
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {METRICS!r}.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


@pytest.fixture
def server_in_netns():
    proc = subprocess.Popen(["unshare", "--net", sys.executable, "-c", SERVE])
    try:
        wait_for(lambda: ("127.0.0.1", 8000) in listening(proc.pid), 30, "the server to listen in its namespace")
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_scraped_from_inside_its_namespace(server_in_netns):
    pid = server_in_netns.pid
    path = netns.foreign(pid)
    assert path == f"/proc/{pid}/ns/net"
    url = "http://127.0.0.1:8000/metrics"
    with pytest.raises(urllib.error.URLError):   # not from kvtrace's own namespace: nothing listens there
        urllib.request.urlopen(url, timeout=2)
    body = netns.call(path, lambda: urllib.request.urlopen(url, timeout=5).read().decode(), timeout=10)
    assert body == METRICS

    scraper = MetricsScraper(url, interval=0.2, netns=path, kind="vllm", prefixes=("vllm:",))
    assert scraper.start() == []
    time.sleep(0.7)
    scraper.stop()
    st = scraper.stats()
    assert st["scrape_errors"] == 0 and st["scrapes"] >= 3
    rows = scraper.drain()["server_metrics"].to_pylist()
    assert {(r["name"], r["value"]) for r in rows} == {("vllm:prefix_cache_hits_total", 2304.0)}
    assert len(rows) == st["scrapes"]


def test_a_namespace_that_went_away_is_one_warning(server_in_netns):
    path = netns.foreign(server_in_netns.pid)
    server_in_netns.kill()
    server_in_netns.wait(10)
    scraper = MetricsScraper("http://127.0.0.1:8000/metrics", interval=10, netns=path, kind="vllm", prefixes=("vllm:",))
    (warning,) = scraper.start()
    scraper.stop(final_scrape=False)
    assert "unreachable" in warning and f"cannot open {path}" in warning and "\n" not in warning
