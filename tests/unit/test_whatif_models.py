"""The replay's cache models (kvtrace.analysis.whatif.models): one for every server kind, chosen by
its descriptor, and each one's books balanced at the end of a replay of a real dataset (every
page let go, all of the cache free or evictable)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.analysis.whatif import MODELS, Replay, Req, Workload, model_for, workload
from kvtrace.servers import registry

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


def test_every_server_kind_has_its_cache_model():
    assert {registry.kind(n).cache_model for n in registry.names()} <= set(MODELS)
    assert all(m.name == key for key, m in MODELS.items())
    assert model_for("vllm") is MODELS["block_pool"] and model_for("sglang") is MODELS["radix"]


def test_a_workload_of_an_unknown_kind_is_not_replayed():
    wl = Workload([Req("r", 0, 4, 1, [1, 2, 3, 4])], 1, {}, (1e6, 0.0, 0.0), [], kind="tgi")
    with pytest.raises(registry.UnknownServerKind) as e:
        Replay(wl, 256, 1, 10)
    assert e.value.exit_code == 6


@pytest.mark.parametrize("name, size", [("vllm-0.32.0", 65), ("sglang-0.5.23", 1500)])
def test_a_replay_lets_every_page_go(name, size):
    wl = workload(RECORDED / name)
    r = Replay(wl, wl.recorded["chunk_size"], wl.block_size, size)
    s = r.run()
    assert s["requests"] == len(wl.reqs) and s["evictions"] > 0
    snap = r.model.snapshot()
    assert snap["held"] == 0 and snap["cached"] > 0
    assert snap["free_capacity"] == size - type(r.model).null_blocks
