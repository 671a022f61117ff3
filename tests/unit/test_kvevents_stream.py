"""The KV-event subscriber against a stand-in publisher that speaks vLLM's protocol (PUB frames
[topic, seq, payload], ROUTER replay, end marker), over ipc sockets: gaps, replay, resume,
restarts, bounded queue, garbage frames.  No vLLM, no root."""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time

import msgspec
import pytest
import zmq

from kvtrace.servers.kvevents import END_SEQ, KvEventSubscriber
from tests.helpers import wait_for


def batch(i: int) -> bytes:
    return msgspec.msgpack.encode([1796033116.0 + i, [{"type": "BlockStored", "block_hashes": [1000 + i],
                                                        "parent_block_hash": None, "token_ids": [i] * 4,
                                                        "block_size": 4, "lora_id": None, "medium": "GPU"}], 0])


class FakePublisher:
    """vLLM's ZmqEventPublisher, reduced: a thread owns PUB and ROUTER; every batch is buffered
    for replay, and ``drop=True`` buffers without sending (a batch lost on the way)."""

    def __init__(self, endpoint: str, replay: str | None, bind: bool = True, start_seq: int = 0):
        self.ctx = zmq.Context()
        self.endpoint, self.replay, self.bind = endpoint, replay, bind
        self.q: queue.Queue = queue.Queue()
        self.buffer = collections.deque(maxlen=10000)
        self.seq = itertools.count(start_seq)
        self.running = True
        self.ready = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        self.ready.wait(5)

    def _run(self):
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        (pub.bind if self.bind else pub.connect)(self.endpoint)
        router = None
        if self.replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay)
        self.ready.set()
        while self.running or not self.q.empty():
            if router is not None and router.poll(0):
                frames = router.recv_multipart()
                if len(frames) == 3:
                    client, _, start = frames
                    start = int.from_bytes(start, "big")
                    for s, p in list(self.buffer):
                        if s >= start:
                            router.send_multipart([client, b"", b"", s.to_bytes(8, "big"), p])
                    router.send_multipart([client, b"", b"", END_SEQ, b""])
            try:
                item = self.q.get(timeout=0.01)
            except queue.Empty:
                continue
            if item[0] == "raw":
                pub.send_multipart(item[1])
                continue
            payload, drop = item
            s = next(self.seq)
            self.buffer.append((s, payload))
            if not drop:
                pub.send_multipart([b"", s.to_bytes(8, "big"), payload])
        pub.close(0)
        if router is not None:
            router.close(0)

    def publish(self, payload: bytes, drop: bool = False):
        self.q.put((payload, drop))

    def raw(self, frames):
        self.q.put(("raw", frames))

    def flush(self):
        while not self.q.empty():
            time.sleep(0.01)
        time.sleep(0.1)

    def close(self):
        self.running = False
        self.t.join(5)
        self.ctx.term()


@pytest.fixture
def eps(tmp_path):
    return f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"


def seqs(sub) -> list[int]:
    t = sub.drain().get("kv_events")
    return [] if t is None else t.column("seq").to_pylist()


def connected(pub, sub):
    """Publish probes until the subscription is live (ZMQ's slow joiner), return their seqs."""
    got = []
    for i in range(100):
        pub.publish(batch(10_000 + i))
        time.sleep(0.05)
        got += seqs(sub)
        if got:
            return got
    raise AssertionError("subscriber never received anything")


def test_gap_is_filled_by_replay_in_order(eps):
    pub = FakePublisher(*eps)
    sub = KvEventSubscriber(eps[0], eps[1])
    assert sub.start() == []
    got = connected(pub, sub)
    first = got[0]
    for i in range(20):
        pub.publish(batch(i), drop=i in (3, 4, 5, 11))
    pub.flush()
    assert wait_for(lambda: sub.stats()["last_seq"] == first + len(got) - 1 + 20)
    got += seqs(sub)
    sub.stop()
    pub.close()
    assert got == list(range(first, first + len(got)))  # every seq, once, in order
    s = sub.stats()
    assert s["gaps"] == 2 and s["gap_batches"] == 4 and s["replayed"] == 4
    assert s["missing"] == 0 and s["duplicates"] == 0 and s["replay_failures"] == 0


def test_gap_without_replay_is_counted_missing(eps):
    pub = FakePublisher(eps[0], None)
    sub = KvEventSubscriber(eps[0], None)
    sub.start()
    connected(pub, sub)
    for i in range(6):
        pub.publish(batch(i), drop=i in (1, 2))
    pub.flush()
    assert wait_for(lambda: sub.stats()["batches"] >= 5)
    sub.stop()
    pub.close()
    s = sub.stats()
    assert s["missing"] == 2 and s["gaps"] == 1 and s["replayed"] == 0
    assert sub.lost() == 2


def test_tail_published_but_not_received_is_replayed_at_stop(eps):
    pub = FakePublisher(*eps)
    sub = KvEventSubscriber(eps[0], eps[1])
    sub.start()
    got = connected(pub, sub)
    for i in range(5):
        pub.publish(batch(i), drop=True)  # nothing live arrives for these
    pub.flush()
    sub.stop()
    got += seqs(sub)
    pub.close()
    assert got == list(range(got[0], got[0] + len(got))) and len(got) >= 6
    assert sub.stats()["replayed"] == 5


def test_resume_continues_an_earlier_subscriber_without_hole_or_duplicate(eps):
    pub = FakePublisher(*eps)
    a = KvEventSubscriber(eps[0], eps[1])
    a.start()
    got_a = connected(pub, a)
    for i in range(5):
        pub.publish(batch(i))
    pub.flush()
    assert wait_for(lambda: a.stats()["batches"] == len(got_a) + 5)
    a.stop(tail_replay=False)  # killed: no goodbye
    got_a += seqs(a)
    for i in range(5, 12):  # published while nobody listens
        pub.publish(batch(i))
    pub.flush()
    b = KvEventSubscriber(eps[0], eps[1], resume_from=a.stats()["last_seq"] + 1)
    b.start()
    for i in range(12, 15):
        pub.publish(batch(i))
    pub.flush()
    assert wait_for(lambda: b.stats()["last_seq"] == got_a[-1] + 10)
    b.stop()
    got_b = seqs(b)
    pub.close()
    allseq = got_a + got_b
    assert allseq == list(range(allseq[0], allseq[-1] + 1))
    assert b.stats()["missing"] == 0 and b.stats()["replayed"] >= 7


def test_publisher_restart_is_detected(eps):
    pub = FakePublisher(*eps, start_seq=50)
    sub = KvEventSubscriber(eps[0], eps[1])
    sub.start()
    connected(pub, sub)
    pub.close()
    pub2 = FakePublisher(*eps, start_seq=0)  # a new vLLM: seq from 0
    assert wait_for(lambda: bool(connected(pub2, sub)), 10)
    sub.stop()
    pub2.close()
    assert sub.stats()["publisher_restarts"] == 1


def free_zmq_port() -> int:
    """A free loopback port in 5600-5699 (the range kvtrace's tests may use for ZMQ)."""
    import random
    import socket

    ports = list(range(5600, 5700))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 5600-5699")


def test_bind_mode_when_vllm_connects_out():
    ep = f"tcp://127.0.0.1:{free_zmq_port()}"
    sub = KvEventSubscriber(ep, None, bind=True)
    assert sub.start() == []
    pub = FakePublisher(ep, None, bind=False)
    got = connected(pub, sub)
    sub.stop()
    pub.close()
    assert got and sub.bind


def test_bind_mode_falls_back_to_connect_when_the_address_is_taken():
    ep = f"tcp://127.0.0.1:{free_zmq_port()}"
    pub = FakePublisher(ep, None)  # the publisher bound it
    sub = KvEventSubscriber(ep, None, bind=True)
    assert sub.start() == []
    assert connected(pub, sub)
    sub.stop()
    pub.close()
    assert sub.bind is False


def test_bounded_queue_drops_are_counted(eps):
    pub = FakePublisher(*eps)
    sub = KvEventSubscriber(eps[0], None, queue_batches=3)
    sub.start()
    connected(pub, sub)
    for i in range(10):
        pub.publish(batch(i))
    pub.flush()
    assert wait_for(lambda: sub.stats()["batches"] >= 11)
    sub.stop()
    pub.close()
    assert sub.stats()["queue_drops"] == 7  # 3 fit (the probe batch was drained already)
    assert len(seqs(sub)) == 3
    assert sub.lost() == 7


def test_garbage_frames_are_counted_and_the_stream_goes_on(eps):
    pub = FakePublisher(*eps)
    sub = KvEventSubscriber(eps[0], eps[1])
    sub.start()
    got = connected(pub, sub)
    pub.raw([b"", b"short"])
    pub.raw([b"", b"\x00" * 7, b"x"])
    pub.publish(b"\xc1garbage")
    pub.publish(batch(1))
    pub.flush()
    assert wait_for(lambda: sub.stats()["batches"] == len(got) + 2)
    sub.stop()
    pub.close()
    s = sub.stats()
    assert s["bad_frames"] == 2 and s["bad_payloads"] == 1 and s["internal_errors"] == 0


def test_unreachable_endpoint_warns_and_keeps_running():
    sub = KvEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", replay_timeout=0.2)
    w = sub.start()
    assert len(w) == 1 and "unreachable" in w[0]
    sub.stop()
    assert sub.drain() == {}
