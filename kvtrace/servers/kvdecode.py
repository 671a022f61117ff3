"""Decoding of vLLM's KV-event batches (msgpack ``KVEventBatch``) into ``kv_events`` rows.

Split from kvtrace.servers.kvevents (which re-exports every name here); the wire format is
described there.  Both event shapes decode (tagged maps, and the older arrays whose field order
is ``FIELDS``); anything else is counted, never raised.  Token ids are never stored: only their
count and a 64-bit hash per block.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter, OrderedDict

import pyarrow as pa

from kvtrace.dataset import schema

TABLE = "kv_events"
MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
PRESENT_MAX = 4_000_000   # blocks the decoder remembers as stored (to mark re-reported ones), at most
EXTRA_MAX = 512           # characters of one block's extra keys kept

# Positional field order of the array-encoded (older) event form, after the tag.
FIELDS = {
    STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
             "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    REMOVED: ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    CLEARED: (),
}

# Columns (documented in docs/schema.md):
#   recv_ns        CLOCK_MONOTONIC when kvtrace received the batch (replayed: when replay delivered it)
#   seq            the publisher's batch sequence number
#   batch_wall_ns  KVEventBatch.ts (publisher's wall clock, end of the engine step) in ns
#   event_idx      position of the event in its batch; block_idx: of the block in its event
#   block_hash     vLLM's int form (low 64 bits); parent_hash: the previous block in the chain
#   token_count / tokens_hash  count and blake2b-64 of the block's token ids (ids are not kept)
#   extra_keys     the block's entry of extra_keys (LoRA name, (mm id, offset) pairs, cache_salt,
#                  embedding digests) as compact JSON, at most EXTRA_MAX characters
#   reused         a BlockStored of a (block, group, medium) the stream already stored and did not
#                  remove: kv_cache_report_mode "full" reports reused prefix blocks so
# the stream's own columns: `server` (the port) is added by the capture that knows it (kvtrace.attach.serverset)
SCHEMA = schema.TABLES[TABLE].remove(schema.TABLES[TABLE].get_field_index("server"))
COLUMNS = SCHEMA.names


def _new_cols() -> dict[str, list]:
    return {c: [] for c in COLUMNS}


def to_table(cols: dict[str, list]) -> pa.Table:
    return pa.table({c: pa.array(cols[c], SCHEMA.field(c).type) for c in COLUMNS}, schema=SCHEMA)



def block_hash(h) -> int | None:
    """vLLM's external block hash as uint64: ints keep their low 64 bits (negative Python
    hashes of old versions wrap), bytes go through vLLM's own int conversion."""
    if isinstance(h, bool):
        return None
    if isinstance(h, int):
        return h & MASK64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h), "big") & MASK64 if len(h) else None
    return None


def tokens_hash(tokens) -> int | None:
    try:
        return int.from_bytes(hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest(), "little")
    except (TypeError, OverflowError, ValueError):
        return None


def _int(v, lo=-(1 << 63), hi=(1 << 63) - 1):
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def _str(v, limit=256):
    return v[:limit] if isinstance(v, str) else None


def _per_block(v) -> list | None:
    """A per-block list field (extra_keys, lookahead_token_ids), or None."""
    return list(v) if isinstance(v, (list, tuple)) else None


def _bytes_hex(v):
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    raise TypeError(type(v).__name__)


class Decoder:
    """Payload bytes → rows.  Never raises on input; counts what it could not use."""

    def __init__(self):
        import msgspec

        self._dec = msgspec.msgpack.Decoder()
        self._err = msgspec.DecodeError
        self.bad_payloads = 0   # not msgpack, or not a batch shape
        self.bad_events = 0     # an event that is not a known shape (skipped)
        self.bad_fields = 0     # a field of the wrong type (row kept, value null)
        self.events = Counter()
        self.present: OrderedDict = OrderedDict()   # (hash, group, medium) stored and not removed
        self.present_dropped = 0   # forgotten past PRESENT_MAX (a re-report of one reads as new)
        self.reused = 0

    def batch(self, payload: bytes):
        """(ts, events, dp_rank) or None."""
        try:
            obj = self._dec.decode(payload)
        except Exception:
            self.bad_payloads += 1
            return None
        if isinstance(obj, (list, tuple)) and len(obj) >= 2:
            ts, events, dp = obj[0], obj[1], obj[2] if len(obj) > 2 else None
        elif isinstance(obj, dict) and "events" in obj:
            ts, events, dp = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
        else:
            self.bad_payloads += 1
            return None
        if not isinstance(events, (list, tuple)):
            self.bad_payloads += 1
            return None
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not -9e9 < ts < 9e9:
            ts = None
        return ts, events, _int(dp, -(1 << 31), (1 << 31) - 1)

    @staticmethod
    def event_fields(ev) -> tuple[str, dict] | None:
        if isinstance(ev, dict):
            tag = ev.get("type")
            return (tag, ev) if isinstance(tag, str) else None
        if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
            names = FIELDS.get(ev[0])
            if names is None:
                return ev[0], {}
            return ev[0], dict(zip(names, ev[1:]))
        return None

    def rows(self, cols: dict[str, list], payload: bytes, seq: int, recv_ns: int, replayed: bool) -> int | None:
        """Append this batch's rows to cols; the number of rows, or None if the payload is unusable."""
        b = self.batch(payload)
        if b is None:
            return None
        ts, events, dp = b
        wall_ns = int(ts * 1e9) if ts is not None else None
        n = 0
        for i, ev in enumerate(events):
            tf = self.event_fields(ev)
            if tf is None:
                self.bad_events += 1
                continue
            tag, f = tf
            try:
                n += self._event_rows(cols, tag, f, seq, recv_ns, wall_ns, dp, i, replayed)
            except Exception:  # a shape this code did not foresee: skip the event, keep going
                self.bad_events += 1
        return n

    def _event_rows(self, cols, tag, f, seq, recv_ns, wall_ns, dp, i, replayed) -> int:
        tag = tag[:64]
        hashes = f.get("block_hashes")
        if tag in (STORED, REMOVED) and not isinstance(hashes, (list, tuple)):
            self.bad_events += 1
            return 0
        self.events[tag] += 1
        common = {
            "recv_ns": recv_ns, "seq": seq, "batch_wall_ns": wall_ns, "dp_rank": dp, "event_idx": i,
            "event": tag, "medium": _str(f.get("medium"), 32), "group_idx": _int(f.get("group_idx"), -(1 << 31), (1 << 31) - 1),
            "replayed": replayed,
        }
        if tag == CLEARED:
            self.present.clear()
        if tag == CLEARED or not isinstance(hashes, (list, tuple)):
            self._append(cols, common, block_idx=None, block_hash=None, parent_hash=None)
            return 1
        if tag == REMOVED:
            common.update(locality=_str(f.get("locality"), 32), ownership=_str(f.get("ownership"), 64))
            for j, h in enumerate(hashes):
                v = block_hash(h)
                if v is None:
                    self.bad_fields += 1
                self.present.pop((v, common["group_idx"], common["medium"]), None)
                self._append(cols, common, block_idx=j, block_hash=v, parent_hash=None)
            return len(hashes)
        if tag != STORED:
            for j, h in enumerate(hashes):
                self._append(cols, common, block_idx=j, block_hash=block_hash(h), parent_hash=None)
            return len(hashes)
        bs = _int(f.get("block_size"), 0, (1 << 32) - 1)
        tokens = f.get("token_ids")
        if not isinstance(tokens, (list, tuple)):
            if tokens is not None:
                self.bad_fields += 1
            tokens = None
        parent = f.get("parent_block_hash")
        parent = block_hash(parent) if parent is not None else None
        extra = {
            "block_size": bs, "spec_kind": _str(f.get("kv_cache_spec_kind"), 64), "lora_id": _int(f.get("lora_id")),
            "lora_name": _str(f.get("lora_name")), "session_id": _str(f.get("session_id")),
            "spec_window": _int(f.get("kv_cache_spec_sliding_window")), "locality": _str(f.get("locality"), 32),
            "ownership": _str(f.get("ownership"), 64),
        }
        keys, ahead = _per_block(f.get("extra_keys")), _per_block(f.get("lookahead_token_ids"))
        nb = len(hashes)
        for j, h in enumerate(hashes):
            v = block_hash(h)
            if v is None:
                self.bad_fields += 1
            if tokens is None:
                chunk = None
            elif bs:
                chunk = tokens[j * bs:(j + 1) * bs]
            elif nb == 1:
                chunk = tokens
            else:
                chunk = None
            th = tokens_hash(chunk) if chunk else None
            if chunk and th is None:
                self.bad_fields += 1
            self._append(cols, common, block_idx=j, block_hash=v, parent_hash=parent,
                         token_count=len(chunk) if chunk is not None else None, tokens_hash=th,
                         extra_keys=self._extra(keys, j), lookahead_tokens=self._ahead(ahead, j),
                         reused=self._stored((v, common["group_idx"], common["medium"])), **extra)
            parent = v
        return nb

    def _stored(self, key) -> bool:
        """Note a stored block; True when it was stored already (a re-report, not a new store)."""
        if key[0] is None:
            return False
        if key in self.present:
            self.present.move_to_end(key)
            self.reused += 1
            return True
        self.present[key] = None
        if len(self.present) > PRESENT_MAX:
            self.present.popitem(last=False)
            self.present_dropped += 1
        return False

    def _extra(self, keys: list | None, j: int) -> str | None:
        if keys is None or j >= len(keys) or keys[j] is None:
            return None
        try:
            return json.dumps(keys[j], separators=(",", ":"), default=_bytes_hex)[:EXTRA_MAX]
        except (TypeError, ValueError):
            self.bad_fields += 1
            return None

    def _ahead(self, ahead: list | None, j: int) -> int | None:
        if ahead is None or j >= len(ahead):
            return None
        if not isinstance(ahead[j], (list, tuple)):
            self.bad_fields += 1
            return None
        return len(ahead[j])   # a count: the ids are never kept

    @staticmethod
    def _append(cols, common, **row) -> None:
        for c in COLUMNS:
            cols[c].append(row[c] if c in row else common.get(c))
