"""Any KV connector as the scheduler sees it (kvtrace.hook.vllm.connector), on stand-ins of vLLM's
scheduler, KV cache manager and connector output: the blocks and bytes of each load counted from
the block ids vLLM hands the connector, async completions, failures and invalid blocks mapped to
their requests; an async load's second allocation leaves the admission's hit as the first said.
The records go through the wire codec and the agent's decoder, as from a live hook."""
from __future__ import annotations

import struct
from types import SimpleNamespace as NS

import pytest

from kvtrace.capture import events, usermark
from kvtrace.capture.events import DecodeContext
from kvtrace.hook.vllm import connector, engine, targets
from kvtrace.hook.wire import CODEC, MAGIC

NULL = 0
PAGE = 2 * 32 * 2 * 64 * 2   # K and V, 32 tokens, 2 KV heads, head size 64, 2 bytes (bf16): one layer's block


def decoded(recs) -> dict[str, list[dict]]:
    frame = MAGIC + b"".join(CODEC.encoders[r[0]](*r) for r in recs)
    head = usermark.HDR.pack(events.KIND_USER, 1, 32 + len(frame), 0, 1000, 42, 43)
    return usermark.records([head + struct.pack("<II", len(frame), 0) + frame], DecodeContext())


@pytest.fixture()
def hook():
    engine._Q.clear()
    engine.S.reset()
    connector.C.reset()
    yield
    engine._Q.clear()
    engine.S.reset()
    connector.C.reset()


def scheduler(groups, blocks_by_req, step=5):
    """A scheduler with a connector; groups: [(tokens per block, layers)]."""
    spec = [NS(kv_cache_spec=NS(block_size=bs, page_size_bytes=PAGE * bs // 32), layer_names=[f"l{i}" for i in range(n)])
            for bs, n in groups]
    kvm = NS(block_pool=NS(null_block=NS(block_id=NULL)), get_block_ids=lambda rid: blocks_by_req[rid],
             get_block_ids_for_computed_tokens=lambda request_id, num_computed_tokens: tuple(
                 ids[:-(-num_computed_tokens // bs)] for ids, (bs, _) in zip(blocks_by_req[request_id], groups)))
    inner = [type("LMCacheMPConnector", (), {})(), type("ExampleConnector", (), {})()]
    conn = type("MultiConnector", (), {"_connectors": inner})()
    return NS(connector=conn, kv_cache_manager=kvm, kv_cache_config=NS(kv_cache_groups=spec), current_step=step)


def test_a_loads_blocks_and_bytes_come_from_the_block_ids_vllm_hands_the_connector(hook):
    # one full-attention group of 2 layers, one sliding-window group of 1 layer whose blocks
    # below the window are vLLM's null block
    blocks = {"r1": ([11, 12, 13, 14, 15, 16], [NULL, NULL, 23, 24, 25, 26])}
    sched = scheduler([(32, 2), (32, 1)], blocks)
    connector.start(sched)
    assert connector.C.conn == "MultiConnector(LMCacheMPConnector+ExampleConnector)"
    req = NS(request_id="r1", num_computed_tokens=0)
    connector.note_alloc(sched.kv_cache_manager, 5, req, 32, 96, True)   # local 1 block, then 3 to load
    (rec,) = decoded(list(engine._Q))["kv_alloc"]
    # group 0: blocks 12, 13, 14 at 2 layers; group 1: NULL (not counted), 23, 24 at 1 layer
    assert (rec["first"], rec["external"], rec["blocks"], rec["async"]) == (32, 96, 5, 1)
    assert rec["nbytes"] == 3 * 2 * PAGE + 2 * 1 * PAGE
    assert connector.C.loads["r1"] == {12, 13, 14, 23, 24}


def test_async_completions_failures_and_invalid_blocks_name_their_requests(hook):
    blocks = {"a": ([1, 2, 3],), "b": ([4, 5, 6],), "c": ([7, 8],)}
    sched = scheduler([(32, 1)], blocks, step=9)
    connector.start(sched)
    for rid in blocks:
        connector.note_alloc(sched.kv_cache_manager, 8, NS(request_id=rid, num_computed_tokens=0), 0, 64, True)
    engine._Q.clear()
    out = NS(finished_recving={"a", "b"}, failed_recving={"b", "z"}, finished_sending={"s"}, invalid_block_ids={5, 8, 99})
    t = connector.xfer_pre(sched, out)
    connector.xfer_post(sched, t, None)
    rows = decoded(list(engine._Q))
    done = sorted((r["request"], r["direction"], r["ok"], r["step"]) for r in rows["kv_done"])
    assert done == [("a", "load", 1, 9), ("b", "load", 0, 9), ("s", "store", 1, 9), ("z", "load", 0, 9)]
    invalid = sorted((r["request"], r["blocks"]) for r in rows["kv_invalid"])
    # b's failed block comes with its completion (vLLM allows it up to that step); 99 is no load's
    assert invalid == [("", 1), ("b", 1), ("c", 1)]
    assert set(connector.C.loads) == {"c"}


def test_a_requests_end_counts_the_blocks_of_its_computed_tokens(hook):
    blocks = {"r": ([1, 2, 3, 4],)}
    sched = scheduler([(32, 3)], blocks)
    connector.start(sched)
    req = NS(request_id="r", num_computed_tokens=70)       # 3 blocks (the third partly filled)
    connector.finished_post(sched, connector.finished_pre(sched, req), (True, None))
    (rec,) = decoded(list(engine._Q))["kv_finish"]
    assert (rec["blocks"], rec["nbytes"], rec["delay_free"], rec["connector"]) == (3, 3 * 3 * PAGE, 1, connector.C.conn)


def test_nothing_is_recorded_without_a_connector_or_a_recording(hook):
    sched = scheduler([(32, 1)], {"r": ([1],)})
    sched.connector = None
    connector.start(sched)
    assert connector.xfer_pre(sched, NS()) is None and connector.finished_pre(sched, NS()) is None
    connector.note_alloc(sched.kv_cache_manager, 1, NS(request_id="r", num_computed_tokens=0), 0, 32, False)
    assert not engine._Q


def test_an_async_loads_second_allocation_keeps_the_admissions_hit(hook, monkeypatch):
    """vLLM allocates an async-loading request twice: with its hit (local 64, external 512)
    while it waits, then, loaded, with nothing new; the admit record must carry the first."""
    monkeypatch.setattr(engine.S, "rec", True)
    calls = []

    class Manager:
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_external_computed_tokens=0, delay_cache_blocks=False):
            calls.append(num_new_tokens)
            return "blocks"

        def get_block_ids(self, rid):
            return (list(range(1, 40)),)

    sched = scheduler([(32, 1)], {})
    connector.start(sched)
    alloc = targets._inlined(engine.ALLOCATE_BODY, engine.ALLOC_PARAMS)(Manager.allocate_slots)
    req = NS(request_id="q", num_computed_tokens=0)
    hit = NS(blocks=[[NS(block_hash=None)] * 2])
    alloc(Manager(), req, 0, 64, hit, num_external_computed_tokens=512, delay_cache_blocks=True)
    req.num_computed_tokens = 576                                  # the load finished
    alloc(Manager(), req, 136, 0, NS(blocks=[[]]), num_external_computed_tokens=0)
    assert engine.S.alloc["q"][:3] == (64, 512, 2)
    (rec,) = decoded([r for r in engine._Q if r[0] == "kv_alloc"])["kv_alloc"]
    assert (rec["first"], rec["external"], rec["blocks"], rec["nbytes"], rec["async"]) == (64, 512, 16, 16 * PAGE, 1)
    # a fresh request allocated with no hit after a failed allocation is not kept from before
    engine.S.alloc["f"] = (64, 0, 2, 0)
    alloc(Manager(), NS(request_id="f", num_computed_tokens=0), 32, 0, NS(blocks=[[]]))
    assert engine.S.alloc["f"][:2] == (0, 0)
