"""Prefill/decode pairs (kvtrace.correlate.pd) on a constructed two-host dataset whose decode
host's wall clock is 37.25 s ahead: pairing by request id and by prompt, the clock shift
recovered within its stated bound, TTFT's parts on one timeline, the trace context handed over.
Every expected value is worked out in the comments.  No root."""
from __future__ import annotations

from kvtrace.correlate import ids, pd
from kvtrace.correlate.derive import runs_of
from kvtrace.dataset.reader import Dataset
from tests.unit.analysis_fixture import write

MS, S = 1_000_000, 1_000_000_000
P_MONO, D_MONO = 1_000 * S, 5_000 * S          # each host's CLOCK_MONOTONIC at true time 0
WALL0 = 1_800_000_000 * S
SKEW = 37_250 * MS                             # the decode host's wall clock is this far ahead
P_OFF, D_OFF = WALL0 - P_MONO, WALL0 - D_MONO + SKEW
H = [(0xA << 60) + i for i in range(3)]        # each prompt's last block hash


def run_row(run, off):
    return {"run": run, "status": "ok", "schema_version": 2, "start_ns": 1, "stop_ns": 2, "clock_offset_ns": off}


def dataset(root):
    """Three 700-token prompts.  Request i (true time i s): the prefill server gets it at +0,
    finishes at +300 ms (kv_finish: 22 blocks), the decode server gets it at +310 ms and grants
    the pull at +312 ms, the prefill side sees it sent at +330 ms, the decode side loaded at
    +331 ms.  Request 1 has the same external id on both sides (a proxy's X-Request-Id)."""
    from kvtrace.dataset import schema
    p, d = {k: [] for k in ("arrive", "prompt_blocks", "kv_finish", "kv_done")}, {k: [] for k in ("arrive", "prompt_blocks", "kv_alloc", "kv_done")}
    for i in range(3):
        t = i * S
        pr, dr = (f"cmpl-x1-0-aaaaaaa{i}", f"cmpl-x1-0-bbbbbbb{i}") if i == 1 else (f"cmpl-p{i}-0-aaaaaaaa", f"cmpl-d{i}-0-bbbbbbbb")
        for side, rid, mono in ((p, pr, P_MONO), (d, dr, D_MONO + 310 * MS)):
            side["arrive"].append({"step": 1, "t_ns": mono + t, "request": rid, "traceparent": "", "tracestate": "", "pid": 7})
            side["prompt_blocks"].append({"step": 1, "request": rid, "block_size": 32, "prompt_len": 700, "max_output": 1,
                                          "num_blocks": 21, "first": 0, "hashes": [H[i] - 1, H[i]], "pid": 7})
        # (hashes: a record's first + len must reach num_blocks to give the last hash)
        p["prompt_blocks"][-1].update(first=19)
        d["prompt_blocks"][-1].update(first=19)
        p["kv_finish"].append({"step": 2, "t_ns": P_MONO + t + 300 * MS, "request": pr, "blocks": 22, "nbytes": 22 * 4096,
                               "delay_free": 1, "connector": "NixlPullConnector", "pid": 7})
        p["kv_done"].append({"step": 3, "t_ns": P_MONO + t + 330 * MS, "request": pr, "direction": "store", "ok": 1,
                             "connector": "NixlPullConnector", "pid": 7})
        d["kv_alloc"].append({"step": 2, "t_ns": D_MONO + t + 312 * MS, "request": dr, "first": 0, "external": 700,
                              "blocks": 22, "nbytes": 22 * 4096, "async": 1, "connector": "NixlPullConnector", "pid": 9})
        d["kv_done"].append({"step": 3, "t_ns": D_MONO + t + 331 * MS, "request": dr, "direction": "load", "ok": 1,
                             "connector": "NixlPullConnector", "pid": 9})
    for x in d["arrive"] + d["prompt_blocks"]:
        x["pid"] = 9
    for x in [r for tabs in (p, d) for rows in tabs.values() for r in rows]:
        x.update(mark_ns=x.get("t_ns", 1), tid=x["pid"])
    for host, run, off, tabs in (("hp", "rp", P_OFF, p), ("hd", "rd", D_OFF, d)):
        write(root, "runs", [run_row(run, off)], schema.RUNS, run=run, host=host)
        for name, rows in tabs.items():
            write(root, name, rows, run=run, host=host)
    return Dataset.open(root)


def test_pairs_by_request_id_then_prompt_and_the_clock_within_its_bound(tmp_path):
    ds = dataset(tmp_path)
    found = pd.pairs(ds, runs_of(ds))
    assert sorted((x.p.request[5:7], x.d.request[5:7], x.how) for x in found) == [
        ("p0", "d0", "prompt"), ("p2", "d2", "prompt"), ("x1", "x1", "request id")]
    assert {(x.blocks, x.nbytes, x.connector) for x in found} == {((22, 22), (22 * 4096,) * 2, "NixlPullConnector")}
    shifts = pd.align(found, {(i.run, i.host): i.clock_offset_ns for i in runs_of(ds)})
    # every pair: theta < d_arrive - p_finish = SKEW + 10 ms; theta > d_alloc - p_sent = SKEW - 18 ms
    d = shifts["hd"]
    assert (d.reference, d.lo_ns, d.hi_ns, d.pairs) == ("hp", SKEW - 18 * MS, SKEW + 10 * MS, 3)
    assert (d.shift_ns, d.error_ns) == (SKEW - 4 * MS, 14 * MS)
    assert d.shift_ns - d.error_ns <= SKEW <= d.shift_ns + d.error_ns
    assert (shifts["hp"].shift_ns, shifts["hp"].error_ns) == (0, 0)


def test_ttft_parts_on_one_timeline_sum_to_ttft(tmp_path):
    """With the requests rows (P: scheduled +20 ms, prefill end +290 ms; D: first token +340 ms),
    on the prefill host's clock, less the estimated shift (4 ms short of the skew):
    queue 20, prefill 270, handoff 310-290+4 = 24, pull 331-310 = 21, first decode 9 ms; TTFT 344 ms
    (the true 340 ms plus the shift's 4 ms error, within the 14 ms bound)."""
    ds = dataset(tmp_path)
    infos = runs_of(ds)
    found = pd.pairs(ds, infos)
    offsets = {(i.run, i.host): i.clock_offset_ns for i in infos}
    reqs = {("rp", "hp"): {}, ("rd", "hd"): {}}
    for x in found:
        t = int(x.p.request[6]) * S if x.how == "prompt" else S
        reqs[("rp", "hp")][(7, x.p.request)] = {"arrival_ns": P_MONO + t, "first_scheduled_ns": P_MONO + t + 20 * MS,
                                                "prefill_end_ns": P_MONO + t + 290 * MS}
        reqs[("rd", "hd")][(9, x.d.request)] = {"arrival_ns": D_MONO + t + 310 * MS, "first_scheduled_ns": D_MONO + t + 332 * MS,
                                                "prefill_end_ns": D_MONO + t + 340 * MS}
    rows = pd.rows(found, pd.align(found, offsets), offsets, reqs)[("rd", "hd")]
    assert len(rows) == 3
    for r in rows:
        parts = [r[k] // MS for k in ("queue_ns", "prefill_ns", "handoff_ns", "pull_ns", "first_decode_ns")]
        assert parts == [20, 270, 24, 21, 9] and r["ttft_ns"] == sum(r[k] for k in (
            "queue_ns", "prefill_ns", "handoff_ns", "pull_ns", "first_decode_ns")) == 344 * MS
        assert (r["clock_shift_ns"], r["clock_error_ns"]) == (SKEW - 4 * MS, 14 * MS)


def test_the_decode_request_joins_the_prefill_requests_trace(tmp_path):
    ds = dataset(tmp_path)
    found = pd.pairs(ds, runs_of(ds))
    handed = pd.handoffs(found)
    assert set(handed) == {("rd", "hd")} and len(handed[("rd", "hd")]) == 3
    for x in found:
        trace, _, _ = ids.trace_of("rp", x.p.request, "")
        tp = handed[("rd", "hd")][x.d.request]
        assert ids.parse_traceparent(tp)[:2] == (trace, ids.request_span(trace, x.p.request))


def test_the_analyze_section_sums_and_means():
    """handover.section on two groups' figure rows: 3 + 1 pairs, the parts' means over the 4 timed
    pairs (ms: queue 40/4, prefill 800/4, ...), their shares of the summed TTFT (1,200 ms)."""
    from kvtrace.analysis import handover

    def g(run, pairs, by_id, parts, ttft, transport=None):
        return {"run": run, "p_host": "hp", "connector": "NixlPullConnector", "pairs": pairs, "by_request_id": by_id,
                "p_blocks": 22 * pairs, "d_blocks": 22 * pairs, "p_bytes": 100 * pairs, "d_bytes": 100 * pairs,
                "bytes_differ": 0, "transport_calls": transport and transport[0], "transport_bytes": transport and transport[1],
                "transport_traced": pairs if transport else 0, "clock_shift_ns": 5 * MS, "clock_error_ns": 2 * MS,
                "unbounded": 0, "untimed": 0, **{f"{p}_ns": v * MS for p, v in zip(handover.PARTS, parts)},
                "ttft_ns": ttft * MS, "ttft_max_ns": ttft * MS}
    sec = handover.section({"handovers": [g("rd", 3, 1, (30, 600, 60, 90, 120), 900, (6, 300)),
                                          g("re", 1, 0, (10, 200, 20, 30, 40), 300)]})
    assert (sec["pairs"], sec["by_request_id"], sec["by_prompt"]) == (4, 1, 3)
    assert sec["blocks"] == {"prefill": 88, "decode": 88} and sec["bytes"] == {"prefill": 400, "decode": 400}
    assert sec["transport"] == {"pairs": 3, "calls": 6, "bytes": 300}
    assert sec["parts_mean_s"] == {"queue": 0.01, "prefill": 0.2, "handoff": 0.02, "pull": 0.03, "first_decode": 0.04}
    assert sec["ttft_mean_s"] == 0.3 and sec["parts_share"]["prefill"] == 800 / 1200
    assert [c["error_s"] for c in sec["clocks"]] == [0.002, 0.002]
    assert handover.section({"handovers": []}) is None


def test_while_attached_the_decode_request_joins_the_prefill_trace_too(tmp_path):
    """One capture of both servers (attach --otlp): the live correlator, fed the prefill side's
    records and then the decode side's, hands each decode request the traceparent `kvtrace export`
    gives it (pairs found by the same rules), in the arrive rows it buffers."""
    from kvtrace.correlate.live import LiveCorrelator

    ds = dataset(tmp_path)
    (rp,) = [i for i in runs_of(ds) if i.run == "rp"]
    (rd,) = [i for i in runs_of(ds) if i.run == "rd"]
    names = ("prompt_blocks", "arrive", "kv_finish", "kv_alloc", "kv_done")

    def tables(info):
        return {n: ds.table(n, run=info.run, host=info.host, partitions=False) for n in names
                if ds.files(n, run=info.run, host=info.host)}

    live = LiveCorrelator("rp")       # one capture: one run holds both servers
    live.feed(tables(rp))
    live.feed(tables(rd))
    got = dict(zip(live.buf["arrive"]["request"].to_pylist(), live.buf["arrive"]["traceparent"].to_pylist()))
    found = pd.pairs(ds, runs_of(ds))
    for x in found:
        trace, _, _ = ids.trace_of("rp", x.p.request, "")
        assert got[x.d.request] == f"00-{trace.hex()}-{ids.request_span(trace, x.p.request).hex()}-01"
        assert got[x.p.request] == ""
    assert live.pairs.paired == 3
