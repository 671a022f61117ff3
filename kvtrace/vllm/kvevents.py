"""Subscribe to vLLM's KV-event stream (ZMQ PUB + msgpack) and turn it into ``kv_events`` rows.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``):

- PUB frames ``[topic, seq (8-byte big-endian), payload]``; ``seq`` counts batches from 0 per
  publisher.  ``payload`` is msgpack of ``KVEventBatch`` (array-like): ``[ts, events, dp_rank]``.
- Each event is a tagged map ``{"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", ...}``
  with default-valued fields omitted.  Older versions encoded events as arrays
  ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]``; both
  shapes decode here, and anything else is counted, never raised.
- Replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER on ``replay_endpoint``; the
  publisher answers one ``[b"", topic, seq, payload]`` per buffered batch with seq >= start,
  then ``[b"", b"", -1 (8 bytes, signed), b""]``.

A batch whose seq skips ahead of the last one is a gap: the missing seqs are fetched by replay
and written (``replayed`` = true) before the batch that revealed the gap; what replay cannot
supply is counted as ``missing``.  The socket monitor's reconnect triggers a replay from the
next expected seq, and ``stop()`` replays the tail, so a batch published while kvtrace was
disconnected still arrives.  Token ids are never stored: only their count and a 64-bit hash
per block.
"""
from __future__ import annotations

import hashlib
import queue
import socket
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from kvtrace.dataset import schema
from kvtrace.host import netns as netns_mod

TABLE = "kv_events"
MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"

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
SCHEMA = schema.TABLES[TABLE]
COLUMNS = SCHEMA.names


def _new_cols() -> dict[str, list]:
    return {c: [] for c in COLUMNS}


def to_table(cols: dict[str, list]) -> pa.Table:
    return pa.table({c: pa.array(cols[c], SCHEMA.field(c).type) for c in COLUMNS}, schema=SCHEMA)


# ---------------------------------------------------------------------------------------------
# Decoding


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
        if tag == CLEARED or not isinstance(hashes, (list, tuple)):
            self._append(cols, common, block_idx=None, block_hash=None, parent_hash=None)
            return 1
        if tag == REMOVED:
            for j, h in enumerate(hashes):
                v = block_hash(h)
                if v is None:
                    self.bad_fields += 1
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
        }
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
                         token_count=len(chunk) if chunk is not None else None, tokens_hash=th, **extra)
            parent = v
        return nb

    @staticmethod
    def _append(cols, common, **row) -> None:
        for c in COLUMNS:
            cols[c].append(row[c] if c in row else common.get(c))


# ---------------------------------------------------------------------------------------------
# Endpoints


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (ZmqEventPublisher._is_bind_endpoint): it binds these, connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_endpoint(endpoint: str, host: str = "127.0.0.1", root: str | None = None) -> tuple[str, bool]:
    """(address kvtrace uses, whether kvtrace must bind) for a publisher endpoint as vLLM was given it.

    vLLM binds ``tcp://*:P`` and ``ipc://`` endpoints (kvtrace connects, to ``host`` for ``*``);
    for ``tcp://host:P`` vLLM connects out, so kvtrace binds that address to receive.
    ``root`` (``/proc/PID/root``) reaches an ipc socket inside a container.
    """
    if endpoint.startswith("inproc://"):
        raise ValueError(f"{endpoint} is in-process only: it cannot be subscribed to from outside vLLM")
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"unsupported KV-events endpoint {endpoint!r} (expected tcp:// or ipc://)")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return ("ipc://" + (root.rstrip("/") + path if root and path.startswith("/") else path)), False
    if vllm_binds(endpoint):
        return endpoint.replace("*", host), False
    return endpoint, True


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank ``rank`` (vLLM adds the rank to the tcp port)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp") and sep and port.isdigit() and int(port) != 0:
        return f"{head}:{int(port) + rank}"
    return endpoint


def replay_address(endpoint: str, host: str = "127.0.0.1", root: str | None = None) -> str:
    """Where to connect for replay (vLLM always binds the replay ROUTER)."""
    if endpoint.startswith("ipc://"):
        return subscriber_endpoint(endpoint, host, root)[0]
    return endpoint.replace("*", host)


def tcp_hostport(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    if host.startswith("::ffff:") and host.count(".") == 3:
        host = host[len("::ffff:"):]
    return host, int(port)


def probe(endpoint: str, timeout: float = 1.0) -> str | None:
    """A reason the publisher at a (vLLM-bound) endpoint is unreachable, or None."""
    if endpoint.startswith("ipc://"):
        import os

        path = endpoint[len("ipc://"):]
        return None if os.path.exists(path) else f"no socket at {path}"
    hp = tcp_hostport(endpoint)
    if hp is None:
        return f"cannot parse {endpoint}"
    try:
        with socket.create_connection(hp, timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)


# ---------------------------------------------------------------------------------------------
# The subscriber thread


STAT_KEYS = ("batches", "rows", "gaps", "gap_batches", "replayed", "missing", "duplicates", "publisher_restarts",
             "replay_requests", "replay_failures", "queue_drops", "bad_frames", "connects", "disconnects",
             "internal_errors")


@dataclass
class _Chunk:
    cols: dict[str, list]
    rows: int


class KvEventSubscriber:
    """A sidecar source: ``start()``, then ``drain()`` per flush, ``stats()``, ``stop()``.

    ``endpoint`` is the address kvtrace uses (see ``subscriber_endpoint``); ``bind`` when vLLM
    connects out to it.  ``resume_from`` replays from that seq at start (continuing an earlier
    subscriber's stream without a hole).
    """

    name = TABLE

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", bind: bool = False,
                 resume_from: int | None = None, queue_batches: int = 20000, replay_timeout: float = 2.0,
                 rcvhwm: int = 100_000, netns: str | None = None):
        self.endpoint = endpoint
        self.netns = netns  # /proc/PID/ns/net: the thread and its ZeroMQ context work inside it
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind and endpoint.startswith("tcp://")  # binding an ipc path would steal vLLM's socket
        self.resume_from = resume_from
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.decoder = Decoder()
        self._q: queue.Queue[_Chunk] = queue.Queue(maxsize=queue_batches)
        self._stop = threading.Event()
        self._tail_replay = True
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.setup_error: str | None = None
        self.next_seq: int | None = None  # the seq expected next (all below are accounted for)
        self.first_seq: int | None = None
        self._ahead: set[int] = set()  # seqs taken from replay that live delivery may repeat
        self.c = Counter({k: 0 for k in STAT_KEYS})
        self._lock = threading.Lock()

    # --- public ---------------------------------------------------------------------------

    def start(self, wait: float = 2.0) -> list[str]:
        """Start the thread; warnings (unreachable endpoint, bind failure) as one-line strings."""
        warnings = []
        if not self.bind:
            try:
                why = netns_mod.call(self.netns, probe, self.endpoint, timeout=5)
            except OSError as e:
                why = str(e)
            if why:
                warnings.append(f"KV events endpoint {self.endpoint} unreachable ({why}); will keep retrying")
        self._thread = threading.Thread(target=self._run, name="kvtrace-kvevents", daemon=True)
        self._thread.start()
        self._ready.wait(wait)
        if self.setup_error:
            warnings.append(self.setup_error)
        return warnings

    def stop(self, tail_replay: bool = True, timeout: float = 10.0) -> None:
        """Stop; with tail_replay, first fetch by replay whatever was published but not received."""
        self._tail_replay = tail_replay
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    close = stop

    def drain(self) -> dict[str, pa.Table]:
        cols = _new_cols()
        rows = 0
        while True:
            try:
                chunk = self._q.get_nowait()
            except queue.Empty:
                break
            for c in COLUMNS:
                cols[c].extend(chunk.cols[c])
            rows += chunk.rows
        return {TABLE: to_table(cols)} if rows else {}

    def stats(self) -> dict:
        d = self.decoder
        with self._lock:
            out = dict(self.c)
            out.update({
                "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "first_seq": self.first_seq, "last_seq": None if self.next_seq is None else self.next_seq - 1,
                "bad_payloads": d.bad_payloads, "bad_events": d.bad_events, "bad_fields": d.bad_fields,
                "events": dict(d.events),
            })
        return out

    def lost(self) -> int:
        """Batches that never reached the table: missing after replay, dropped by the queue, unusable."""
        return self.c["missing"] + self.c["queue_drops"] + self.decoder.bad_payloads

    # --- thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        if self.netns:
            try:
                netns_mod.enter(self.netns)
            except OSError as e:
                self.setup_error = f"{e}; no kv_events will be recorded"
                self._ready.set()
                return
        ctx = zmq.Context()   # made here, after the thread entered: its I/O threads are inside too
        sub = mon = None
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            if self.endpoint.startswith("tcp://[") or "::" in self.endpoint:
                sub.setsockopt(zmq.IPV6, 1)
            try:
                if self.bind:
                    try:
                        sub.bind(self.endpoint)
                    except zmq.ZMQError as e:
                        if e.errno != zmq.EADDRINUSE:
                            raise
                        # Someone already listens there: most likely vLLM itself bound it.
                        self.bind = False
                        sub.connect(self.endpoint)
                else:
                    sub.connect(self.endpoint)
            except zmq.ZMQError as e:
                verb = "bind" if self.bind else "connect to"
                self.setup_error = f"cannot {verb} KV events endpoint {self.endpoint} ({e}); no kv_events will be recorded"
                self._ready.set()
                return
            mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            self._ready.set()
            if self.resume_from is not None:
                self.next_seq = self.resume_from
                self.first_seq = self.resume_from
                self._replay(ctx, self.resume_from, None)
            disconnected = False
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(100))
                    if mon in ready:
                        while mon.poll(0):
                            ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                            if ev == zmq.EVENT_DISCONNECTED:
                                self.c["disconnects"] += 1
                                disconnected = True
                            elif ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                                self.c["connects"] += 1
                                if disconnected and self.next_seq is not None:
                                    self._replay(ctx, self.next_seq, None)
                                disconnected = False
                    if sub in ready:
                        for _ in range(1000):
                            try:
                                frames = sub.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._live(ctx, frames, time.monotonic_ns())
                except Exception:
                    self.c["internal_errors"] += 1
                    time.sleep(0.05)
            # Whatever is still queued on the socket, then the tail by replay.
            while True:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._live(ctx, frames, time.monotonic_ns())
            if self._tail_replay and self.next_seq is not None:
                self._replay(ctx, self.next_seq, None)
        except Exception:
            self.c["internal_errors"] += 1
        finally:
            self._ready.set()
            for s in (mon, sub):
                if s is not None:
                    try:
                        s.close(0)
                    except Exception:
                        pass
            ctx.term()

    def _live(self, ctx, frames: list[bytes], recv_ns: int) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.c["bad_frames"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self.next_seq is None:
            self.next_seq = self.first_seq = seq
        if seq > self.next_seq:
            self.c["gaps"] += 1
            self.c["gap_batches"] += seq - self.next_seq
            self._replay(ctx, self.next_seq, seq)
            if seq > self.next_seq:  # replay could not fill it all
                self.c["missing"] += seq - self.next_seq
                self.next_seq = seq
        elif seq < self.next_seq:
            if seq in self._ahead:
                self._ahead.discard(seq)
                self.c["duplicates"] += 1
                return
            # seq went back and is not a replay overlap: the publisher restarted (vLLM restart)
            self.c["publisher_restarts"] += 1
            self._ahead.clear()
            self.next_seq = seq
        if self._ahead:
            self._ahead = {s for s in self._ahead if s > seq}
        self._accept(seq, frames[2], recv_ns, replayed=False)

    def _accept(self, seq: int, payload: bytes, recv_ns: int, replayed: bool) -> None:
        cols = _new_cols()
        with self._lock:
            self.next_seq = seq + 1
            self.c["batches"] += 1
            n = self.decoder.rows(cols, payload, seq, recv_ns, replayed)
            if not n:
                return
            self.c["rows"] += n
        try:
            self._q.put_nowait(_Chunk(cols, n))
        except queue.Full:
            self.c["queue_drops"] += 1

    def _replay(self, ctx, start: int, stop: int | None) -> None:
        """Fetch seqs [start, stop) (stop None: everything buffered) and accept them in order."""
        if self.replay_endpoint is None:
            return
        import zmq

        self.c["replay_requests"] += 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        ok = False
        try:
            if "[" in self.replay_endpoint:
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                    break
                frames = dealer.recv_multipart()
                deadline = time.monotonic() + self.replay_timeout
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.c["bad_frames"] += 1
                    continue
                if frames[2] == END_SEQ:
                    ok = True
                    break
                seq = int.from_bytes(frames[2], "big")
                if seq >= start and (stop is None or seq < stop):
                    got[seq] = frames[3]
        except Exception:
            pass
        finally:
            dealer.close(0)
        if not ok:
            self.c["replay_failures"] += 1
        now = time.monotonic_ns()
        for seq in sorted(got):
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                # the replay buffer had already dropped these (buffer_steps too small)
                self.c["missing"] += seq - self.next_seq
            self._accept(seq, got[seq], now, replayed=True)
            self.c["replayed"] += 1
            if stop is None:
                self._ahead.add(seq)
