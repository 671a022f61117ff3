"""A stand-in KV-event publisher for tests, run as its own process: vLLM's PUB frames
[topic, seq, msgpack batch] (kvtrace.servers.kvevents), one BlockStored event per batch whose
block hash is ``hash + seq``; optionally a replay ROUTER answering vLLM's replay requests.

    python kvpub.py '{"endpoint": "tcp://127.0.0.1:5600", "bind": false, "first": 100, "hash": 10**6,
                      "every": 0.05, "seconds": 6, "wrap": 0, "delay": 0, "replay": null, "child": false}'

``wrap`` > 0 starts again from ``first`` after that many batches (a publisher that keeps
restarting); ``child`` runs the publisher in a child process (as vLLM's EngineCore is a child of
its API server) and waits for it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def batch(seq: int, base: int) -> bytes:
    import msgspec

    ev = {"type": "BlockStored", "block_hashes": [base + seq], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
          "block_size": 4, "lora_id": None, "medium": "GPU"}
    return msgspec.msgpack.encode([time.time(), [ev], 0])


def answer(router, sent: list) -> None:
    frames = router.recv_multipart()
    if len(frames) == 3:
        start = int.from_bytes(frames[2], "big")
        for seq, payload in sent:
            if seq >= start:
                router.send_multipart([frames[0], b"", b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([frames[0], b"", b"", END_SEQ, b""])


def publish(a: dict) -> None:
    import zmq

    time.sleep(a.get("delay", 0))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    (pub.bind if a.get("bind") else pub.connect)(a["endpoint"])
    router = None
    if a.get("replay"):
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(a["replay"])
    sent, n, end = [], 0, time.monotonic() + a["seconds"]
    while time.monotonic() < end:
        seq = a["first"] + (n % a["wrap"] if a.get("wrap") else n)
        payload = batch(seq, a["hash"])
        sent.append((seq, payload))
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        n += 1
        while router is not None and router.poll(0):
            answer(router, sent)
        time.sleep(a["every"])
    print(n, flush=True)


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    if args.pop("child", False):
        sys.exit(subprocess.run([sys.executable, __file__, json.dumps(args)]).returncode)
    publish(args)
