"""The report's KV tier section (kvtrace.analysis.tier; docs/analysis.md, "KV tier"): a tier
server's lookups and operations (tier_lookup, tier_op) beside vLLM's loads (kv_alloc, kv_done) and
admissions.  Each expected number is computed here from the rows written, token by token, by the
definitions in docs/analysis.md."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvtrace.analysis import render
from kvtrace.analysis.report import analyze

from . import analysis_fixture as fx

REPO = Path(__file__).resolve().parents[2]
TIER_PID = 300
CONN = "LMCacheMPConnector"
KIB = 1024


def at(step: int, ms: float) -> int:
    """A time ``ms`` (to the µs) into step ``step`` (fx.step_row: step k starts at k * 10 ms)."""
    return step * 10 * fx.MS + round(ms * 1000) * 1000


# a: prompt 600, loads [0, 512) async (alloc step 2, done step 3): its last lookup before the
#    alloc says chunk 1 from L2 (an earlier lookup and one after the alloc say otherwise)
# b: prompt 600, 512 tokens hit in vLLM's own cache; LMCache read both chunks from L2 for it anyway;
#    preempted, its re-admission at step 6 loads 64 tokens (not its prompt's split)
# c: prompt 300, no tier at all; computed in two chunks (the first ends inside a tier chunk)
# d: prompt 700, 224 local, loads [224, 512) in the same step (sync): chunk 0 from L2
ADMIT = [(3, "a", 600, 0, 512), (4, "b", 600, 512, 0), (5, "c", 300, 0, 0), (7, "d", 700, 224, 288)]
CHUNKS = [(3, "a", 512, 88, 600, 0, True), (4, "b", 512, 88, 600, 0, True), (5, "c", 0, 200, 300, 0, False),
          (6, "c", 200, 100, 300, 1, True), (7, "d", 512, 188, 700, 0, True)]
STEPS = [(1, 0, 1), (2, 0, 1), (3, 88, 0), (4, 88, 0), (5, 200, 0), (6, 100, 0), (7, 188, 0)]  # (step, prefill, decode)
ALLOC = [fx.hook({"step": 2, "t_ns": at(2, 0.2), "request": "a", "first": 0, "external": 512, "blocks": 16,
                  "nbytes": 16 * 64 * KIB, "async": 1, "connector": CONN}),
         fx.hook({"step": 6, "t_ns": at(6, 0.2), "request": "b", "first": 0, "external": 64, "blocks": 2,
                  "nbytes": 2 * 64 * KIB, "async": 0, "connector": CONN}),
         fx.hook({"step": 7, "t_ns": at(7, 0.2), "request": "d", "first": 224, "external": 288, "blocks": 9,
                  "nbytes": 9 * 64 * KIB, "async": 0, "connector": CONN})]
DONE = [fx.hook({"step": 3, "t_ns": at(3, 0.1), "request": "a", "direction": "load", "ok": 1, "connector": CONN})]


def lookup(t_ns, request, chunks, l1, l2_chunks):
    return fx.hook({"t_ns": t_ns, "request": request, "chunks": chunks, "l1": l1, "l2": len(l2_chunks),
                    "l2_chunks": l2_chunks, "tier": "lmcache"}, pid=TIER_PID)


def op(t0, t1, request, name, keys=0, tokens=0, nbytes=0, ok=1):
    return fx.hook({"t_start_ns": t0, "t_end_ns": t1, "request": request, "op": name, "keys": keys, "num_tokens": tokens,
                    "nbytes": nbytes, "ok": ok, "tier": "lmcache"}, pid=TIER_PID)


LOOKUPS = [lookup(at(1, 1), "a", 2, 2, []), lookup(at(1, 5), "a", 2, 1, [1]),
           lookup(at(1, 5), "a", 2, 1, [1]),                      # sent twice: counted once
           lookup(at(4, 1), "a", 2, 0, [0, 1]),                   # after a's load: not its split
           lookup(at(4, 0.1), "b", 2, 0, [0, 1]), lookup(at(7, 0.1), "d", 2, 1, [0])]
OPS = [op(at(1, 2), at(1, 4), "a", "l2_read", keys=1, nbytes=512 * KIB),
       op(at(4, 0.2), at(4, 1.7), "b", "l2_read", keys=2, nbytes=1024 * KIB),
       op(at(7, 0.05), at(7, 0.15), "d", "l2_read", keys=1, nbytes=512 * KIB),
       op(at(2, 1), at(2, 4), "a", "retrieve", tokens=512, nbytes=1024 * KIB + 725),
       op(at(7, 0.3), at(7, 1.3), "d", "retrieve", tokens=288, nbytes=576 * KIB + 400),
       op(at(3, 8), at(3, 8.5), "a", "store", tokens=256, nbytes=512 * KIB + 300),
       op(at(3, 8.5), at(3, 9.25), "a", "store", tokens=256, nbytes=512 * KIB + 300),
       op(at(3, 9), at(3, 9.5), "", "l2_write", keys=1, nbytes=512 * KIB),
       op(at(4, 9), at(4, 9.1), "", "l2_write", keys=1, nbytes=512 * KIB, ok=0),
       op(at(6, 1), at(6, 1.01), "", "evict", keys=3)]


def tiers_row(chunk_tokens: int) -> dict:
    return {"ts_ns": at(0, 1), "kind": "lmcache", "pid": TIER_PID, "address": "127.0.0.1", "port": 8177,
            "connector": CONN, "version": "0.5.6", "storage": "fs:/data/l2", "chunk_tokens": chunk_tokens,
            "same_netns": True}


def build(root: Path, *, chunk_tokens: int | None = 256, tier_records: bool = True) -> Path:
    """Steps 1-7 with the admissions, chunks and loads above; the tier's records; its tiers row
    (none when chunk_tokens is None)."""
    fx.write(root, "step", [fx.step_row(k, p, d) for k, p, d in STEPS])
    fx.write(root, "chunk", [fx.chunk(*c) for c in CHUNKS])
    fx.write(root, "admit", [fx.admit(s, r, p, loc, ext) for s, r, p, loc, ext in ADMIT]
             + [fx.admit(6, "b", 600, 0, 64, attempt=1, prefill_len=604)])
    fx.write(root, "kv_alloc", ALLOC)
    fx.write(root, "kv_done", DONE)
    if tier_records:
        fx.write(root, "tier_lookup", LOOKUPS)
        fx.write(root, "tier_op", OPS)
    if chunk_tokens is not None:
        fx.write(root, "tiers", [tiers_row(chunk_tokens)])
    fx.write(root, "runs", [fx.run_row()], sch=fx.schema.RUNS)
    return root


# ---------------------------------------------------------------------------------------------
# What the section must say, from the rows above


def ms(ns) -> float | None:
    return None if ns is None else round(ns / 1e6, 6)


def the_lookup(request: str, alloc: dict | None) -> dict | None:
    mine = [x for x in LOOKUPS if x["request"] == request and (alloc is None or x["t_ns"] <= alloc["t_ns"])]
    return max(mine, key=lambda x: x["t_ns"]) if mine else None


def ops_of(request: str, name: str) -> list[dict]:
    return [o for o in OPS if o["request"] == request and o["op"] == name]


def expected_request(step, request, prompt, local, ct) -> dict:
    alloc = next((a for a in ALLOC if a["request"] == request and a["step"] <= step), None)
    lk = the_lookup(request, alloc)
    first, n = (alloc["first"], alloc["external"]) if alloc else (None, 0)
    l2_tokens = [t for t in range(first or 0, (first or 0) + n) if t // ct in (lk["l2_chunks"] if lk else [])]
    done = [d for d in DONE if alloc and d["request"] == request and d["t_ns"] >= alloc["t_ns"]]
    rd, rt = ops_of(request, "l2_read"), ops_of(request, "retrieve")
    return {"run": fx.RUN, "request": request, "step": step, "prompt_len": prompt, "device": local,
            "tier_l1": n - len(l2_tokens), "tier_l2": len(l2_tokens), "tier_unknown": 0, "recomputed": prompt - local - n,
            "first": first, "loaded": n, "lookup_chunks": lk and lk["chunks"], "lookup_l1": lk and lk["l1"],
            "lookup_l2": lk and lk["l2"], "l2_chunks": lk and lk["l2_chunks"],
            "l2_reads": len(rd), "l2_read_ms": ms(sum(o["t_end_ns"] - o["t_start_ns"] for o in rd)),
            "l2_read_bytes": sum(o["nbytes"] for o in rd), "retrieves": len(rt),
            "retrieve_ms": ms(sum(o["t_end_ns"] - o["t_start_ns"] for o in rt)),
            "retrieve_bytes": sum(o["nbytes"] for o in rt), "async": alloc and alloc["async"],
            "wait_ms": ms(done[0]["t_ns"] - alloc["t_ns"]) if alloc and alloc["async"] and done else None,
            "partial_chunk_tokens": prompt % ct}


def expected_rows(ct: int = 256) -> list[dict]:
    return [expected_request(s, r, p, loc, ct) for s, r, p, loc, _ in ADMIT]


def per_token(rows, tokens_key, ms_key, bytes_key=None) -> dict:
    rs = [r for r in rows if r[tokens_key] and r[ms_key] is not None]
    tok, t = sum(r[tokens_key] for r in rs), round(sum(r[ms_key] for r in rs), 6)
    out = {"requests": len(rs), "tokens": tok, "ms": t, "ms_per_token": round(t / tok, 6)}
    if bytes_key:
        b = sum(r[bytes_key] for r in rs)
        out.update(bytes=b, bytes_per_token=round(b / tok, 6))
    return out


def recompute_ms_per_token() -> float:
    """The report's recompute cost: prefill-only steps' execute window (7.5 ms; no KV load waits
    in a step here) over their prefill tokens."""
    pure = [p for _, p, d in STEPS if p and not d]
    return 7.5 * len(pure) / sum(pure)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tier") / "ds")


@pytest.fixture(scope="module")
def rep(ds) -> dict:
    return analyze(ds)


def test_per_request_tiers(rep):
    got = rep["tier"]["per_request"]
    assert got == expected_rows()
    # said once in plain numbers: a's chunk 1 and d's chunk 0 came from L2
    split = {r["request"]: (r["device"], r["tier_l1"], r["tier_l2"], r["recomputed"]) for r in got}
    assert split == {"a": (0, 256, 256, 88), "b": (512, 0, 0, 88), "c": (0, 0, 0, 300), "d": (224, 256, 32, 188)}


def test_totals_over_requests(rep):
    t, rows = rep["tier"], expected_rows()
    pt = sum(r["prompt_len"] for r in rows)
    tokens = {k: sum(r[k] for r in rows) for k in ("device", "tier_l1", "tier_l2", "tier_unknown", "recomputed")}
    assert (t["tiers"], t["chunk_tokens"], t["chunk_tokens_stated"]) == (["lmcache"], 256, True)
    assert (t["requests"], t["prompt_tokens"], t["tokens"]) == (len(ADMIT), pt, tokens)
    assert sum(tokens.values()) == pt
    assert t["shares"] == {k: round(v / pt, 6) for k, v in tokens.items()}
    assert (t["loads"], t["loaded_tokens"], t["async_waits"]) == (2, 800, 1)
    assert t["wait_ms"] == ms(DONE[0]["t_ns"] - ALLOC[0]["t_ns"])
    assert t["l2_read_bytes"] == sum(o["nbytes"] for o in OPS if o["op"] == "l2_read")
    assert t["servers"] == [{"kind": "lmcache", "connector": CONN, "version": "0.5.6", "storage": "fs:/data/l2",
                             "chunk_tokens": 256}]


def test_reload_against_recompute(rep):
    rr, rows = rep["tier"]["reload_vs_recompute"], expected_rows()
    l2 = per_token(rows, "tier_l2", "l2_read_ms", "l2_read_bytes")
    ret = per_token(rows, "loaded", "retrieve_ms", "retrieve_bytes")
    assert (rr["l2_read"], rr["retrieve"]) == (l2, ret)
    assert (l2["tokens"], l2["ms"], ret["tokens"], ret["ms"]) == (288, 2.1, 800, 4)    # a and d
    assert rr["wait"] == {"requests": 1, "tokens": 512, "ms": ms(DONE[0]["t_ns"] - ALLOC[0]["t_ns"]),
                          "ms_per_token": round(ms(DONE[0]["t_ns"] - ALLOC[0]["t_ns"]) / 512, 6)}
    rc = recompute_ms_per_token()
    assert rr["recompute"]["ms_per_token"] == pytest.approx(rc, abs=1e-6)
    assert rr["recompute"]["basis"] == "5 prefill-only steps"
    assert rr["from_l2_ms_per_token"] == pytest.approx(l2["ms_per_token"] + ret["ms_per_token"], abs=1e-6)
    assert rr["from_l1_ms_per_token"] == ret["ms_per_token"]
    assert rr["cheaper_from_l2"] == ("reload" if rr["from_l2_ms_per_token"] < rc else "recompute") == "reload"
    assert rr["cheaper_from_l1"] == "reload"


def test_chunk_alignment(rep):
    a, rows = rep["tier"]["alignment"], expected_rows()
    partial = sum(p % 256 for _, _, p, _, _ in ADMIT)
    cut = [c for c in CHUNKS if not c[6]]
    assert a == {"block_size": fx.BS, "chunk_budget": max(p for s, p, _ in STEPS if s in {c[0] for c in cut}),
                 "partial_chunk_tokens": partial, "partial_chunk_share": round(partial / sum(r["prompt_len"] for r in rows), 6),
                 "requests_with_partial_chunk": sum(1 for _, _, p, _, _ in ADMIT if p % 256),
                 "prefill_chunks_not_last": len(cut), "mid_chunk_ends": sum(1 for c in cut if (c[2] + c[3]) % 256)}
    assert (a["partial_chunk_tokens"], a["chunk_budget"], a["mid_chunk_ends"]) == (408, 200, 1)


def test_tier_side_totals(rep):
    t = rep["tier"]
    for name in ("l2_read", "l2_write", "retrieve", "store", "evict"):
        mine = [o for o in OPS if o["op"] == name]
        durs = sorted(o["t_end_ns"] - o["t_start_ns"] for o in mine)
        assert t["ops"][name] == {"count": len(mine), "keys": sum(o["keys"] for o in mine),
                                  "tokens": sum(o["num_tokens"] for o in mine), "bytes": sum(o["nbytes"] for o in mine),
                                  "ms": ms(sum(durs)), "p50_ms": ms(durs[(len(durs) + 1) // 2 - 1]),
                                  "max_ms": ms(durs[-1]), "failed": sum(1 for o in mine if not o["ok"])}, name
    once = {(x["request"], x["t_ns"]): x for x in LOOKUPS}.values()
    assert t["lookups"] == {"lookups": len(once), "requests": 3, "chunks": sum(x["chunks"] for x in once),
                            "l1": sum(x["l1"] for x in once), "l2": sum(x["l2"] for x in once)}
    (b,) = ops_of("b", "l2_read")
    assert t["l2_reads_unused"] == {"requests": 1, "reads": 1, "bytes": b["nbytes"], "ms": ms(b["t_end_ns"] - b["t_start_ns"])}


def test_the_text_report_says_it(rep):
    con = Console(width=400, record=True, file=io.StringIO())
    render.terminal(rep, console=con)
    text = con.export_text()
    assert ("KV tier lmcache (256-token chunks): 4 requests, 2,200 prompt tokens: device 736 (33.45%), tier L1 512 "
            "(23.27%), tier L2 288 (13.09%), recomputed 664 (30.18%); 2 loads of 800 tokens (1 async: vLLM waited "
            "9.900 ms for them)") in text
    assert "KV tier reload vs recompute per token: L2 disk->CPU 0.0073 ms, 3,641 B (288 tokens); L1->engine" in text
    assert "from L2 0.0123 ms, 4.6× cheaper than recomputing; from L1 0.0050 ms, 11.3× cheaper than recomputing" in text
    assert ("KV tier chunk 256 tokens against vLLM's 32-token block (8 blocks) and the 200-token chunk budget: 408 prompt "
            "tokens (18.55%) of 4 requests in a partial tier chunk, which the tier never stores; 1 of 1 non-final "
            "prefill chunks ended inside a tier chunk") in text
    assert ("KV tier server: 5 lookups of 10 chunks (4 in L1, 6 from L2); 3 L2 reads (2.0 MiB, p50 1.500 ms, max "
            "2.000 ms); 1 of them (1.0 MiB) for 1 request that loaded nothing from L2; 2 L2 writes (1.0 MiB); 2 stores "
            "(512 tokens, 1.0 MiB); 2 retrieves (800 tokens, 1.6 MiB); 1 eviction (3 keys); 1 failed operation") in text


def test_the_chunk_size_comes_from_the_tiers_table(tmp_path):
    rep = analyze(build(tmp_path / "ds", chunk_tokens=128))
    assert rep["tier"]["chunk_tokens"] == 128 and rep["tier"]["per_request"] == expected_rows(128)
    assert rep["tier"]["per_request"][0]["tier_l2"] == 128      # a: chunk 1 is now tokens [128, 256)


def test_without_a_tiers_row_the_chunk_is_lmcaches_default(tmp_path):
    rep = analyze(build(tmp_path / "ds", chunk_tokens=None))
    assert (rep["tier"]["chunk_tokens"], rep["tier"]["chunk_tokens_stated"]) == (256, False)
    assert rep["tier"]["per_request"] == expected_rows(256)
    assert any(x.startswith("KV tier lmcache (256-token chunks, LMCache's default") for x in rep["headline"])


def test_no_tier_records_no_section(tmp_path):
    for rep in (analyze(fx.build(tmp_path / "plain")), analyze(build(tmp_path / "tiers-only", tier_records=False))):
        assert "tier" not in rep
        assert not any(x.startswith("KV tier") for x in rep["headline"])


def test_cli_json(ds, rep):
    r = subprocess.run([sys.executable, "-m", "kvtrace", "analyze", str(ds), "--json"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["tier"] == rep["tier"] and got["tier"]["per_request"] == expected_rows()


@pytest.mark.slow
@pytest.mark.long   # Apache Spark, the second SQL engine: make test-long
def test_spark_report_equals_duckdb(ds, rep):
    fx.assert_spark_report_equals(ds, rep)
