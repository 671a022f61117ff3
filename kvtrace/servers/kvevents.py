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

With ``peers`` (the server's processes, kvtrace.servers.kvpeer) the ZeroMQ sockets talk only to
private ipc endpoints and a relay thread (kvtrace.servers.kvrelay) owns the real ones: a peer
that is not the server's is closed before a byte passes and counted in ``rejected_peers``.
"""
from __future__ import annotations

import errno
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from kvtrace.host import netns as netns_mod
from kvtrace.servers import kvpeer, kvrelay
# Re-exported: the decoder and the endpoint helpers live in their own modules.
from kvtrace.servers.kvdecode import (CLEARED, COLUMNS, END_SEQ, FIELDS, MASK64, REMOVED, SCHEMA, STORED, TABLE,  # noqa: F401
                                   Decoder, _int, _new_cols, _str, block_hash, to_table, tokens_hash)
from kvtrace.servers.kvendpoints import (bind_address, probe, rank_endpoint, replay_address,  # noqa: F401
                                      subscriber_endpoint, tcp_hostport, vllm_binds)


__all__ = ["CLEARED", "COLUMNS", "END_SEQ", "FIELDS", "MASK64", "REMOVED", "SCHEMA", "STORED", "TABLE", "Decoder",
           "block_hash", "to_table", "tokens_hash", "probe", "rank_endpoint", "replay_address",
           "subscriber_endpoint", "tcp_hostport", "vllm_binds", "STAT_KEYS", "KvEventSubscriber"]


STAT_KEYS = ("batches", "rows", "gaps", "gap_batches", "replayed", "missing", "duplicates", "publisher_restarts",
             "replay_requests", "replay_failures", "queue_drops", "bad_frames", "connects", "disconnects",
             "internal_errors", "rejected_peers")


@dataclass
class _Chunk:
    cols: dict[str, list]
    rows: int


class KvEventSubscriber:
    """A sidecar source: ``start()``, then ``drain()`` per flush, ``stats()``, ``stop()``.

    ``endpoint`` is the address kvtrace uses (see ``subscriber_endpoint``); ``bind`` when vLLM
    connects out to it.  ``resume_from`` replays from that seq at start (continuing an earlier
    subscriber's stream without a hole).  ``peers``: the server's processes (a
    kvpeer.ServerProcs, or its root pids), the only ones whose events are taken; None takes
    whoever is at the endpoint (a caller that trusts it: tests).  ``echo(line)`` is told of the
    first peer refused.
    """

    name = TABLE

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", bind: bool = False,
                 resume_from: int | None = None, queue_batches: int = 20000, replay_timeout: float = 2.0,
                 rcvhwm: int = 100_000, netns: str | None = None, peers=None, echo=None):
        self.endpoint = endpoint
        self.netns = netns  # /proc/PID/ns/net: the thread and its ZeroMQ context work inside it
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind and endpoint.startswith("tcp://")  # binding an ipc path would steal vLLM's socket
        self.bind_note = None
        if self.bind:
            self.endpoint, self.bind_note = bind_address(endpoint)
        self.peers = peers if peers is None or isinstance(peers, kvpeer.ServerProcs) else kvpeer.ServerProcs(peers)
        self.echo = echo
        self.rejected_last: str | None = None
        self._relay: kvrelay.Relay | None = None
        self._replay_to = replay_endpoint  # where the DEALER connects: the relay's private side when checked
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
        warnings = [self.bind_note] if self.bind_note and self.peers is not None else []
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
                "peer_check": self.peers is not None, "rejected_last": self.rejected_last,
                "internal_errors": self.c["internal_errors"] + (self._relay.errors if self._relay else 0),
                "bad_payloads": d.bad_payloads, "bad_events": d.bad_events, "bad_fields": d.bad_fields,
                "events": dict(d.events), "reused_stores": d.reused, "present_dropped": d.present_dropped,
            })
        return out

    def lost(self) -> int:
        """Batches that never reached the table: missing after replay, dropped by the queue, unusable."""
        return self.c["missing"] + self.c["queue_drops"] + self.decoder.bad_payloads

    # --- thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        """The thread: enter the netns, open the SUB socket, receive until stop, then the tail."""
        import zmq

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
            # the monitor first: the first connect is counted however fast it comes
            mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            if not self._open(sub):
                return
            self._ready.set()
            if self.resume_from is not None:
                self.next_seq = self.resume_from
                self.first_seq = self.resume_from
                self._replay(ctx, self.resume_from, None)
            self._receive(ctx, sub, mon)
            self._tail(ctx, sub)
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
            if self._relay is not None:
                self._relay.stop()

    def _rejected(self, line: str) -> None:
        """From the relay thread: a peer that is not the server's was refused."""
        with self._lock:
            self.c["rejected_peers"] += 1
            first, self.rejected_last = self.rejected_last is None, line
        if first and self.echo is not None:
            self.echo(f"{line} (this and every later refusal: kv_events rejected_peers in the run row)")

    def _open(self, sub) -> bool:
        """Set the SUB socket up and bind or connect it; False (with ``setup_error``) if that failed."""
        import zmq

        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.endpoint.startswith("tcp://[") or "::" in self.endpoint:
            sub.setsockopt(zmq.IPV6, 1)
        try:
            if self.peers is not None:
                self._open_relay(sub)
            elif self.bind:
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
        except (zmq.ZMQError, OSError) as e:
            verb = "bind" if self.bind else "connect to"
            self.setup_error = f"cannot {verb} KV events endpoint {self.endpoint} ({e}); no kv_events will be recorded"
            self._ready.set()
            return False
        return True

    def _open_relay(self, sub) -> None:
        """The relay owns the real endpoints; SUB binds or connects its private side."""
        relay = self._relay = kvrelay.Relay(self.peers, self._rejected)
        private = None
        if self.bind:
            try:
                private = relay.listen(self.endpoint)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self.bind = False   # most likely the server bound it: reach it, checked, like any other
        if private is not None:
            sub.bind(private)   # before the relay accepts anything for it
        else:
            private = relay.dial(self.endpoint)
        if self.replay_endpoint:
            self._replay_to = relay.dial(self.replay_endpoint)
        relay.start()   # its first round at once: an ipc server is ready before SUB connects
        if not self.bind:
            sub.connect(private)

    def _receive(self, ctx, sub, mon) -> None:
        """The receive loop until ``stop()``: monitor events (a reconnect replays from the next
        expected seq), and live batches, at most 1000 per poll."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        disconnected = False
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(100))
                if mon in ready:
                    while mon.poll(0):
                        ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                        disconnected = self._monitor_event(ctx, ev, disconnected)
                if sub in ready:
                    self._recv_queued(ctx, sub, 1000)
            except Exception:
                self.c["internal_errors"] += 1
                time.sleep(0.05)

    def _monitor_event(self, ctx, ev: int, disconnected: bool) -> bool:
        """Count a socket monitor event; replay after a reconnect.  Returns whether disconnected."""
        import zmq

        if ev == zmq.EVENT_DISCONNECTED:
            self.c["disconnects"] += 1
            return True
        if ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            self.c["connects"] += 1
            if disconnected and self.next_seq is not None:
                self._replay(ctx, self.next_seq, None)
            return False
        return disconnected

    def _recv_queued(self, ctx, sub, limit: int | None) -> None:
        """Take the batches queued on the socket (at most ``limit``; None: all) without waiting."""
        import zmq

        n = 0
        while limit is None or n < limit:
            n += 1
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._live(ctx, frames, time.monotonic_ns())

    def _tail(self, ctx, sub) -> None:
        """At stop: whatever is still queued on the socket, then the tail by replay."""
        self._recv_queued(ctx, sub, None)
        if self._tail_replay and self.next_seq is not None:
            self._replay(ctx, self.next_seq, None)

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
            dealer.connect(self._replay_to)
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
