"""The speculative-decoding records (kvtrace.hook.vllm.spec) from stand-ins of vLLM's scheduler
output, model runner output and engine outputs: drafts, accepted drafts (vLLM's count), the
drafts kept as output and each request's own output tokens."""
from __future__ import annotations

from types import SimpleNamespace as NS

from kvtrace.hook.vllm import spec


def outs(*items) -> dict:
    return {0: NS(outputs=[NS(request_id=r, new_token_ids=list(range(n)), finish_reason=f) for r, n, f in items])}


def test_a_step_with_drafts_and_a_request_that_ends_inside_them():
    spec.reset()
    drafts = {"a": [1, 2, 3], "b": [4, 5, 6]}
    runner = NS(req_id_to_index={"a": 0, "b": 1, "c": 2}, sampled_token_ids=[[7, 8, 9, 10], [11], [12]])
    accepted = spec.accepted_drafts(drafts, runner)
    assert accepted == 3 + 0            # a: all 3 drafts and its sampled token; b: none
    # a reached its length after 2 of its 4 tokens: vLLM returned 2 (1 accepted draft kept)
    recs = spec.step_records(9, 100, drafts, accepted, outs(("a", 2, "length"), ("b", 1, None), ("c", 1, None)))
    assert recs == [("spec_req", 9, 100, "a", 3, 1, 2), ("spec_step", 9, 100, 6, 3, 1, 4)]
    # the next step: c drafts 2 and finishes with both accepted; b has none (no spec_step without drafts)
    assert spec.step_records(10, 200, {}, 0, outs(("b", 1, None))) == []
    recs = spec.step_records(11, 300, {"c": [1, 2]}, 2, outs(("c", 3, "stop"), ("b", 1, "length")))
    assert recs == [("spec_req", 11, 300, "c", 2, 2, 4), ("spec_req", 11, 300, "b", 3, 0, 3),
                    ("spec_step", 11, 300, 2, 2, 2, 4)]
    assert spec.P.reqs == {}


def test_accepted_drafts_without_sampled_tokens_is_zero():
    assert spec.accepted_drafts({"a": [1]}, NS(req_id_to_index={"a": 0}, sampled_token_ids=[])) == 0
    assert spec.accepted_drafts({"a": [1]}, None) == 0
    assert spec.accepted_drafts({"a": [1]}, NS(req_id_to_index={"x": 0}, sampled_token_ids=[[1, 2]])) == 0
