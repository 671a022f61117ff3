"""KV-event payload decoding (no vLLM, no root): the recorded vLLM sample, other versions'
shapes, and fuzzed garbage — nothing raises, everything unusable is counted."""
from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.dataset import schema
from kvtrace.servers import kvevents
from kvtrace.servers.kvevents import Decoder, to_table

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-kv-events-sample.jsonl"
enc = msgspec.msgpack.encode


def sample_lines() -> list[dict]:
    if not DATA.exists():
        pytest.skip(f"missing {DATA}")
    return [json.loads(ln) for ln in DATA.read_text().splitlines() if ln.strip()]


def decode(payload: bytes, seq: int = 0, replayed: bool = False):
    d = Decoder()
    cols = kvevents._new_cols()
    n = d.rows(cols, payload, seq, 1000, replayed)
    return d, n, to_table(cols).to_pylist()


def test_recorded_sample_rows_match_the_batches():
    for line in sample_lines():
        batch = line["batch"]
        d, n, rows = decode(enc(batch), seq=line["seq"])
        ev = batch[1][0]
        assert d.bad_payloads == d.bad_events == d.bad_fields == 0
        assert n == len(rows) == len(ev["block_hashes"])
        assert [r["block_hash"] for r in rows] == ev["block_hashes"]
        assert rows[0]["parent_hash"] == ev["parent_block_hash"]
        assert [r["parent_hash"] for r in rows[1:]] == ev["block_hashes"][:-1]  # the chain
        assert all(r["event"] == "BlockStored" and r["seq"] == line["seq"] for r in rows)
        assert all(r["token_count"] == 32 and r["block_size"] == 32 and r["medium"] == "GPU" for r in rows)
        assert all(r["spec_kind"] == "full_attention" and r["group_idx"] == 0 and r["dp_rank"] == 0 for r in rows)
        assert rows[0]["batch_wall_ns"] == int(batch[0] * 1e9)
        assert [r["session_id"] for r in rows] == [ev.get("session_id")] * n
        toks = ev["token_ids"]
        want = [int.from_bytes(hashlib.blake2b(array("q", toks[i * 32:(i + 1) * 32]).tobytes(), digest_size=8).digest(), "little")
                for i in range(n)]
        assert [r["tokens_hash"] for r in rows] == want


def test_rows_never_hold_token_ids():
    t = schema.TABLES["kv_events"]
    assert "token_ids" not in t.names
    assert not any(pa.types.is_nested(f.type) for f in t)  # one scalar per column: no id lists
    (line, *_) = sample_lines()
    _, _, rows = decode(enc(line["batch"]))
    assert all(not isinstance(v, (list, tuple, bytes)) for r in rows for v in r.values())


def test_table_schema_is_the_dataset_schema():
    (line, *_) = sample_lines()
    d = Decoder()
    cols = kvevents._new_cols()
    d.rows(cols, enc(line["batch"]), 1, 2, False)
    assert to_table(cols).schema == schema.TABLES["kv_events"].remove(schema.TABLES["kv_events"].get_field_index("server"))  # + the port: serverset.Tagged


def test_removed_cleared_and_unknown_events():
    batch = [1796033116.5, [
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    ], 3]
    d, n, rows = decode(enc(batch))
    assert n == 4
    assert [(r["event"], r["block_hash"], r["event_idx"], r["block_idx"]) for r in rows] == [
        ("BlockRemoved", 1, 0, 0), ("BlockRemoved", 2, 0, 1), ("AllBlocksCleared", None, 1, None),
        ("SomethingNew", None, 2, None)]
    assert all(r["dp_rank"] == 3 for r in rows)
    assert d.events == {"BlockRemoved": 1, "AllBlocksCleared": 1, "SomethingNew": 1}


def test_other_version_shapes():
    # Older vLLM: events as tagged arrays, batch without dp rank, hashes as Python ints (signed).
    old = [1.5, [["BlockStored", [-1, 5], None, list(range(32)), 16, None, "CPU"],
                 ["BlockRemoved", [7]]]]
    d, n, rows = decode(enc(old))
    assert d.bad_events == 0 and n == 3
    assert rows[0]["block_hash"] == (1 << 64) - 1  # -1 wrapped to uint64
    assert rows[1]["parent_hash"] == (1 << 64) - 1
    assert [r["token_count"] for r in rows[:2]] == [16, 16]
    assert rows[0]["medium"] == "CPU" and rows[0]["dp_rank"] is None
    assert rows[2]["event"] == "BlockRemoved" and rows[2]["block_hash"] == 7
    # Map-shaped batch; bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) go through vLLM's conversion.
    h = bytes(range(32))
    m = {"ts": 2.0, "events": [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                                 "token_ids": [1, 2, 3], "block_size": 0, "lora_id": 7, "medium": None,
                                 "lora_name": "ad", "session_id": "s"}], "data_parallel_rank": 1}
    d, n, rows = decode(enc(m))
    assert n == 1
    assert rows[0]["block_hash"] == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert (rows[0]["token_count"], rows[0]["lora_id"], rows[0]["lora_name"], rows[0]["session_id"]) == (3, 7, "ad", "s")
    # Offload placeholders: no tokens, block size 0.
    d, n, rows = decode(enc([3.0, [{"type": "BlockStored", "block_hashes": [9, 10], "parent_block_hash": None,
                                    "token_ids": [], "block_size": 0, "lora_id": None, "medium": "STORAGE"}]]))
    assert n == 2 and rows[0]["token_count"] is None and rows[0]["tokens_hash"] is None


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"not msgpack at all", enc(5), enc("x"), enc([]), enc([1.0]), enc([1.0, 5]),
    enc({"ts": 1}), enc(None), b"\x92\xcb",
])
def test_garbage_payloads_are_counted(payload):
    d, n, rows = decode(payload)
    assert n is None and rows == [] and d.bad_payloads == 1


def test_bad_events_are_skipped_rest_kept():
    batch = [1.0, [5, None, ["BlockStored"], {"type": 3}, {"type": "BlockStored", "block_hashes": "x"},
                   {"type": "BlockRemoved", "block_hashes": [1, "bad", 2.5, True, 3]},
                   {"type": "BlockStored", "block_hashes": [4], "token_ids": ["a"], "block_size": 1}]]
    d, n, rows = decode(enc(batch))
    assert d.bad_events == 5  # 5, None, ["BlockStored"] (no hashes), type 3, hashes "x"
    assert [r["block_hash"] for r in rows] == [1, None, None, None, 3, 4]
    assert d.bad_fields == 4  # "bad", 2.5, True, and the unhashable token ids
    assert rows[-1]["tokens_hash"] is None


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=40))
_value = st.recursive(_scalar, lambda c: st.one_of(st.lists(c, max_size=5), st.dictionaries(st.text(max_size=6), c, max_size=5)),
                      max_leaves=30)
_field_names = st.sampled_from(list(kvevents.FIELDS[kvevents.STORED]) + ["type", "x"])
_event = st.one_of(
    _value,
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Zzz"])},
                          optional={"block_hashes": st.one_of(_value, st.lists(_scalar, max_size=6)),
                                    "parent_block_hash": _scalar, "token_ids": st.one_of(_value, st.lists(st.integers(-(2 ** 63), 2 ** 64 - 1), max_size=70)),
                                    "block_size": _scalar, "medium": _scalar, "lora_id": _scalar, "group_idx": _scalar,
                                    "session_id": _scalar, "kv_cache_spec_kind": _scalar}),
    st.lists(st.one_of(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]), _value), max_size=8),
    st.dictionaries(_field_names, _value, max_size=6),
)
_batch = st.one_of(
    st.tuples(st.one_of(st.floats(), st.integers(-(2 ** 63), 2 ** 64 - 1), _scalar), st.lists(_event, max_size=6), _scalar).map(list),
    st.tuples(_scalar, st.lists(_event, max_size=4)).map(list),
    st.fixed_dictionaries({"ts": _scalar, "events": st.one_of(_value, st.lists(_event, max_size=4))}),
    _value,
)


def _check(payload: bytes) -> None:
    d = Decoder()
    cols = kvevents._new_cols()
    n = d.rows(cols, payload, 7, 1, False)
    t = to_table(cols)  # every value fits its column type
    assert t.num_rows == (n or 0)
    assert (n is None) == (d.bad_payloads == 1)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(payload):
    _check(payload)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_batch)
def test_fuzz_structured_garbage(batch):
    _check(enc(batch))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_truncated_and_flipped_sample(data):
    line = data.draw(st.sampled_from(sample_lines()))
    payload = bytearray(enc(line["batch"]))
    cut = data.draw(st.integers(0, len(payload)))
    for _ in range(data.draw(st.integers(0, 4))):
        i = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if payload:
            payload[i] = data.draw(st.integers(0, 255))
    _check(bytes(payload[:cut]))


def test_endpoint_rules_follow_vllm():
    assert kvevents.subscriber_endpoint("tcp://*:5557") == ("tcp://127.0.0.1:5557", False)
    assert kvevents.subscriber_endpoint("tcp://[::ffff:127.0.0.1]:5557") == ("tcp://[::ffff:127.0.0.1]:5557", False)
    assert kvevents.subscriber_endpoint("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", True)  # vLLM connects out
    assert kvevents.subscriber_endpoint("ipc:///tmp/kv.sock", root="/proc/9/root") == ("ipc:///proc/9/root/tmp/kv.sock", False)
    with pytest.raises(ValueError):
        kvevents.subscriber_endpoint("inproc://x")
    assert kvevents.replay_address("tcp://*:5558") == "tcp://127.0.0.1:5558"
    assert kvevents.rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert kvevents.rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert kvevents.rank_endpoint(None, 1) is None
    assert kvevents.tcp_hostport("tcp://[::ffff:127.0.0.1]:5557") == ("127.0.0.1", 5557)


def test_every_later_field_by_name_and_re_reported_stores_marked_reused():
    """vLLM 0.33's BlockStored fields beyond the first ones, each kept by name (lookahead token ids
    as a count only); a BlockStored of a block already stored (kv_cache_report_mode "full"
    re-reports reused prefix blocks) is marked reused, until the block is removed or cleared."""
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": list(range(8)),
              "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": "ad1",
              "extra_keys": [["ad1", ["mm0", 3], "salt-x"], None], "group_idx": 1,
              "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 512, "locality": "LOCAL",
              "ownership": "cpu-offload", "session_id": "s1", "lookahead_token_ids": [[5, 6, 7], [8, 9, 10]]}
    again = dict(stored, block_hashes=[11])
    other_group = dict(stored, block_hashes=[11], group_idx=0)
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 1, "locality": "REMOTE",
               "ownership": "nixl"}
    d = Decoder()
    cols = kvevents._new_cols()
    for k, evs in enumerate(([stored], [again, other_group], [removed], [again], [{"type": "AllBlocksCleared"}],
                             [again])):
        d.rows(cols, enc([1.0, evs, 0]), k, 1000, False)
    rows = to_table(cols).to_pylist()
    first = rows[0]
    assert (first["extra_keys"], first["spec_window"], first["locality"], first["ownership"], first["lookahead_tokens"]) \
        == ('["ad1",["mm0",3],"salt-x"]', 512, "LOCAL", "cpu-offload", 3)
    assert rows[1]["extra_keys"] is None and rows[1]["lookahead_tokens"] == 3
    assert [(r["event"], r["block_hash"], r["group_idx"], r["reused"]) for r in rows] == [
        ("BlockStored", 11, 1, False), ("BlockStored", 12, 1, False),
        ("BlockStored", 11, 1, True),      # re-reported: still stored in group 1
        ("BlockStored", 11, 0, False),     # another group's block
        ("BlockRemoved", 11, 1, None),
        ("BlockStored", 11, 1, False),     # stored again after its removal
        ("AllBlocksCleared", None, None, None),
        ("BlockStored", 11, 1, False)]     # and after a clear
    assert (rows[4]["locality"], rows[4]["ownership"]) == ("REMOTE", "nixl")
    assert d.reused == 1 and d.bad_fields == 0
    assert all("token_ids" not in r and "lookahead_token_ids" not in r for r in rows)
