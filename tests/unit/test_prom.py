"""Prometheus text parser and /metrics scraper (no vLLM, no root)."""
from __future__ import annotations

import http.server
import json
import math
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.dataset import schema
from kvtrace.servers import metrics

SAMPLE = Path("/work/shared/research/vllm-metrics-sample.txt")
LOCAL_SAMPLE = Path(__file__).resolve().parents[1] / "data" / "vllm-metrics-sample.txt"


def sample_text() -> str:
    for p in (LOCAL_SAMPLE, SAMPLE):
        if p.exists():
            return p.read_text()
    pytest.skip(f"no metrics sample at {LOCAL_SAMPLE} or {SAMPLE}")


def test_parses_the_vllm_sample_without_errors():
    text = sample_text()
    p = metrics.parse(text)
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert p.errors == 0
    assert len(p.samples) == len(lines) == 430
    assert p.value("vllm:prefix_cache_hits_total") == 10368.0
    assert p.value("vllm:prefix_cache_queries_total") == 16700.0
    assert p.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 10368.0
    assert p.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 6332.0
    assert p.value("vllm:num_preemptions_total") == 0.0
    assert p.value("vllm:kv_cache_usage_perc") == 0.0
    assert p.type_of("vllm:prefix_cache_hits_total") == "counter"
    assert p.type_of("vllm:kv_cache_usage_perc") == "gauge"
    assert p.type_of("vllm:e2e_request_latency_seconds_bucket") == "histogram"
    info = [s for s in p.samples if s.name == "vllm:cache_config_info"][0]
    assert dict(info.labels)["block_size"] == "32"


def test_rows_keep_vllm_families_and_drop_created():
    p = metrics.parse(sample_text())
    cols = metrics.rows(p, ts_ns=123, kind="vllm", prefixes=("vllm:",))
    names = set(cols["name"])
    assert all(n.startswith("vllm:") for n in names)
    assert not any(n.endswith("_created") for n in names)
    for want in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:prompt_tokens_by_source_total", "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc"):
        assert want in names
    t = metrics.to_table(cols)
    assert t.schema == schema.TABLES["server_metrics"].remove(schema.TABLES["server_metrics"].get_field_index("server"))  # + the port: serverset.Tagged
    assert set(t.column("ts_ns").to_pylist()) == {123}
    i = cols["name"].index("vllm:prompt_tokens_by_source_total")
    assert json.loads(cols["labels"][i]) == {"engine": "0", "model_name": "tinyllama", "source": "local_compute"}
    assert cols["labels"][i] == '{"engine":"0","model_name":"tinyllama","source":"local_compute"}'  # sorted, compact


@pytest.mark.parametrize("line,name,labels,value", [
    ('a 1', "a", {}, 1.0),
    ('a{} 1', "a", {}, 1.0),
    ('a{b="c",} 2.5e3', "a", {"b": "c"}, 2500.0),
    ('a{b="x\\"y\\\\z\\n"} -1', "a", {"b": 'x"y\\z\n'}, -1.0),
    ('a{b="}{,= "} 3 1700000000000', "a", {"b": "}{,= "}, 3.0),
    ('vllm:x_bucket{le="+Inf"} +Inf', "vllm:x_bucket", {"le": "+Inf"}, math.inf),
    ('a  7 # {trace_id="1"} 1.0', "a", {}, 7.0),
    ('a{ b = "c" , d="e" } 1', "a", {"b": "c", "d": "e"}, 1.0),
])
def test_sample_lines(line, name, labels, value):
    p = metrics.parse(line)
    assert p.errors == 0, line
    (s,) = p.samples
    assert (s.name, dict(s.labels), s.value) == (name, labels, value)


def test_nan_value():
    (s,) = metrics.parse("a NaN").samples
    assert math.isnan(s.value)


@pytest.mark.parametrize("line", [
    "a", "a{", 'a{b="c"', 'a{b="c} 1', "a{b=c} 1", "1a 1", "a 1 2 3", "a one", "a{b=\"c\"}1x",
    'a{b="c",b="d"} 1', "{} 1", "a 1_000", "a\x00 1", "a{b=\"c\"", "# TYPE a nonsense",
])
def test_garbage_lines_are_counted(line):
    p = metrics.parse(line + "\nok 1\n")
    assert p.errors == 1
    assert [s.name for s in p.samples] == ["ok"]


def test_bytes_and_non_text_input():
    assert metrics.parse(b"a 1\n\xff\xfe 2\n").errors == 1
    assert metrics.parse(None).errors == 1
    assert metrics.parse(12).errors == 1


_line_chars = st.sampled_from(list('abz_:{}="\\,# \t.+-eE0123456789InfNa\n\x00é'))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300), st.lists(_line_chars, max_size=200).map("".join)))
def test_fuzz_never_raises(text):
    p = metrics.parse(text)
    n_lines = len((text.decode("utf-8", "replace") if isinstance(text, bytes) else text).splitlines())
    assert p.errors + len(p.samples) <= n_lines
    metrics.to_table(metrics.rows(p, 1, prefixes=(), drop_suffixes=()))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_sample_lines(data):
    lines = sample_text().splitlines()
    line = data.draw(st.sampled_from([ln for ln in lines if not ln.startswith("#")]))
    pos = data.draw(st.integers(0, len(line)))
    junk = data.draw(st.text(max_size=5))
    mutated = line[:pos] + junk + line[pos + data.draw(st.integers(0, 3)):]
    p = metrics.parse(mutated)
    assert p.errors + len(p.samples) <= max(1, len(mutated.splitlines()))


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_scraper_records_scrapes_and_final_one(http_server):
    _Handler.body = b"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine=\"0\"} 5\nother 1\ngarbage{\n"
    _Handler.status = 200
    url = f"http://127.0.0.1:{http_server.server_address[1]}/metrics"
    s = metrics.MetricsScraper(url, interval=0.05, kind="vllm", prefixes=("vllm:",))
    assert s.start() == []
    import time

    time.sleep(0.3)
    _Handler.body = b"vllm:prefix_cache_hits_total{engine=\"0\"} 9\n"
    s.stop()
    t = s.drain()["server_metrics"]
    st_ = s.stats()
    assert st_["scrapes"] >= 3 and st_["scrape_errors"] == 0
    assert st_["parse_errors"] >= 1
    assert set(t.column("name").to_pylist()) == {"vllm:prefix_cache_hits_total"}
    assert t.column("value").to_pylist()[-1] == 9.0  # the scrape taken at stop
    ts = t.column("ts_ns").to_pylist()
    assert ts == sorted(ts)


def test_scraper_unreachable_warns_once_and_counts(http_server):
    port = http_server.server_address[1]
    http_server.shutdown()
    http_server.server_close()
    s = metrics.MetricsScraper(f"http://127.0.0.1:{port}/metrics", interval=0.05, timeout=0.5)
    warnings = s.start()
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    import time

    time.sleep(0.2)
    s.stop(final_scrape=False)
    assert s.drain() == {}
    assert s.stats()["scrape_errors"] >= 2
    assert s.lost() == s.stats()["scrape_errors"]


def test_scraper_http_error(http_server):
    _Handler.status = 500
    _Handler.body = b"oops"
    s = metrics.MetricsScraper(f"http://127.0.0.1:{http_server.server_address[1]}/metrics", interval=10)
    assert "HTTP 500" in s.start()[0]
    s.stop(final_scrape=False)
    _Handler.status = 200
