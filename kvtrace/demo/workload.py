"""A shared-prefix workload for a real vLLM server, with its own account of what happened.

Prompts are token-id lists (the demo model has no tokenizer), built from a seed so a run
can be repeated exactly.  Groups of requests share a prefix (prefix-cache hits), prompts are
longer than the chunk budget (chunked prefill), and filler prompts push the KV cache past its
size (evictions; with a storage connector, loads back from storage).  Each request is sent
streaming, with an X-Request-Id, and the client records what vLLM itself answered: cached
tokens, prompt and completion tokens, completion token ids, time to first token.
"""
from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int = 8
    delay_s: float = 0.0  # wait this long after the previous request was sent (sequential mode)


@dataclass
class Result:
    rid: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    t_send_ns: int = 0  # CLOCK_MONOTONIC, the clock of the capture
    t_first_ns: int = 0
    t_done_ns: int = 0
    t_tokens_ns: list[int] = field(default_factory=list)  # arrival of each streamed message with token ids
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return (self.t_first_ns - self.t_send_ns) / 1e9 if self.t_first_ns else float("nan")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 31000) for _ in range(n)]


def shared_prefix(seed: int = 0, groups: int = 3, per_group: int = 3, prefix_len: int = 640,
                  suffix_len: int = 360, fillers: int = 4, filler_len: int = 1000, max_tokens: int = 8,
                  repeat_first: bool = True) -> list[Request]:
    """groups × per_group requests sharing a prefix per group, fillers in between to force
    evictions, then (repeat_first) the very first prompt again, whose blocks were evicted."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    first = None
    for g in range(groups):
        prefix = tokens(rng, prefix_len)
        for i in range(per_group):
            prompt = prefix + tokens(rng, suffix_len)
            reqs.append(Request(f"g{g}-r{i}", prompt, max_tokens))
            first = first or prompt
        for f in range(fillers if g < groups - 1 or repeat_first else 0):
            reqs.append(Request(f"g{g}-fill{f}", tokens(rng, filler_len), max_tokens))
    if repeat_first and first:
        reqs.append(Request("again-g0-r0", list(first), max_tokens))
    return reqs


def send(url: str, model: str, req: Request, timeout: float = 300.0) -> Result:
    u = urlparse(url)
    body = json.dumps({"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True})
    res = Result(req.rid, len(req.prompt), 0, 0)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        res.t_send_ns = time.monotonic_ns()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "X-Request-Id": req.rid})
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return res
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[6:])
            for ch in msg.get("choices") or []:
                if ch.get("token_ids"):
                    now = time.monotonic_ns()
                    res.t_first_ns = res.t_first_ns or now
                    res.t_tokens_ns.append(now)
                    res.token_ids.extend(ch["token_ids"])
            usage = msg.get("usage")
            if usage:
                res.prompt_tokens = usage["prompt_tokens"]
                res.completion_tokens = usage["completion_tokens"]
                res.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        res.t_done_ns = time.monotonic_ns()
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def run(url: str, model: str, reqs: list[Request], concurrency: int = 1) -> list[Result]:
    """Send reqs in order; with concurrency > 1, up to that many in flight."""
    if concurrency <= 1:
        out = []
        for r in reqs:
            if r.delay_s:
                time.sleep(r.delay_s)
            out.append(send(url, model, r))
        return out
    results: dict[str, Result] = {}
    sem = threading.Semaphore(concurrency)
    threads = []

    def one(r: Request) -> None:
        try:
            results[r.rid] = send(url, model, r)
        finally:
            sem.release()

    for r in reqs:
        sem.acquire()
        t = threading.Thread(target=one, args=(r,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [results[r.rid] for r in reqs]


def to_json(results: list[Result]) -> list[dict]:
    return [asdict(r) | {"ttft_s": r.ttft_s} for r in results]
