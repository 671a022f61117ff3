"""When the hook sends `hook_start` and the cache snapshot (`cached`), in vLLM's and SGLang's
engine wrappers, driven on stand-in schedulers with a flag directory of this test's own: once
when recording begins, once more for each agent that arrives later (the hook cannot tell one
attaching to this server from one tracing other processes; that agent's capture needs the
snapshot at its attach), and never when an agent leaves.  (What the correlator makes of several
snapshots: tests/unit/test_causes.py; against real servers: tests/vllm/test_snapshot_order.py,
tests/sglang/test_snapshot_order.py.)"""
from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest

from kvtrace.hook import state
from kvtrace.hook.sglang import engine as sglang_engine
from kvtrace.hook.vllm import engine


@pytest.fixture
def flag(tmp_path, monkeypatch):
    """The hook's flag directory, empty; agents come as entries named by a live pid."""
    d = tmp_path / "agents"
    d.mkdir()
    monkeypatch.setattr(state.T, "flag_path", str(d))
    state.T.enabled, state.T.next_check = False, 0
    engine.S.reset()
    sglang_engine.G.reset()
    state._Q.clear()
    others = []

    def agent(pid: int | None = None) -> int:
        if pid is None:
            p = subprocess.Popen(["sleep", "60"])
            others.append(p)
            pid = p.pid
        (d / str(pid)).write_text(f"{pid}\n")
        return pid

    def gone(pid: int) -> None:
        (d / str(pid)).unlink()

    yield SimpleNamespace(agent=agent, gone=gone)
    for p in others:
        p.kill()
        p.wait()
    engine.S.reset()
    sglang_engine.G.reset()
    state._Q.clear()
    state.T.enabled, state.T.next_check = False, 0


def sent() -> list[str]:
    """The names of the records queued since the last call."""
    names = [r[0] for r in state._Q]
    state._Q.clear()
    return names


def vllm_step(sched) -> list[str]:
    state.T.next_check = 0            # the flag is re-read (the hook does it once a second)
    engine._schedule_pre(sched)
    sched.current_step += 1
    return [n for n in sent() if n in ("hook_start", "engine", "cached")]


def vllm_scheduler():
    block = SimpleNamespace(block_hash=b"\x00" * 8 + (5).to_bytes(8, "big") + b"\x00" * 4, block_id=1)
    pool = SimpleNamespace(blocks=[block], cached_block_hashes_by_block={})
    return SimpleNamespace(requests={}, current_step=0, running=[], waiting=[],
                           kv_cache_manager=SimpleNamespace(block_pool=pool))


def test_vllm_a_snapshot_at_the_attach_and_at_each_arrival_none_at_a_departure(flag):
    sched = vllm_scheduler()
    me = flag.agent(os.getpid())
    assert vllm_step(sched) == ["hook_start", "engine", "cached"]        # recording begins
    assert vllm_step(sched) == []
    other = flag.agent()                                                  # another agent arrives
    assert vllm_step(sched) == ["hook_start", "engine", "cached"]
    assert vllm_step(sched) == []
    flag.gone(other)                                                      # ... and leaves
    assert vllm_step(sched) == []
    assert vllm_step(sched) == []
    flag.gone(me)                                                         # no agent: off
    assert vllm_step(sched) == [] and not engine.S.on


def sglang_scheduler():
    return SimpleNamespace(forward_ct=0, tree_cache=SimpleNamespace(metrics_collector=None))


def sglang_step(sched) -> list[str]:
    state.T.next_check = 0
    sglang_engine._next_pre(sched)
    sched.forward_ct += 1
    return [n for n in sent() if n in ("hook_start", "engine", "cached")]


def test_sglang_a_snapshot_at_the_attach_and_at_each_arrival_none_at_a_departure(flag):
    sched = sglang_scheduler()
    me = flag.agent(os.getpid())
    assert sglang_step(sched) == ["hook_start", "engine", "cached"]
    other = flag.agent()
    assert sglang_step(sched) == ["hook_start", "engine", "cached"]
    flag.gone(other)
    assert sglang_step(sched) == []
    third = flag.agent()                                                   # a later one: its own again
    assert sglang_step(sched) == ["hook_start", "engine", "cached"]
    flag.gone(third)
    flag.gone(me)
    assert sglang_step(sched) == [] and not sglang_engine.G.on


def test_vllm_groups_and_each_groups_share_of_the_snapshot(flag):
    """A stand-in hybrid scheduler: group 0 a 64-token sliding window, group 1 full attention.
    Block 1 is cached in group 1 under hash 5, block 2 in group 0 under hash 5 and (a second
    key) hash 6: `cached` has every key, `cached_in` each group's."""
    def key(h: int, g: int) -> bytes:
        return b"\x00" * 8 + h.to_bytes(8, "big") + g.to_bytes(4, "big")

    blocks = [SimpleNamespace(block_hash=key(5, 1), block_id=1), SimpleNamespace(block_hash=key(5, 0), block_id=2),
              SimpleNamespace(block_hash=None, block_id=3)]
    pool = SimpleNamespace(blocks=blocks, cached_block_hashes_by_block={2: [key(5, 0), key(6, 0)]})
    Spec = type("SlidingWindowSpec", (), {"block_size": 32, "sliding_window": 64, "page_size_bytes": 4096})
    Full = type("FullAttentionSpec", (), {"block_size": 32, "page_size_bytes": 4096})
    cfg = SimpleNamespace(num_blocks=100, kv_cache_groups=[SimpleNamespace(kv_cache_spec=Spec(), layer_names=["l0"]),
                                                           SimpleNamespace(kv_cache_spec=Full(), layer_names=["l1"])])
    coord = SimpleNamespace(hash_block_size=32, scheduler_block_size=32, retention_interval=0,
                            single_type_managers=[SimpleNamespace(block_size=32, use_eagle=False)] * 2)
    sched = SimpleNamespace(requests={}, current_step=3, running=[], waiting=[], block_size=32, kv_cache_config=cfg,
                            kv_cache_manager=SimpleNamespace(block_pool=pool, coordinator=coord))
    flag.agent(os.getpid())
    state.T.next_check = 0
    engine._schedule_pre(sched)
    recs = list(state._Q)
    state._Q.clear()
    assert [r[2:] for r in recs if r[0] == "kv_group"] == [
        (0, "sliding_window", 32, 64, 1, 4096, 32, 32, 100, 0, False),
        (1, "full_attention", 32, 0, 1, 4096, 32, 32, 100, 0, False)]
    assert [r[4:] for r in recs if r[0] == "cached"] == [(0, 3, [5, 5, 6])]
    assert [r[2:] for r in recs if r[0] == "cached_in"] == [(0, 0, 2, [5, 6]), (1, 0, 1, [5])]
    assert [r[0] for r in recs].index("kv_group") < [r[0] for r in recs].index("cached")
