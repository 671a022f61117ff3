"""LMCache's server wrappers (kvtrace.hook.lmcache) on stand-ins of its storage manager, prefetch
controller, fs L2 adapter (coroutines on an event loop of their own, as LMCache runs them),
transfer strategy and L1 eviction controller, made with the hook's own wrapper factories, with an
agent attached.  What the agent decodes from the marker frames is what each call implies.  (The
same against a real LMCache server: tests/lmcache/test_lmcache.py.)"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from kvtrace.hook import state
from kvtrace.hook.lmcache import hook, tier
from tests import hookframes


class Bitmap:
    def __init__(self, idx):
        self.idx = list(idx)

    def popcount(self):
        return len(self.idx)

    def get_indices_list(self):
        return list(self.idx)


class Obj:
    def __init__(self, size):
        self.size = size

    def get_size(self):
        return self.size


class StorageManager:
    def submit_prefetch_task(self, spec, external_request_id="", skip_l2=False):
        return NS(prefetch_request_id=spec.pid, external_request_id=external_request_id,
                  total_requested_keys=spec.keys)

    def query_prefetch_status(self, handle):
        return handle.result


class PrefetchController:
    def __init__(self, adapters):
        self._l2_adapters = adapters

    def _submit_load_tasks(self, request, reserved_objs):
        request.inflight_load_tasks = {0: request.task}


class FSL2Adapter:
    def __init__(self):
        self._completed_load_tasks = {}

    async def _execute_load(self, keys, objects, task_id):
        await asyncio.sleep(0.002)
        self._completed_load_tasks[task_id] = Bitmap(range(len(keys) - (1 if "missing" in keys else 0)))

    async def _execute_store(self, keys, objects, task_id):
        if "bad" in keys:
            raise OSError("disk full")


class PickleTransferStrategy:
    def prepare_retrieve(self, key, instance_id, resolve_obj_keys):
        return NS(success=True, data=b"x" * 1000)

    def commit_store(self, key, instance_id, cpu_data, context, resolve_obj_keys):
        return key.start == 0


class L1EvictionController:
    def execute_eviction_action(self, action):
        return None


STANDINS = {c.__name__: c for c in (StorageManager, PrefetchController, FSL2Adapter, PickleTransferStrategy,
                                    L1EvictionController)}
for _label, _factory in hook.WRAPPERS.items():
    _cls, _name = _label.split(".")
    setattr(STANDINS[_cls], _name, _factory(STANDINS[_cls].__dict__[_name]))


@pytest.fixture
def received(tmp_path, monkeypatch):
    """Records the agent decodes, by table, from every frame the hook sent (after its timer's send)."""
    monkeypatch.setattr(tier.G, "version", "0.5.6")
    tier.G.reset()
    with hookframes.receiver(tmp_path, monkeypatch, settle=0.25) as records:
        yield records
    tier.G.reset()


def test_a_lookup_its_l2_read_and_the_retrieve_name_the_engines_request(received):
    sm, fs = StorageManager(), FSL2Adapter()
    pc = PrefetchController([fs])
    # one lookup of 3 chunks for two key rows (2 KV cache groups): chunk 0 in L1, 1 and 2 from L2
    handle = sm.submit_prefetch_task(NS(pid=7, keys=6), external_request_id="cmpl-a-0-1")
    pc._submit_load_tasks(NS(request_id=7, task=41), {})
    asyncio.run(fs._execute_load(["k1", "k2", "k3", "k4"], [Obj(1000)] * 4, 41))
    handle.result = NS(l1_hit_cells=[Bitmap([0]), Bitmap([0])], l2_hit_cells=[Bitmap([1, 2]), Bitmap([1, 2])],
                       l1_hit_count=2, l2_hit_count=4)
    assert sm.query_prefetch_status(NS(**{**vars(handle), "result": None})) is None   # still running: nothing
    sm.query_prefetch_status(handle)
    key = NS(start=0, end=768, request_id="cmpl-a-0-1")
    assert PickleTransferStrategy().prepare_retrieve(key, 0, None).success
    got = received()
    (start,) = got["hook_start"]
    assert (start["role"], start["vllm_version"]) == ("tier", "0.5.6") and "engine" not in got
    (lookup,) = got["tier_lookup"]
    assert (lookup["request"], lookup["chunks"], lookup["l1"], lookup["l2"], lookup["l2_chunks"], lookup["tier"]) == \
        ("cmpl-a-0-1", 3, 1, 2, [1, 2], "lmcache")
    read, ret = sorted(got["tier_op"], key=lambda r: r["t_start_ns"])
    assert (read["op"], read["request"], read["keys"], read["nbytes"], read["ok"]) == ("l2_read", "cmpl-a-0-1", 4, 4000, 1)
    assert read["t_end_ns"] - read["t_start_ns"] >= 2_000_000
    assert (ret["op"], ret["request"], ret["num_tokens"], ret["nbytes"], ret["ok"]) == ("retrieve", "cmpl-a-0-1", 768, 1000, 1)


def test_stores_writes_failures_and_evictions(received):
    fs, tx = FSL2Adapter(), PickleTransferStrategy()
    assert tx.commit_store(NS(start=0, end=256, request_id="r"), 0, b"y" * 500, None, None) is True
    assert tx.commit_store(NS(start=256, end=512, request_id="r"), 0, b"y" * 500, None, None) is False
    asyncio.run(fs._execute_store(["a", "b"], [Obj(10), Obj(20)], 1))
    with pytest.raises(OSError, match="disk full"):        # LMCache's own error goes on up, recorded as failed
        asyncio.run(fs._execute_store(["bad"], [Obj(5)], 2))
    asyncio.run(fs._execute_load(["x", "missing"], [Obj(7), Obj(7)], 3))   # a task no lookup made: no request
    L1EvictionController().execute_eviction_action(NS(keys=["a", "b", "c"]))
    ops = sorted(((r["op"], r["request"], r["keys"], r["num_tokens"], r["nbytes"], r["ok"]) for r in received()["tier_op"]))
    assert ops == [("evict", "", 3, 0, 0, 1), ("l2_read", "", 2, 0, 14, 0), ("l2_write", "", 1, 0, 5, 0),
                   ("l2_write", "", 2, 0, 30, 1), ("store", "r", 0, 256, 500, 0), ("store", "r", 0, 256, 500, 1)]


def test_without_an_agent_nothing_is_recorded(received, tmp_path, monkeypatch):
    monkeypatch.setattr(state.T, "flag_path", str(tmp_path / "nobody"))
    state.T.enabled, state.T.next_check = False, 0
    PickleTransferStrategy().prepare_retrieve(NS(start=0, end=256, request_id="r"), 0, None)
    asyncio.run(FSL2Adapter()._execute_store(["a"], [Obj(1)], 1))
    assert not state._Q and tier.G.timer is None
