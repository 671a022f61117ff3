"""Finding SGLang servers from their command lines, and where kvtrace reads their KV events."""
from __future__ import annotations

import json

import pytest

from kvtrace.servers import kvendpoints
from kvtrace.servers.vllm import discover
from kvtrace.servers.sglang.discover import kv_events_from_args, server_kind


@pytest.mark.parametrize("argv,kind", [
    (["/v/bin/python", "-m", "sglang.launch_server", "--model-path", "m"], "module"),
    (["python3.11", "-m", "sglang.cli.main", "serve", "--model-path", "m"], "module"),
    (["/v/bin/sglang", "serve", "--model-path", "m"], "cli"),
    (["/v/bin/python", "/v/bin/sglang", "serve"], "cli"),
    (["/v/bin/sglang", "version"], None),
    (["python", "-m", "sglang.bench_serving"], None),
    (["python", "-c", "import sglang"], None),
    (["sglang::scheduler"], None),
    (["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"], None),
])
def test_server_kind(argv, kind):
    assert server_kind(argv) == kind
    assert discover.server_kind(argv) is None or kind is None   # never both engines


def test_kv_events_config():
    cfg = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5599", "bind": True, "topic": "kv"}
    kv = kv_events_from_args(["python", "-m", "sglang.launch_server", "--kv-events-config", json.dumps(cfg), "--dp-size", "2"])
    assert (kv.enabled, kv.endpoint, kv.bind, kv.topic, kv.dp_size) == (True, "tcp://127.0.0.1:5599", True, "kv", 2)
    off = kv_events_from_args(["python", "-m", "sglang.launch_server", "--kv-events-config", '{"endpoint": "tcp://*:1"}'])
    assert off.enabled is False and off.publisher == "null"
    assert kv_events_from_args(["python", "-m", "sglang.launch_server"]) is None
    bad = kv_events_from_args(["python", "-m", "sglang.launch_server", "--kv-events-config", "{not json"])
    assert bad.enabled is False


def test_an_explicit_bind_decides_who_connects():
    # SGLang binds a concrete address when told to: kvtrace connects to it
    assert kvendpoints.subscriber_endpoint("tcp://127.0.0.1:5599", publisher_binds=True) == ("tcp://127.0.0.1:5599", False)
    assert kvendpoints.subscriber_endpoint("tcp://0.0.0.0:5599", publisher_binds=True) == ("tcp://127.0.0.1:5599", False)
    # told to connect: kvtrace binds, even for a wildcard
    assert kvendpoints.subscriber_endpoint("tcp://*:5599", publisher_binds=False) == ("tcp://*:5599", True)
    # unset: vLLM's rule
    assert kvendpoints.subscriber_endpoint("tcp://*:5599") == ("tcp://127.0.0.1:5599", False)
    assert kvendpoints.subscriber_endpoint("tcp://127.0.0.1:5599") == ("tcp://127.0.0.1:5599", True)
