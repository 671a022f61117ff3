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
