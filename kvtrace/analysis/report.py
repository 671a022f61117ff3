"""Run the analysis' SQL on one engine and assemble the report (a dict: the --json output).

Every ratio is computed here from integer sums the engine returned, so DuckDB and Spark give
the same report; floats are rounded to 6 decimals and integral floats become ints.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtrace.analysis import connector, fleet, handover, load, queries, tier
from kvtrace.analysis.engine import make
from kvtrace.errors import DatasetError
from kvtrace.servers import registry

MAX_CHUNK_ROWS = 200_000  # per-chunk rows kept in the report (the figures use all of them)


def _norm(v):
    if isinstance(v, float):
        if v != v:  # NaN
            return None
        if v.is_integer() and abs(v) < 2 ** 53:
            return int(v)
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v


def _ratio(a, b):
    return (a / b) if b else None


def _rate_ps(n, ns):
    return (n / (ns / 1e9)) if ns else None


class Runner:
    def __init__(self, inp: load.Inputs, engine: str = "duckdb", master: str | None = None, block_size: int = 0):
        self.inp = inp
        self.engine_name = engine
        self.master = master
        self.block_size = block_size
        self.eng = None

    def _setup(self) -> None:
        self.eng = make(self.engine_name, self.master)
        self.eng.register(self.inp)

    def _view(self, name: str, sql: str) -> None:
        if name in queries.LAZY:
            self.eng.view(name, sql)
        else:
            self.eng.create(name, sql)

    def _figures(self) -> dict[str, list[dict]]:
        """Every figure's rows.  On an engine with workers, each figure starts as soon as the views
        it names exist (views are made in order, each after those it reads), beside the views
        still being made and the other figures."""
        views = queries.views(self.block_size)
        if self.eng.workers <= 1:
            for name, sql in views:
                self._view(name, sql)
            return {name: self.eng.rows(sql) for name, sql in queries.FIGURES.items()}
        names = [n for n, _ in views]
        need = {f: max((i for i, n in enumerate(names) if re.search(rf"\b{n}\b", sql)), default=-1)
                for f, sql in queries.FIGURES.items()}
        pool = ThreadPoolExecutor(self.eng.workers, thread_name_prefix="kvtrace-analyze")
        futures: dict = {}

        def start(made: int) -> None:
            for f, sql in queries.FIGURES.items():
                if f not in futures and need[f] <= made:
                    futures[f] = pool.submit(self.eng.rows, sql)
        try:
            start(-1)
            for i, (name, sql) in enumerate(views):
                self._view(name, sql)
                start(i)
            return {f: futures[f].result() for f in queries.FIGURES}
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def run(self) -> dict[str, list[dict]]:
        """All figures' rows; a file whose pages an engine cannot decode is found, left out, and the run repeated."""
        for attempt in range(2):
            try:
                if self.eng is not None:
                    self.eng.close()
                self._setup()
                return self._figures()
            except DatasetError:
                raise
            except Exception as e:
                if attempt:
                    raise DatasetError(f"the analysis failed on {self.inp.root}: {str(e).splitlines()[0][:300]}") from None
                bad = load.find_unreadable(self.inp)
                if not bad:
                    raise DatasetError(f"the analysis failed on {self.inp.root}: {str(e).splitlines()[0][:300]}") from None
                for table, path, why in bad:
                    self.inp.files[table] = [p for p in self.inp.files[table] if p != path]
                    self.inp.gaps.append(f"{path}: corrupt ({why}); its rows of {table} are left out")
                    if not self.inp.files[table]:
                        self.inp.files.pop(table)
                lacking = [t for t in load.REQUIRED if not self.inp.has(t)]
                if lacking:
                    raise DatasetError(f"{self.inp.root}: no readable {', '.join(lacking)} table left "
                                       f"({'; '.join(str(p) for _, p, _ in bad)} could not be read)") from None
            finally:
                if self.eng is not None and attempt == 0:
                    pass
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.eng is not None:
            self.eng.close()


def analyze(directory, engine: str = "duckdb", master: str | None = None, block_size: int = 0) -> dict:
    t0 = time.monotonic()
    inp = load.scan(directory)
    r = Runner(inp, engine, master, block_size)
    try:
        rows = r.run()
    finally:
        r.close()
    rep = build(rows, inp)
    rep["engine"] = engine
    rep["dataset"] = str(Path(directory))
    rep["elapsed_s"] = round(time.monotonic() - t0, 3)
    return rep


def build(rows: dict[str, list[dict]], inp: load.Inputs) -> dict:
    """The report from every figure's rows: one function per section, in the report's order (a
    section may add to ``gaps``, and the later ones read the earlier ones' prompt tokens)."""
    one = {k: (v[0] if v else {}) for k, v in rows.items()}
    gaps = list(inp.gaps)
    kinds = [registry.kind(k) for k in load.server_kinds(inp)]
    rep: dict = {"gaps": gaps}
    rep["block_size"] = _block_size(rows, gaps)
    rep["server"] = _server(rows, kinds)
    if len(rows["engines"]) > 1:   # several engines (data-parallel ranks, or runs): each its own figures
        rep["engines"] = [{**e, "hit_rate": _ratio(e["hit_tokens"] or 0, e["prompt_tokens"] or 0)} for e in rows["engines"]]
    fl = fleet.section(rows)
    if fl is not None:      # several engines: per server, for the fleet, and what routing lost
        rep["fleet"] = fl
    ho = handover.section(rows)
    if ho is not None:      # prefill/decode pairs: the KV handed over, TTFT's parts
        rep["handover"] = ho
    rep["reuse"] = reuse = _reuse(rows, one)
    pt = reuse["prompt_tokens"]
    rep["chunking"] = _chunking(rows, one, pt)
    rep["misses"] = _misses(rows, one)
    if kinds and all(k.cache_model == "radix" for k in kinds):
        _radix_inflight(rep, pt)
    rep["timing"] = _timing(rows, one)
    rep["reload_vs_recompute"] = _reload_vs_recompute(rows, one)
    rep["prefetch"] = _prefetch(rows, one, gaps)
    rep["storage"] = _storage(rows)
    conn = connector.section(rows)
    if conn is not None:    # only a dataset with connector records has the section
        rep["connector"] = conn
    tiers = tier.section(rows, rep["reload_vs_recompute"]["recompute"], rep["block_size"])
    if tiers is not None:   # only a dataset with a tier server's records has the section
        rep["tier"] = tiers
    rep["service"] = _service(rows, one, pt, gaps)
    if one["spec"].get("steps"):   # only a dataset with speculative decoding has the section
        rep["speculative"] = _speculative(one)
    rep["metrics"] = metrics_note(rows["metrics"], reuse)
    rep["verdict"] = verdict(rep)
    warnings = connector.hit_warnings(rows, reuse)
    if warnings:            # only when a count differs (datasets without any keep their report)
        rep["warnings"] = warnings
    rep["headline"] = headline(rep, kinds)
    return _normalised(rep)


def _normalised(rep: dict) -> dict:
    """``rep`` through _norm, but for the long per-row lists: they hold integers and text from SQL
    (ratios rounded where they are made) and are kept as they are."""
    big = {"per_request": rep["reuse"].pop("per_request"), "per_chunk": rep["timing"].pop("per_chunk"),
           "ttft_per_request": rep["service"].pop("ttft_per_request"), "miss_requests": rep["misses"].pop("per_request"),
           "loads": rep["connector"].pop("per_request") if "connector" in rep else None,
           "tier": rep["tier"].pop("per_request") if "tier" in rep else None}
    rep = _norm(rep)
    if big["loads"] is not None:
        rep["connector"]["per_request"] = big["loads"]
    if big["tier"] is not None:
        rep["tier"]["per_request"] = big["tier"]
    rep["reuse"]["per_request"] = big["per_request"]
    rep["misses"]["per_request"] = big["miss_requests"]
    rep["timing"]["per_chunk"] = big["per_chunk"]
    rep["service"]["ttft_per_request"] = big["ttft_per_request"]
    return rep


def _block_size(rows: dict[str, list[dict]], gaps: list[str]):
    sizes = sorted({r["bs"] for r in rows["block_size"] if r["bs"]})
    if not sizes:
        gaps.append("block size unknown (no prompt_blocks records and no local hit): give --block-size for the "
                    "partial-block, in-flight and eviction figures")
    return sizes[0] if len(sizes) == 1 else (sizes or None)


# What the figures count on each cache model (kvtrace.servers.kind.ServerKind.cache_model), said
# of the kind's title.
COUNTS = {
    "block_pool": "{title}'s prefix cache holds fixed blocks: hits count whole blocks, a prompt's partial last "
                  "block never hits",
    "radix": "{title}'s radix cache is token-granular (page size 1): a block in these figures is one token, so hits, "
             "misses and evictions count tokens, a chunk never ends inside a block, and a prompt's last token is "
             "always computed ({title} matches at most its length - 1)",
}
NO_KIND = ("the dataset does not say what server it recorded (kvtrace attach found none): the figures count the "
           "hook's blocks as recorded")


def _server(rows: dict[str, list[dict]], kinds: list) -> dict:
    """The serving engine(s) the hook ran in (its engine records) and what the figures count on
    the cache of each server kind recorded (kvtrace.analysis.load.server_kinds)."""
    engines = [{"name": r["name"], "version": r["version"], "block_size": r["block_size"]} for r in rows["server"]]
    counts = "; ".join(COUNTS.get(k.cache_model, "{title}'s cache: {model}").format(title=k.title, model=k.cache_model)
                       for k in kinds)
    return {"engines": engines, "counts": counts or NO_KIND}


def _radix_inflight(rep: dict, pt: int) -> None:
    """On SGLang the in-flight misses are the replay's (token_causes): a chunk is in the radix
    tree only from the next step on, which the block-allocation rule of the SQL figure (vLLM's:
    a block is matchable once allocated) does not see."""
    per = rep["misses"]["per_request"]
    n = rep["misses"]["first"].get("miss_inflight", 0) or 0
    rep["chunking"]["inflight"].update(
        requests=sum(1 for r in per if r.get("miss_inflight")), missed_tokens=n, missed_rate=_ratio(n, pt),
        rows=[], basis="token_causes (SGLang inserts a chunk into its radix tree at the next step)")


def _reuse(rows: dict[str, list[dict]], one: dict[str, dict]) -> dict:
    """KV reuse at first admission."""
    h = one["hit_overall"]
    pt = h.get("prompt_tokens") or 0
    ra, lc = one["readmit"], one["later_chunks"]
    reuse = {
        "requests": h.get("requests", 0), "prompt_tokens": pt,
        "hit_tokens": (h.get("hit_local") or 0) + (h.get("hit_external") or 0),
        "hit_local": h.get("hit_local") or 0, "hit_external": h.get("hit_external") or 0,
        "hit_rate": _ratio((h.get("hit_local") or 0) + (h.get("hit_external") or 0), pt),
        "local_rate": _ratio(h.get("hit_local") or 0, pt), "external_rate": _ratio(h.get("hit_external") or 0, pt),
        "not_counted": {
            "readmissions": ra.get("readmissions", 0), "readmission_reused_tokens": ra.get("reused_tokens", 0),
            "recomputed_after_preemption_tokens": ra.get("recomputed_tokens", 0),
            "later_chunks": lc.get("chunks", 0), "later_chunk_tokens": lc.get("tokens", 0),
        },
    }
    reuse["per_request"] = [
        {**r, "hit_rate": _norm(_ratio(r["cached_local"] + r["cached_external"], r["prompt_len"]))} for r in rows["hit_requests"]]
    reuse["by_chunk_index"] = [
        {**r, "hit_share": _ratio(r["hit"], r["hit"] + r["computed"])} for r in rows["hit_by_index"]]
    reuse["by_first_chunk_size"] = [
        {"first_chunk_tokens_le": r["bucket"], "requests": r["requests"], "prompt_tokens": r["prompt_tokens"],
         "hit_tokens": r["hit"], "hit_rate": _ratio(r["hit"], r["prompt_tokens"])} for r in rows["hit_by_size"]]
    return reuse


def _chunking(rows: dict[str, list[dict]], one: dict[str, dict], pt: int) -> dict:
    """Chunking versus blocks: partial blocks, prompt tails, in-flight misses and evictions."""
    pb, tails = one["partial_blocks"], one["prompt_tails"]
    infl = rows["inflight"]
    outc = {r["outcome"]: r for r in rows["reref_outcome"]}
    ev = one["evictions"].get("evictions", 0)
    dist = one["reref_dist"]
    lost = outc.get("lost", {})
    return {
        "partial_blocks": {"chunks_not_last": pb.get("chunks_not_last", 0), "mid_block_ends": pb.get("mid_block_ends", 0),
                           "partial_tokens": pb.get("partial_tokens", 0)},
        "prompt_tails": {"requests": tails.get("requests", 0), "with_tail": tails.get("with_tail", 0),
                         "tail_tokens": tails.get("tail_tokens", 0)},
        "inflight": {"requests": len(infl), "missed_tokens": sum(r["missed_tokens"] for r in infl),
                     "missed_rate": _ratio(sum(r["missed_tokens"] for r in infl), pt), "rows": infl},
        "evictions": {
            "evictions": ev, "rereferenced": sum(r["blocks"] for r in outc.values()),
            "outcomes": {k: {"blocks": v["blocks"], "tokens": v["tokens"]} for k, v in outc.items()},
            "thrash_blocks": lost.get("blocks", 0), "thrash_tokens": lost.get("tokens", 0),
            "thrash_rate": _ratio(lost.get("blocks", 0), ev),
            "distance": {k: dist.get(k) for k in ("n", "dt_p50", "dt_p90", "dt_p99", "steps_p50", "steps_p90", "dt_min", "dt_max")},
            "histogram": rows["reref_hist"],
            # per KV cache group, when there are several (a hybrid model)
            "by_group": [{**g, "thrash_rate": _ratio(g["thrash_blocks"], g["evictions"])}
                         for g in rows["evict_groups"]] if len(rows["evict_groups"]) > 1 else [],
        },
    }


CAUSES = queries.CAUSES
MISSES = CAUSES[2:]


def _misses(rows: dict[str, list[dict]], one: dict[str, dict]) -> dict:
    """Why each prompt token missed (token_causes): first admissions, in total and by chunk
    index; re-admissions after preemption; the evicted blocks' distances."""
    first = {c: 0 for c in CAUSES}
    again = {c: 0 for c in CAUSES}
    n_first = n_again = 0
    for r in rows["causes_total"]:
        d = first if r["admission"] == "first" else again
        d[r["cause"]] = d.get(r["cause"], 0) + (r["tokens"] or 0)
    tokens = sum(first.values())
    by_index: dict[int, dict] = {}
    for r in rows["causes_by_index"]:
        by_index.setdefault(r["chunk_index"], {"chunk_index": r["chunk_index"], **{c: 0 for c in MISSES}})[r["cause"]] = r["tokens"]
    ev = one["evicted_misses"]
    n_first = len(rows["causes_requests"])
    n_again = max((r["admissions"] for r in rows["causes_total"] if r["admission"] == "readmission"), default=0)
    return {
        "requests": n_first, "tokens": tokens, "first": first,
        "shares": {c: _ratio(v, tokens) for c, v in first.items()},
        "missed_tokens": sum(first[c] for c in MISSES),
        "readmissions": {"admissions": n_again, "tokens": sum(again.values()), "found_again": again["hit_local"] + again["hit_external"],
                         "recomputed": sum(again[c] for c in MISSES), "causes": again},
        "by_chunk_index": [by_index[k] for k in sorted(by_index)],
        "evicted": {"blocks": ev.get("blocks") or 0, "tokens": ev.get("tokens") or 0,
                    "distance_blocks_p50": ev.get("dblocks_p50"), "distance_blocks_p90": ev.get("dblocks_p90"),
                    "distance_s_p50": (ev["dt_p50"] / 1e9) if ev.get("dt_p50") is not None else None,
                    "distance_s_p90": (ev["dt_p90"] / 1e9) if ev.get("dt_p90") is not None else None,
                    "evicting_requests": ev.get("evicting_requests") or 0},
        "per_request": rows["causes_requests"],
    }


def _timing(rows: dict[str, list[dict]], one: dict[str, dict]) -> dict:
    """Time per chunk: compute, storage and queueing, and the chunks' verdicts."""
    ct = one["chunk_time"]
    queueing = (ct.get("queue_ns") or 0) + (ct.get("sched_ns") or 0)
    comp = {"compute": ct.get("compute_ns") or 0, "storage": ct.get("storage_ns") or 0, "queueing": queueing}
    total = sum(comp.values())
    counts = {r["verdict"]: r["chunks"] for r in rows["chunk_verdicts"]}
    chunk_rows = rows["chunks"]
    return {
        "chunks": ct.get("chunks", 0), "total_ns": total,
        "components_ns": {**comp, "queue_ns": ct.get("queue_ns") or 0, "sched_ns": ct.get("sched_ns") or 0,
                          "recompute_ns": ct.get("recompute_ns") or 0},
        "shares": {k: _ratio(v, total) for k, v in comp.items()},
        "verdict_counts": counts, "chunks_waiting_on_storage": ct.get("chunks_waiting", 0),
        "per_chunk": chunk_rows[:MAX_CHUNK_ROWS], "per_chunk_truncated": len(chunk_rows) > MAX_CHUNK_ROWS,
    }


def _reload_vs_recompute(rows: dict[str, list[dict]], one: dict[str, dict]) -> dict:
    rl, rc = one["reload"], one["recompute"]
    if rc.get("pure_tokens"):
        rc_ns, rc_tok, basis = rc["pure_ns"], rc["pure_tokens"], f"{rc['pure_steps']} prefill-only steps"
    else:
        rc_ns, rc_tok, basis = rc.get("all_ns") or 0, rc.get("all_tokens") or 0, f"{rc.get('steps', 0)} steps with prefill (decode tokens included)"
    reload_pt = _ratio(rl.get("load_ns") or 0, rl.get("tokens") or 0)
    recompute_pt = _ratio(rc_ns, rc_tok)
    per_chunk = []
    for r in rows["reload_chunks"]:
        tok = (r["blocks"] or 0) * (r["bs"] or 0)
        per_chunk.append({**r, "reload_ns_per_token": _ratio(r["load_ns"], tok),
                          "compute_ns_per_token": _ratio(r["compute_ns"], r["step_tokens"])})
    return {
        "reload": {"requests": rl.get("requests", 0), "loads": rl.get("loads", 0), "tokens": rl.get("tokens", 0),
                   "blocks": rl.get("blocks", 0), "bytes": rl.get("bytes", 0), "load_ns": rl.get("load_ns", 0),
                   "ns_per_token": reload_pt},
        "recompute": {"tokens": rc_tok, "compute_ns": rc_ns, "ns_per_token": recompute_pt, "basis": basis},
        "speedup": _ratio(recompute_pt, reload_pt) if reload_pt and recompute_pt else None,
        "saved_ns": ((recompute_pt - reload_pt) * (rl.get("tokens") or 0)) if reload_pt and recompute_pt else None,
        "per_chunk": per_chunk,
    }


def _prefetch(rows: dict[str, list[dict]], one: dict[str, dict], gaps: list[str]) -> dict:
    """Prefetch opportunity: the read time of evicted blocks that were needed again."""
    pf = {r["outcome"]: r for r in rows["prefetch"]}
    pa = one["prefetch_arrival"]
    per_block = next((r["per_block_ns"] for r in pf.values() if r.get("per_block_ns")), None)
    if per_block is None and rows["reref_outcome"]:
        gaps.append("no per-request KV loads: prefetch figures give re-reference distances only, no read latency to set them against")
    return {
        "read_ns_per_block": per_block,
        "by_outcome": {k: {"blocks": v["blocks"], "blocks_with_time": v["blocks_with_time"] if per_block else None,
                           "hideable_ns": v["hideable_ns"] if per_block else None} for k, v in pf.items()},
        "reloaded_hideable_ns": (pf.get("reloaded", {}).get("hideable_ns") if per_block else None),
        "lost_prefetchable_ns": (pf.get("lost", {}).get("hideable_ns") if per_block else None),
        "from_arrival": {"requests": pa.get("requests", 0), "load_ns": pa.get("load_ns", 0),
                         "hideable_ns": pa.get("hideable_ns", 0)},
    }


def _dev_rows(rs: list[dict], count_key: str) -> list[dict]:
    out = []
    for r in rs:
        span = (r["t1"] or 0) - (r["t0"] or 0)
        out.append({**r, "window_ns": span, "iops": _rate_ps(r[count_key], span), "bytes_per_s": _rate_ps(r["bytes"] or 0, span),
                    "queue_depth": _ratio(r["busy_ns"] or 0, span)})
    return out


PAGE = 4096   # bytes a page (file_map counts pages)


def _storage(rows: dict[str, list[dict]]) -> dict:
    return {"block_io": _dev_rows(rows["block_io"], "ios"), "nvme": _dev_rows(rows["nvme"], "commands"),
            "files": _dev_rows(rows["file_reads"], "reads"), "kv_transfers": rows["kv_transfers"],
            "mapped_files": [{**r, "bytes": (r["pages"] or 0) * PAGE} for r in rows["mapped_files"]],
            "nic_during_slow_chunks": rows["nic_slow"], "latency_histogram": rows["lat_hist"],
            "slow_chunks": slow_chunks(rows)}


def _speculative(one: dict[str, dict]) -> dict:
    """Draft tokens the scheduler proposed and the model accepted, per step and per request."""
    sp, sr = one["spec"], one["spec_requests"]
    return {"steps": sp["steps"], "drafts": sp["drafts"], "accepted": sp["accepted"], "kept": sp["kept"],
            "acceptance_rate": _ratio(sp["accepted"], sp["drafts"]),
            "requests": sr.get("requests") or 0, "request_drafts": sr.get("drafts") or 0,
            "request_accepted": sr.get("accepted") or 0, "request_output_tokens": sr.get("output_tokens") or 0}


def _service(rows: dict[str, list[dict]], one: dict[str, dict], pt: int, gaps: list[str]) -> dict:
    """Service figures: TTFT, throughput, bytes read, preemptions."""
    win = rows["window"]
    window_ns = sum((r["t1"] or 0) - (r["t0"] or 0) for r in win)
    sp = one["spec"]
    # a step's decode tokens count its draft tokens; a decoding request got 1 + its accepted
    # ones, those past its end dropped (kept)
    out_tokens = (sum(r["decode_tokens"] or 0 for r in win) + (one["first_tokens"].get("n") or 0)
                  - (sp.get("drafts") or 0) + (sp.get("kept") or 0))
    tt = one["ttft"]
    rb = one["read_bytes"]
    read_bytes = {k: rb.get(k) or 0 for k in ("kv_load_bytes", "block_read_bytes", "file_read_bytes")}
    service = {
        "window_ns": window_ns, "steps": sum(r["steps"] for r in win),
        "requests": tt.get("requests", 0), "ttft_from_arrival": tt.get("from_arrival", 0),
        "ttft_p50_ns": tt.get("ttft_p50"), "ttft_p90_ns": tt.get("ttft_p90"), "ttft_p99_ns": tt.get("ttft_p99"),
        "ttft_max_ns": tt.get("ttft_max"), "ttft_mean_ns": _ratio(tt.get("ttft_sum") or 0, tt.get("requests") or 0),
        "prompt_tokens": pt, "output_tokens": out_tokens,
        "prompt_tokens_per_s": _rate_ps(pt, window_ns), "output_tokens_per_s": _rate_ps(out_tokens, window_ns),
        "tokens_per_s": _rate_ps(pt + out_tokens, window_ns),
        "read_bytes": read_bytes, "storage_read_gb_per_s": {k: (_rate_ps(v, window_ns) or 0) / 1e9 for k, v in read_bytes.items()},
        "preemptions": sum(r["preemptions"] or 0 for r in win),
        "ttft_per_request": rows["ttft_requests"],
    }
    if tt.get("requests") and tt.get("from_arrival", 0) < tt["requests"]:
        gaps.append(f"{tt['requests'] - tt['from_arrival']} of {tt['requests']} requests have no arrival time: "
                    "their TTFT starts at their first step")
    return service


def slow_chunks(rows: dict[str, list[dict]]) -> list[dict]:
    """The slowest chunks, each with the NVMe commands (per controller and queue: weighted count,
    bytes, mean and max latency) and the NIC counter deltas of its step's window."""
    nvme, nic = {}, {}
    for r in rows["slow_nvme"]:
        nvme.setdefault(r["rk"], []).append({
            "ctrl": r["ctrl"], "qid": r["qid"], "transport": r["transport"], "commands": r["commands"],
            "bytes": r["bytes"], "latency_avg_ns": _ratio(r["latency_sum_ns"] or 0, r["commands"] or 0),
            "latency_max_ns": r["latency_max_ns"]})
    for r in rows["slow_nic"]:
        nic.setdefault(r["rk"], []).append({"device": r["device"], "name": r["name"], "delta": r["delta"]})
    return [{**{k: v for k, v in c.items() if k != "rk"}, "rank": c["rk"], "nvme": nvme.get(c["rk"], []),
             "nic": nic.get(c["rk"], [])} for c in rows["slow_chunks"]]


def metrics_note(mrows: list[dict], reuse: dict) -> dict:
    """The rise of the server's /metrics counters beside the hook's figures, and why they differ:
    the note of the scrapes' server kind (METRICS_NOTES, by its metrics prefix)."""
    m = {r["name"]: r["rise"] for r in mrows}
    if not m:
        return {"available": False}
    kinds = sorted({r["kind"] for r in mrows}, key=lambda k: k or "")
    if None in kinds or len(kinds) > 1:
        why = ("the scrapes name no server kind (a --metrics-url without a discovered server)" if None in kinds else
               f"the scrapes are of {len(kinds)} server kinds ({', '.join(registry.kind(k).title for k in kinds)})")
        return _uncompared(m, why)
    kind = registry.kind(kinds[0])
    note = METRICS_NOTES.get(kind.metrics_prefix)
    return note(m, reuse) if note else _uncompared(m, f"kvtrace compares none of {kind.title}'s counters")


def _uncompared(m: dict, why: str) -> dict:
    return {"available": True, "rises": m, "local_hit_rate": None, "combined_hit_rate": None,
            "why_different": [f"{why}: no counter is compared with the hook's figures"]}


def _vllm_metrics_note(m: dict, reuse: dict) -> dict:
    hits, queries_ = m.get("vllm:prefix_cache_hits_total"), m.get("vllm:prefix_cache_queries_total")
    ext = m.get("vllm:external_prefix_cache_hits_total") or 0
    rate = _ratio(hits or 0, queries_ or 0)
    why = []
    if queries_ is not None and queries_ != reuse["prompt_tokens"]:
        why.append(f"/metrics queried {queries_:,.0f} prompt tokens against {reuse['prompt_tokens']:,} in the hook's "
                   "admissions: its counters cover every request between the first and last scrape, including ones "
                   "admitted before the hook was attached or after it stopped")
    if hits is not None and hits != reuse["hit_local"]:
        why.append(f"/metrics hits {hits:,.0f} vs the hook's first-admission local hits {reuse['hit_local']:,}")
    if reuse["hit_external"] or ext:
        why.append("vllm:prefix_cache_hits counts the local prefix cache only; connector (storage) hits are in "
                   f"vllm:external_prefix_cache_hits ({ext:,.0f}), which kvtrace's rate includes as its own count of "
                   f"them ({reuse['hit_external']:,} at first admissions)")
    why.append("re-admissions after preemption are in neither figure (vLLM keeps them in stats it does not export)")
    return {"available": True, "rises": m, "local_hit_rate": rate,
            "combined_hit_rate": _ratio((hits or 0) + ext, queries_ or 0), "why_different": why}


def _sglang_metrics_note(m: dict, reuse: dict) -> dict:
    hits, prompt = m.get("sglang:cached_tokens_total"), m.get("sglang:prompt_tokens_total")
    why = []
    if prompt is not None and prompt != reuse["prompt_tokens"]:
        why.append(f"/metrics counted {prompt:,.0f} prompt tokens against {reuse['prompt_tokens']:,} in the hook's "
                   "admissions: SGLang counts a request when it finishes, in its HTTP process, for every request "
                   "between the first and last scrape")
    if hits is not None and hits != reuse["hit_local"]:
        why.append(f"sglang:cached_tokens_total rose {hits:,.0f} vs the hook's first-admission hits {reuse['hit_local']:,}")
    why.append("SGLang's cached tokens are each request's first match; a retracted request's re-admission is in "
               "neither figure")
    return {"available": True, "rises": m, "local_hit_rate": _ratio(hits or 0, prompt or 0),
            "combined_hit_rate": _ratio(hits or 0, prompt or 0), "why_different": why}


# The note of each kind's counters, by the kind's metrics prefix (the series it names).
METRICS_NOTES = {"vllm:": _vllm_metrics_note, "sglang:": _sglang_metrics_note}


def verdict(rep: dict) -> dict:
    t = rep["timing"]
    comp = t["components_ns"]
    main = {k: comp[k] for k in ("compute", "storage", "queueing")}
    if not t["chunks"] or not sum(main.values()):
        return {"bottleneck": None, "evidence": ["no timed chunks"]}
    which = max(main, key=lambda k: (main[k], k == "storage"))
    sh = t["shares"]
    ev = [f"{k} {main[k] / 1e9:.3f} s = {100 * (sh[k] or 0):.1f}% of chunk time over {t['chunks']} chunks"
          for k in sorted(main, key=lambda k: -main[k])]
    vc = t["verdict_counts"]
    ev.append("chunks by verdict: " + ", ".join(f"{k} {v}" for k, v in sorted(vc.items(), key=lambda kv: -kv[1])))
    rr = rep["reload_vs_recompute"]
    if rr["reload"]["ns_per_token"] and rr["recompute"]["ns_per_token"]:
        ev.append(f"reload {rr['reload']['ns_per_token'] / 1e3:.2f} µs/token vs recompute "
                  f"{rr['recompute']['ns_per_token'] / 1e3:.2f} µs/token ({rr['recompute']['basis']}): "
                  f"storage is {rr['speedup']:.2f}× {'faster' if rr['speedup'] >= 1 else 'slower'} than recomputing")
    if t["chunks_waiting_on_storage"]:
        ev.append(f"{t['chunks_waiting_on_storage']} chunks waited on KV loads in their step")
    if comp.get("recompute_ns"):
        ev.append(f"recompute after preemption: {comp['recompute_ns'] / 1e9:.3f} s of compute "
                  f"({rep['reuse']['not_counted']['recomputed_after_preemption_tokens']:,} tokens)")
    if which == "queueing":
        ev.append(f"queueing is {comp['queue_ns'] / 1e9:.3f} s waiting for a step (arrival or previous chunk to step "
                  f"start) plus {comp['sched_ns'] / 1e9:.3f} s in schedule()")
    return {"bottleneck": which, "evidence": ev}


def headline(rep: dict, kinds: list) -> list[str]:
    """The report in a few lines; first the engine, when the cache of a server kind recorded
    (``kinds``: kvtrace.servers.kind.ServerKind) is token-granular."""
    r, c = rep["reuse"], rep["chunking"]
    out = []
    if any(k.cache_model == "radix" for k in kinds):
        v = ", ".join(f"{e['name']} {e['version']}" for e in rep["server"]["engines"]) or ", ".join(k.name for k in kinds)
        out.append(f"engine: {v}; {rep['server']['counts']}")
    if r["hit_rate"] is not None:
        out.append(f"KV reuse: {100 * r['hit_rate']:.2f}% of {r['prompt_tokens']:,} prompt tokens hit at admission "
                   f"({100 * (r['local_rate'] or 0):.2f}% local prefix cache, {100 * (r['external_rate'] or 0):.2f}% storage)")
    out += connector.lines(rep.get("connector")) + tier.lines(rep.get("tier")) + rep.get("warnings", [])
    m = rep["misses"]
    if m["tokens"]:
        top = sorted(((v, k) for k, v in m["first"].items() if k.startswith("miss_") and v), reverse=True)
        out.append(f"why tokens missed: {m['missed_tokens']:,} of {m['tokens']:,} prompt tokens: "
                   + ", ".join(f"{k.removeprefix('miss_').replace('_', ' ')} {v:,}" for v, k in top))
    inf, ev = c["inflight"], c["evictions"]
    out.append(f"chunking: {c['partial_blocks']['mid_block_ends']} of {c['partial_blocks']['chunks_not_last']} non-final chunks "
               f"ended mid-block ({c['partial_blocks']['partial_tokens']:,} tokens in partial blocks); "
               f"{inf['missed_tokens']:,} tokens missed because a shared prefix was still being computed")
    out.append(f"evictions: {ev['evictions']:,}; {ev['rereferenced']:,} evicted blocks were needed again, "
               f"{ev['thrash_blocks']:,} of them recomputed (thrash, {ev['thrash_tokens']:,} tokens)")
    sp = rep.get("speculative")
    if sp:
        rate = "-" if sp["acceptance_rate"] is None else f"{100 * sp['acceptance_rate']:.1f}%"
        out.append(f"speculative decoding: {sp['accepted']:,} of {sp['drafts']:,} draft tokens accepted ({rate}) in "
                   f"{sp['steps']:,} steps; {rep['service']['output_tokens']:,} output tokens (drafts not counted)")
    v = rep["verdict"]
    if v["bottleneck"]:
        out.append(f"bottleneck: {v['bottleneck']} ({v['evidence'][0]})")
    return out
