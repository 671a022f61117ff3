"""Speculative decoding as the scheduler sees it: the draft tokens it scheduled, how many the
model accepted, and each request's own output tokens (kvtrace.hook.vllm.engine calls these from
its update_from_output wrapper).

A step's scheduled tokens count every draft token (a decoding request with k drafts is
scheduled 1 + k tokens), so the step record alone over-counts output.  The model runner's
``sampled_token_ids`` say how many drafts the model accepted (vLLM's own count: sampled - 1 per
drafted request); the outputs vLLM returns say what each request got: ``len(new_token_ids)``
tokens, fewer when the request reached its end (stop or length) inside the accepted drafts.  Records (docs/hook.md): ``spec_step`` per step that scheduled drafts, ``spec_req`` at
the finish of each request of a server with speculative decoding on.  Nothing is counted on a
server without it (``Scheduler.num_spec_tokens`` 0).
"""
from __future__ import annotations

MAX_TRACKED = 65536   # requests counted at once (a request whose finish was never seen is dropped past it)


class _Spec:
    def __init__(self):
        self.reqs: dict[str, list] = {}   # request id -> [drafts, accepted, output tokens]


P = _Spec()


def enabled(sched) -> bool:
    """Whether this scheduler proposes draft tokens."""
    return bool(getattr(sched, "num_spec_tokens", 0))


def accepted_drafts(spec: dict, runner) -> int:
    """The drafts the model accepted in the step, as vLLM's spec-decoding metrics count them."""
    sampled = getattr(runner, "sampled_token_ids", None)
    index = getattr(runner, "req_id_to_index", None)
    if not sampled or not index:
        return 0
    n = 0
    for rid, d in spec.items():
        i = index.get(rid)
        if d and i is not None and i < len(sampled) and len(sampled[i]):
            n += len(sampled[i]) - 1
    return n


def step_records(step: int, t_ns: int, spec: dict, accepted: int, outputs) -> list[tuple]:
    """The records of one update_from_output: ``spec`` the SchedulerOutput's
    scheduled_spec_decode_tokens (request -> draft ids), ``accepted`` accepted_drafts() of its
    ModelRunnerOutput taken before the call (which trims a finished request's sampled tokens in
    place), ``outputs`` what it returned (client index -> EngineCoreOutputs)."""
    reqs, out = P.reqs, []
    drafts = kept = generated = 0
    for eco in outputs.values():
        for o in eco.outputs:
            rid, n = o.request_id, len(o.new_token_ids)
            r = reqs.get(rid)
            if r is None:
                if len(reqs) >= MAX_TRACKED:
                    reqs.clear()
                r = reqs[rid] = [0, 0, 0]
            d = spec.get(rid)
            if d:
                k, a = len(d), max(n - 1, 0)
                r[0] += k
                r[1] += a
                drafts += k
                kept += a
            r[2] += n
            generated += n
            if o.finish_reason is not None:
                reqs.pop(rid, None)
                out.append(("spec_req", step, t_ns, rid, r[0], r[1], r[2]))
    if spec:
        out.append(("spec_step", step, t_ns, sum(map(len, spec.values())), accepted, kept, generated))
    return out


def reset() -> None:
    P.reqs.clear()
