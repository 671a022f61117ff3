"""The hook's scheduler records when vLLM overlaps scheduling with execution: the call order of
EngineCore.step_with_batch_queue (vllm/v1/engine/core.py, 0.32), which a GPU engine runs with
async scheduling (batch queue of 2) and pipeline parallelism (batch queue of pp_size):

    schedule(N) -> queued, returns without output
    schedule(N+1) -> queue full -> update_from_output(N)
    schedule(N+2) -> queue full -> update_from_output(N+1) ...

so step N's update comes after step N+1's schedule, with two SchedulerOutputs in flight.

The hook's own wrappers (kvtrace.hook.vllm.targets' factories around engine._schedule_pre/_post,
_update_pre/_post and ALLOCATE_BODY) are put on a stand-in of vLLM 0.32's Scheduler and
AsyncScheduler, reduced to what the hook reads: chunked prefill under a 256-token budget,
computed tokens advanced at schedule() (Scheduler._update_after_schedule), prefix-cache hits
of blocks cached at allocation, AsyncScheduler's output placeholders (a decode scheduled while
the previous one is in flight, and not once max_tokens is sure to be reached: scheduler.py's
"Avoid scheduling an extra step"), finished requests dropped by update_from_output and reported
in the next SchedulerOutput's finished_req_ids.  The records come back decoded as the agent
decodes them (tests/hookframes.py).  A real vLLM in this order: tests/vllm/test_async_scheduling.py.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from kvtrace.hook.vllm import engine, targets
from tests import hookframes

BUDGET, BLOCK = 256, 32


class Req:
    """vLLM's Request, the fields the hook and the stand-in read."""

    def __init__(self, rid: str, prompt: list[int], max_tokens: int, stop_after: int | None = None):
        self.request_id = rid
        self.prompt_token_ids = prompt
        self.num_prompt_tokens = len(prompt)
        self.output: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        self.max_tokens = max_tokens
        self.stop_after = stop_after          # a stop token comes as output token number stop_after
        self.num_cached_tokens = -1           # what vLLM reports as usage.prompt_tokens_details.cached_tokens
        self.skip_reading_prefix_cache = False
        self.lora_request = self.cache_salt = self.mm_features = None
        self.arrival_time = None
        self.trace_headers = None
        # a prefix hash per full block: equal prompt prefixes, equal hashes
        self.block_hashes = [hash(tuple(prompt[:(i + 1) * BLOCK])).to_bytes(8, "big", signed=True) + b"\0" * 4
                             for i in range(len(prompt) // BLOCK)]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output)

    @property
    def is_prefill_chunk(self) -> bool:
        return self.num_computed_tokens < self.num_tokens


class KVCacheManager:
    """allocate_slots with vLLM 0.32's leading parameters; blocks are cached as they are
    allocated (vLLM caches the full blocks of the tokens it schedules)."""

    def __init__(self):
        self.cached: set[bytes] = set()
        self.block_pool = SimpleNamespace(blocks=[], cached_block_hashes_by_block={}, get_num_free_blocks=lambda: 100)

    def hit(self, req: Req) -> int:
        n = 0
        for h in req.block_hashes:
            if h not in self.cached:
                break
            n += 1
        # (a hit never covers the whole prompt: the last token is computed)
        return min(n * BLOCK, (req.num_prompt_tokens - 1) // BLOCK * BLOCK)

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                       num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False):
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        self.cached.update(request.block_hashes[:min(end, request.num_prompt_tokens) // BLOCK])
        return SimpleNamespace(blocks=[[]])


class Scheduler:
    """vLLM 0.32's Scheduler (async_=False) or AsyncScheduler (async_=True), reduced."""

    def __init__(self, async_: bool):
        self.async_ = async_
        self.requests: dict[str, Req] = {}
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.finished_req_ids: set[str] = set()
        self.current_step = 0
        self.block_size = BLOCK
        self.kv_cache_manager = KVCacheManager()
        self.truth: dict[int, dict] = {}   # step -> what was scheduled: prefill chunks, decodes

    def add_request(self, req: Req) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_requests(self) -> bool:
        return bool(self.requests) or bool(self.finished_req_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self):
        self.current_step += 1
        budget, sched, new, chunks, decodes = BUDGET, {}, [], {}, []
        for req in self.running:
            if budget <= 0:
                break
            if (req.num_output_placeholders > 0
                    and req.num_computed_tokens + 2 - req.num_output_placeholders >= req.num_prompt_tokens + req.max_tokens):
                continue   # async: the step in flight reaches max_tokens
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            if n <= 0:
                continue   # (sync scheduler: the decode in flight has not come back)
            self.kv_cache_manager.allocate_slots(req, n)
            sched[req.request_id] = n
            budget -= n
        while self.waiting and budget > 0:
            req = self.waiting.popleft()
            hit = self.kv_cache_manager.hit(req)
            n = min(req.num_tokens - hit, budget)
            self.kv_cache_manager.allocate_slots(req, n, hit, SimpleNamespace(blocks=[[]]), 0, 0, False)
            req.num_computed_tokens = hit
            req.num_cached_tokens = hit
            self.running.append(req)
            sched[req.request_id] = n
            new.append(SimpleNamespace(req_id=req.request_id))
            budget -= n
        for rid, n in sched.items():   # Scheduler._update_after_schedule
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_prompt_tokens:
                chunks[rid] = (req.num_computed_tokens, n)
            else:
                decodes.append(rid)
            req.num_computed_tokens += n
            if self.async_ and not req.is_prefill_chunk:   # AsyncScheduler._update_after_schedule
                req.num_output_placeholders += 1
        so = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                             num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
                             finished_req_ids=self.finished_req_ids, preempted_req_ids=set(),
                             scheduled_spec_decode_tokens={}, step=self.current_step)
        self.finished_req_ids = set()
        self.truth[self.current_step] = {"chunks": chunks, "decodes": decodes, "so": so, "dropped": []}
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        for rid, sampled in model_runner_output.items():
            req = self.requests.get(rid)
            if req is None:   # finished while this step ran (vLLM: "already finished", async/PP)
                self.truth[scheduler_output.step]["dropped"].append(rid)
                continue
            if not sampled:
                continue
            if self.async_:
                req.num_output_placeholders -= 1
            req.output.append(7)
            if len(req.output) >= req.max_tokens or len(req.output) == req.stop_after:
                self.running.remove(req)
                del self.requests[rid]
                self.finished_req_ids.add(rid)
        return {}


def run_model(sched: Scheduler, so) -> dict[str, int]:
    """The worker: one token sampled for each request whose scheduled tokens reach its end."""
    out = {}
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests.get(rid)
        out[rid] = 1 if req is not None and not req.is_prefill_chunk else 0
    return out


def step_with_batch_queue(sched: Scheduler, queue: deque, size: int) -> None:
    """EngineCore.step_with_batch_queue (vLLM 0.32), without futures: the model runs at once."""
    model_executed = False
    if sched.has_requests():
        so = sched.schedule()
        model_executed = so.total_num_scheduled_tokens > 0
        queue.appendleft((run_model(sched, so), so))
        if len(queue) < size and (model_executed or sched.has_requests()):
            return
    elif not queue:
        return
    out, so = queue.pop()
    sched.update_from_output(so, out)


def step(sched: Scheduler) -> None:
    """EngineCore.step: schedule, execute, update (no batch queue)."""
    if not sched.has_requests():
        return
    so = sched.schedule()
    sched.update_from_output(so, run_model(sched, so))


@pytest.fixture
def hooked(monkeypatch):
    """The stand-in's classes with the hook's own wrappers, as engine_wrappers() makes them for
    vLLM 0.32 (its own step counter; one hash per cached block is irrelevant here)."""
    wrappers = {
        "schedule": targets._exactly(engine._schedule_pre, engine._schedule_post),
        "update_from_output": targets._exactly(engine._update_pre, engine._update_post,
                                               names=("scheduler_output", "model_runner_output")),
    }
    for name, wrap in wrappers.items():
        monkeypatch.setattr(Scheduler, name, wrap(Scheduler.__dict__[name]))
    monkeypatch.setattr(KVCacheManager, "allocate_slots",
                        targets._inlined(engine.ALLOCATE_BODY, engine.ALLOC_PARAMS)(KVCacheManager.__dict__["allocate_slots"]))
    engine.S.reset()
    yield
    engine.S.reset()


def workload(stop_early: bool = False) -> list[Req]:
    """4 prompts of 600 tokens sharing a 512-token prefix, 8 output tokens each; with
    stop_early, the third stops at its 3rd output token (a stop token: not known in advance)."""
    shared = list(range(1000, 1512))
    return [Req(f"r{i}", shared + [5000 + 100 * i + k for k in range(88)], 8,
                stop_after=3 if stop_early and i == 2 else None) for i in range(4)]


def drive(order: str, async_: bool, reqs: list[Req], records) -> tuple[Scheduler, dict, list[tuple]]:
    """Run the requests to the end in ``order``; (scheduler, records, the schedule/update call log)."""
    sched = Scheduler(async_)
    calls: list[tuple] = []
    sched_fn, upd_fn = Scheduler.schedule, Scheduler.update_from_output

    def schedule(self):
        so = sched_fn(self)
        calls.append(("schedule", self.current_step))
        return so

    def update(self, so, out):
        calls.append(("update", next(s for s, t in self.truth.items() if t["so"] is so)))
        return upd_fn(self, so, out)

    sched.schedule = schedule.__get__(sched)
    sched.update_from_output = update.__get__(sched)
    sched.add_request(reqs[0])
    queue: deque = deque(maxlen=2)
    for i in range(200):
        if i == 1:
            for r in reqs[1:]:   # the others arrive while the first one's prefill is in flight
                sched.add_request(r)
        if order == "batch_queue":
            step_with_batch_queue(sched, queue, 2)
        else:
            step(sched)
        if not sched.has_requests() and not queue:
            break
    assert not sched.requests and not queue
    return sched, records(), calls


def check_records(sched: Scheduler, reqs: list[Req], recs: dict) -> None:
    """Every figure the hook recorded against what the stand-in scheduled."""
    # every request's chunks cover its uncached prompt exactly once, each in the step that scheduled it
    chunks = recs["chunk"]
    want = sorted((s, rid, a, n) for s, t in sched.truth.items() for rid, (a, n) in t["chunks"].items())
    assert sorted((c["step"], c["request"], c["start"], c["length"]) for c in chunks) == want
    for r in reqs:
        mine = sorted((c["start"], c["length"]) for c in chunks if c["request"] == r.request_id)
        assert mine[0][0] == r.num_cached_tokens and sum(n for _, n in mine) == r.num_prompt_tokens - r.num_cached_tokens
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        assert [c["last"] for c in chunks if c["request"] == r.request_id][-1] == 1
    # admissions: the prefix-cache hit vLLM reports as cached_tokens
    assert {a["request"]: a["cached_local"] for a in recs["admit"]} == {r.request_id: r.num_cached_tokens for r in reqs}
    # one step record per SchedulerOutput, with its own figures (not its neighbour's)
    steps = {s["step"]: s for s in recs["step"]}
    assert len(steps) == len(recs["step"]) == len(sched.truth)
    for n, t in sched.truth.items():
        s, so = steps[n], t["so"]
        assert (s["total_tokens"], s["num_reqs"]) == (so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
        assert (s["prefill_reqs"], s["prefill_tokens"]) == (len(t["chunks"]), sum(n for _, n in t["chunks"].values()))
        # decodes: what the requests got, without one vLLM computed and dropped
        kept = [rid for rid in t["decodes"] if rid not in t["dropped"]]
        assert (s["decode_reqs"], s["decode_tokens"]) == (len(kept), len(kept)), (n, t["dropped"])
        assert s["prefill_tokens"] + len(t["decodes"]) == s["total_tokens"]   # what was computed
        assert s["prefill_tokens"] <= BUDGET and s["finished"] == len(so.finished_req_ids)
        assert s["t_start_ns"] <= s["t_sched_end_ns"] <= s["t_end_ns"]
    # finishes: each request once, in the output that reported it
    assert sorted(f["request"] for f in recs["finish"]) == sorted(r.request_id for r in reqs)
    for f in recs["finish"]:
        assert f["request"] in sched.truth[f["step"]]["so"].finished_req_ids


@pytest.mark.parametrize("async_", [True, False], ids=["AsyncScheduler", "Scheduler"])
def test_overlapped_order_records_each_step_and_chunk_once(tmp_path, monkeypatch, hooked, async_):
    """The batch-queue order (schedule N+1 before update N): a GPU engine with async scheduling
    (AsyncScheduler) and a pipeline-parallel one (Scheduler)."""
    reqs = workload()
    with hookframes.receiver(tmp_path, monkeypatch) as records:
        sched, recs, calls = drive("batch_queue", async_, reqs, records)
    # the order really overlapped: some step N+1 was scheduled before step N's update ...
    pos = {c: i for i, c in enumerate(calls)}
    overlapped = [n for n in sched.truth if n + 1 in sched.truth and pos[("schedule", n + 1)] < pos[("update", n)]]
    assert len(overlapped) >= len(sched.truth) - 2
    # ... and the hook's step spans say so: step N ended (update) after step N+1's schedule returned
    steps = {s["step"]: s for s in recs["step"]}
    assert all(steps[n]["t_end_ns"] > steps[n + 1]["t_sched_end_ns"] for n in overlapped)
    check_records(sched, reqs, recs)
    # prompts: 600, 600, 600, 600; the first computes all, the others hit the 512-token prefix
    assert [r.num_cached_tokens for r in reqs] == [0, 512, 512, 512]
    assert sum(c["length"] for c in recs["chunk"]) == 600 + 3 * 88
    if async_:
        # AsyncScheduler: a request's decode is scheduled while its previous token is in flight
        assert any(rid in sched.truth[n]["decodes"] and rid in sched.truth[n + 1]["decodes"]
                   for n in overlapped for rid in sched.truth[n]["decodes"])
    # the output tokens `kvtrace analyze` counts: steps' decode tokens + each request's last chunk
    got = sum(s["decode_tokens"] for s in recs["step"]) + sum(c["last"] for c in recs["chunk"])
    assert got == sum(len(r.output) for r in reqs) == 4 * 8


def test_serial_order_gives_the_same_chunks_and_hits(tmp_path, monkeypatch, hooked):
    """EngineCore.step (what vLLM CPU runs, even with --scheduler-cls AsyncScheduler): the same
    workload's records, checked the same way."""
    reqs = workload()
    with hookframes.receiver(tmp_path, monkeypatch) as records:
        sched, recs, calls = drive("serial", True, reqs, records)
    assert all(a[0] == "schedule" and b == ("update", a[1]) for a, b in zip(calls[::2], calls[1::2]))
    check_records(sched, reqs, recs)
    assert [r.num_cached_tokens for r in reqs] == [0, 512, 512, 512]


@pytest.mark.parametrize("order", ["batch_queue", "serial"])
def test_a_request_stopped_by_a_stop_token(tmp_path, monkeypatch, hooked, order):
    """A stop token is not known when the next step is scheduled: under AsyncScheduler in the
    batch-queue order, the request's next decode is already in flight when it stops, and vLLM
    drops its token (update_from_output: "already finished").  The step's total_tokens counts
    what was computed; its decode figures, and the output tokens `kvtrace analyze` counts from
    them, must be what the requests got."""
    reqs = workload(stop_early=True)
    with hookframes.receiver(tmp_path, monkeypatch) as records:
        sched, recs, calls = drive(order, True, reqs, records)
    check_records(sched, reqs, recs)
    outputs = sum(len(r.output) for r in reqs)
    assert outputs == 3 * 8 + 3
    scheduled = sum(len(t["decodes"]) for t in sched.truth.values()) + len(reqs)
    wasted = scheduled - outputs
    assert wasted == (1 if order == "batch_queue" else 0)
    got = sum(s["decode_tokens"] for s in recs["step"]) + sum(c["last"] for c in recs["chunk"])
    assert got == outputs, f"output tokens from the step records: {got}, the requests got {outputs}"
