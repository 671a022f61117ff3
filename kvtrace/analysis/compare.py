"""Two analysed runs side by side (`kvtrace compare BASE NEW`): each figure with its delta and
ratio, and gates in the study's form (``ttft_p50<=-25%``).

Every figure is read from each run's own `kvtrace analyze` report (kvtrace.analysis.report), so
a figure here is, by construction, the one `analyze --json` gives for that run.  Runs of
different sizes are compared by rates, shares and percentiles; totals are shown per request.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvtrace.errors import UsageError

CAUSES = ("miss_cold", "miss_unseen", "miss_evicted", "miss_inflight", "miss_tail", "miss_other_key",
          "miss_not_looked_up", "miss_tier_partial",
          "miss_other_engine", "miss_group", "miss_match_unit",
          "miss_spec_dropped")


def _per_request(rep: dict, key: str) -> float | None:
    n = rep["service"]["requests"] or rep["reuse"]["requests"]
    v = rep["misses"][key] if key in ("missed_tokens",) else None
    return (v / n) if n and v is not None else None


def _s(rep: dict, key: str) -> float | None:
    v = rep["service"].get(key)
    return None if v is None else v / 1e9


def _gbps(rep: dict) -> float | None:
    s = rep["service"]["storage_read_gb_per_s"]
    return max(s.values()) if s else None


def _reload_speedup(rep: dict) -> float | None:
    """Recomputing a token over reloading it: the report's, from kvtrace's own loads (kv_load);
    else the KV tier's (LMCache's L2 reads and retrieves over the tokens it loaded)."""
    own = (rep.get("reload_vs_recompute") or {}).get("speedup")
    if own is not None:
        return own
    rr = (rep.get("tier") or {}).get("reload_vs_recompute")
    if not rr:
        return None
    loaded, rc = rr["retrieve"]["tokens"], rr["recompute"]["ms_per_token"]
    ms = (rr["retrieve"]["ms"] or 0) + (rr["l2_read"]["ms"] or 0)
    return rc / (ms / loaded) if loaded and ms and rc else None


# (name, where in the report, unit, what it is).  ``where``: a path of keys, or a function of the report.
FIGURES: list[tuple[str, object, str, str]] = [
    ("ttft_p50", lambda r: _s(r, "ttft_p50_ns"), "s", "time to first token, median"),
    ("ttft_p90", lambda r: _s(r, "ttft_p90_ns"), "s", "time to first token, 90th percentile"),
    ("ttft_p99", lambda r: _s(r, "ttft_p99_ns"), "s", "time to first token, 99th percentile"),
    ("prompt_tokens_per_s", ("service", "prompt_tokens_per_s"), "tok/s", "prompt tokens per second of the run"),
    ("output_tokens_per_s", ("service", "output_tokens_per_s"), "tok/s", "output tokens per second of the run"),
    ("hit_rate", ("reuse", "hit_rate"), "share", "prompt tokens hit at first admission"),
    ("hit_rate_local", ("reuse", "local_rate"), "share", "... from the local prefix cache"),
    ("hit_rate_storage", ("reuse", "external_rate"), "share", "... from the KV connector (storage)"),
    *[(c, ("misses", "shares", c), "share", f"prompt tokens missed: {c.removeprefix('miss_').replace('_', ' ')}")
      for c in CAUSES],
    ("chunk_ends_mid_block", ("chunking", "partial_blocks", "mid_block_ends"), "n",
     "non-final chunks that ended inside a block (never on a token-granular cache)"),
    ("recomputed_tokens_per_request", lambda r: _per_request(r, "missed_tokens"), "tok",
     "prompt tokens computed per request (missed at first admission)"),
    ("readmit_recomputed_tokens", ("misses", "readmissions", "recomputed"), "tok",
     "tokens recomputed at re-admissions after preemption"),
    ("storage_read_gb_per_s", _gbps, "GB/s", "storage read bandwidth over the run (KV loads, block or file reads)"),
    ("reload_speedup", _reload_speedup, "x", "reloading a token against recomputing it"),
    ("share_compute", ("timing", "shares", "compute"), "share", "chunk time: compute"),
    ("share_storage", ("timing", "shares", "storage"), "share", "chunk time: storage wait"),
    ("share_queueing", ("timing", "shares", "queueing"), "share", "chunk time: queueing"),
]
NAMES = [f[0] for f in FIGURES]


def figure(rep: dict, where) -> float | None:
    if callable(where):
        return where(rep)
    v = rep
    for k in where:
        if not isinstance(v, dict) or v.get(k) is None:
            return None
        v = v[k]
    return v


@dataclass
class Gate:
    text: str
    name: str
    op: str
    value: float
    relative: bool   # a % of the base, else an absolute change in the figure's unit

    def check(self, base: float | None, new: float | None) -> tuple[bool | None, float | None]:
        """(passed, the change it tests) or (None, None) when a run lacks the figure."""
        if base is None or new is None or (self.relative and not base):
            return None, None
        change = (new / base - 1) * 100 if self.relative else new - base
        ok = {"<=": change <= self.value, ">=": change >= self.value, "<": change < self.value, ">": change > self.value}
        return ok[self.op], change


_GATE = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([+-]?\d+(?:\.\d+)?)\s*(%?)\s*$")


def parse_gate(text: str) -> Gate:
    m = _GATE.match(text)
    if not m:
        raise UsageError(f"--gate {text!r}: write FIGURE OP CHANGE, e.g. 'ttft_p50<=-25%' (a % of BASE) or "
                         "'hit_rate>=+0.05' (an absolute change)")
    name, op, value, pct = m.groups()
    if name not in NAMES:
        raise UsageError(f"--gate {text!r}: no figure {name!r}; figures: {', '.join(NAMES)}")
    return Gate(text, name, op, float(value), bool(pct))


def compare(base: dict, new: dict, gates: list[Gate] = ()) -> dict:
    """The comparison of two analyze reports (kvtrace.analysis.report.analyze)."""
    rows = []
    for name, where, unit, what in FIGURES:
        b, n = figure(base, where), figure(new, where)
        rows.append({"figure": name, "unit": unit, "what": what, "base": b, "new": n,
                     "delta": (n - b) if b is not None and n is not None else None,
                     "ratio": (n / b) if b and n is not None else None})
    by = {r["figure"]: r for r in rows}
    checked = []
    for g in gates:
        ok, change = g.check(by[g.name]["base"], by[g.name]["new"])
        checked.append({"gate": g.text, "figure": g.name, "change": change, "unit": "%" if g.relative else by[g.name]["unit"],
                        "passed": ok})
    return {"base": _run(base), "new": _run(new), "compared": _what(base, new), "figures": rows, "gates": checked,
            "passed": all(c["passed"] for c in checked)}


def _run(rep: dict) -> dict:
    s = rep["service"]
    engines = (rep.get("server") or {}).get("engines") or []
    return {"dataset": rep.get("dataset"), "engine": ", ".join(f"{e['name']} {e['version']}" for e in engines) or None,
            "requests": s["requests"], "prompt_tokens": s["prompt_tokens"],
            "output_tokens": s["output_tokens"], "window_s": (s["window_ns"] or 0) / 1e9,
            "bottleneck": rep["verdict"]["bottleneck"]}


def _what(base: dict, new: dict) -> str:
    b, n = base["service"]["requests"], new["service"]["requests"]
    if b == n:
        return f"{b} requests in each run: every figure compared as it is"
    return (f"{b} requests in BASE, {n} in NEW: rates, shares and percentiles compared as they are; "
            "token counts per request")
