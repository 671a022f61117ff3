"""The files of each table the analysis reads, checked one by one before any engine sees them.

A file whose footer cannot be read (truncated, corrupt) is left out and named in the gaps, so
the rest of the dataset is still analysed; a file of another schema version stops the analysis
with its name (mixing versions would silently change what columns mean).  Columns are given
safe names (``start`` -> ``tok_start`` ...) so one SQL text runs on DuckDB and Spark alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.dataset import schema
from kvtrace.errors import DatasetError

# Column kinds: I integer (read as BIGINT), F double, S text, H 64-bit hash (kept unsigned),
# HL list of 64-bit hashes.
# table -> [(column in the file, name in the SQL views, kind)]
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "step": [("pid", "pid", "I"), ("step", "step", "I"), ("t_start_ns", "t_start_ns", "I"),
             ("t_sched_end_ns", "t_sched_end_ns", "I"), ("t_end_ns", "t_end_ns", "I"),
             ("num_reqs", "num_reqs", "I"), ("total_tokens", "total_tokens", "I"),
             ("prefill_reqs", "prefill_reqs", "I"), ("prefill_tokens", "prefill_tokens", "I"),
             ("decode_reqs", "decode_reqs", "I"), ("decode_tokens", "decode_tokens", "I"),
             ("preempted", "preempted", "I"), ("evicted", "evicted", "I"), ("alloc_failures", "alloc_failures", "I"),
             ("running", "running", "I"), ("waiting", "waiting", "I"), ("free_blocks", "free_blocks", "I")],
    "chunk": [("pid", "pid", "I"), ("step", "step", "I"), ("request", "request", "S"), ("attempt", "attempt", "I"),
              ("chunk_index", "chunk_index", "I"), ("start", "tok_start", "I"), ("length", "tok_len", "I"),
              ("prompt_len", "prompt_len", "I"), ("prefill_len", "prefill_len", "I"), ("last", "is_last", "I"),
              ("resumed", "resumed", "I")],
    "admit": [("pid", "pid", "I"), ("step", "step", "I"), ("request", "request", "S"), ("attempt", "attempt", "I"),
              ("prompt_len", "prompt_len", "I"), ("prefill_len", "prefill_len", "I"),
              ("cached_local", "cached_local", "I"), ("cached_external", "cached_external", "I"),
              ("start", "tok_start", "I"), ("hit_blocks", "hit_blocks", "I"), ("resumed", "resumed", "I")],
    "evict": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("block_hash", "block_hash", "H"),
              ("request", "request", "S")],
    "preempt": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                ("computed_before", "computed_before", "I"), ("num_tokens", "num_tokens", "I"),
                ("num_preemptions", "attempt", "I")],
    "kv_load": [("pid", "pid", "I"), ("t_start_ns", "t_start_ns", "I"), ("t_end_ns", "t_end_ns", "I"),
                ("blocks", "blocks", "I"), ("nbytes", "nbytes", "I"), ("wait_ns", "wait_ns", "I"),
                ("request", "request", "S"), ("source", "source", "S")],
    "kv_store": [("pid", "pid", "I"), ("t_start_ns", "t_start_ns", "I"), ("t_end_ns", "t_end_ns", "I"),
                 ("blocks", "blocks", "I"), ("nbytes", "nbytes", "I"), ("request", "request", "S"),
                 ("source", "source", "S")],
    "arrive": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S")],
    "finish": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
               ("output_tokens", "output_tokens", "I")],
    "prompt_blocks": [("pid", "pid", "I"), ("step", "step", "I"), ("request", "request", "S"),
                      ("block_size", "block_size", "I"), ("prompt_len", "prompt_len", "I"),
                      ("max_output", "max_output", "I"), ("num_blocks", "num_blocks", "I"),
                      ("first", "first_block", "I"), ("hashes", "hashes", "HL")],
    "block_io": [("ts_ns", "ts_ns", "I"), ("start_ns", "start_ns", "I"), ("pid", "pid", "I"), ("disk", "disk", "S"),
                 ("op", "op", "S"), ("bytes", "bytes", "I"), ("error", "error", "I"), ("queue_ns", "queue_ns", "I"),
                 ("device_ns", "device_ns", "I"), ("latency_ns", "latency_ns", "I"), ("weight", "weight", "I")],
    "file_io": [("ts_ns", "ts_ns", "I"), ("start_ns", "start_ns", "I"), ("pid", "pid", "I"), ("tid", "tid", "I"),
                ("syscall", "syscall", "S"), ("path", "path", "S"), ("bytes", "bytes", "I"), ("ret", "ret", "I"),
                ("latency_ns", "latency_ns", "I"), ("weight", "weight", "I")],
    "nvme_cmd": [("ts_ns", "ts_ns", "I"), ("latency_ns", "latency_ns", "I"), ("ctrl", "ctrl", "S"),
                 ("transport", "transport", "S"), ("qid", "qid", "I"), ("disk", "disk", "S"), ("op", "op", "S"),
                 ("opclass", "opclass", "S"), ("bytes", "bytes", "I"), ("status", "status", "I"),
                 ("sq_occupancy", "sq_occupancy", "I"), ("weight", "weight", "I")],
    "nic_counters": [("ts_ns", "ts_ns", "I"), ("interval_ns", "interval_ns", "I"), ("device", "device", "S"),
                     ("port", "port", "I"), ("name", "name", "S"), ("delta", "delta", "I")],
    "vllm_metrics": [("ts_ns", "ts_ns", "I"), ("name", "name", "S"), ("labels", "labels", "S"), ("value", "value", "F")],
}
HOOK_TABLES = ("step", "chunk", "admit", "evict", "preempt", "kv_load", "kv_store", "arrive", "finish", "prompt_blocks")
# Without these there is nothing of vLLM to analyse.
REQUIRED = ("step", "chunk", "admit")


@dataclass
class Inputs:
    root: Path
    files: dict[str, list[Path]] = field(default_factory=dict)       # usable files per table
    present: dict[str, set[str]] = field(default_factory=dict)       # columns found per table
    gaps: list[str] = field(default_factory=list)                    # what is missing and why
    rows: dict[str, int] = field(default_factory=dict)

    def has(self, table: str) -> bool:
        return bool(self.files.get(table))


def _tables_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def _parquet_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.parquet") if not p.name.startswith((".", "_")))


def scan(root) -> Inputs:
    """Check every file of the tables the analysis uses; raise DatasetError when nothing usable is left."""
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"no dataset at {root}: give the --out directory of a kvtrace attach")
    if not root.is_dir():
        raise DatasetError(f"{root} is not a directory: give the --out directory of a kvtrace attach")
    inp = Inputs(root)
    names = _tables_in(root)
    all_files = {n: _parquet_files(root / n) for n in names}
    if not any(all_files.values()):
        raise DatasetError(f"{root} is an empty dataset: no Parquet files under it (expected e.g. {root}/step/host=*/date=*/*.parquet)")
    versions: dict[int, Path] = {}
    for name in names:
        for path in all_files[name]:
            try:
                md = pq.ParquetFile(path).schema_arrow
            except Exception as e:
                why = "truncated or corrupt (no readable Parquet footer)" if "footer" in str(e).lower() or "magic" in str(e).lower() \
                    or "size" in str(e).lower() else f"unreadable ({type(e).__name__}: {e})"
                inp.gaps.append(f"{path}: {why}; its rows of {name} are left out")
                continue
            meta = {}
            try:
                meta = json.loads((md.metadata or {}).get(schema.META_KEY, b"{}"))
            except ValueError:
                pass
            v = meta.get("schema_version")
            if v is not None:
                versions.setdefault(v, path)
                if v != schema.SCHEMA_VERSION:
                    others = ", ".join(f"{k} ({p})" for k, p in sorted(versions.items()) if k != v)
                    raise DatasetError(f"{path} has schema version {v}; this kvtrace reads version {schema.SCHEMA_VERSION}"
                                       + (f" (the dataset mixes versions: also {others})" if others else ""))
            if name not in COLUMNS:
                continue
            inp.files.setdefault(name, []).append(path)
            inp.present.setdefault(name, set()).update(md.names)
    for name, cols in COLUMNS.items():
        if not inp.has(name):
            continue
        have = inp.present[name]
        key = [c for c, _, _ in cols if c in ("request", "step", "t_ns", "ts_ns", "t_start_ns")]
        missing = [c for c in key if c not in have]
        if missing:
            inp.gaps.append(f"table {name} has no column {', '.join(missing)} ({inp.files[name][0]}); it is left out")
            inp.files.pop(name)
    hook = [t for t in HOOK_TABLES if inp.has(t)]
    if not all(inp.has(t) for t in REQUIRED):
        lacking = [t for t in REQUIRED if not inp.has(t)]
        kernel = [t for t in names if t not in HOOK_TABLES and t != "runs" and all_files.get(t)]
        what = f"only kernel tables ({', '.join(kernel)})" if kernel and not hook else f"tables {', '.join(hook) or 'none'}"
        unreadable = [g.split(";")[0] for g in inp.gaps if any(f"/{t}/" in g for t in lacking)]
        if unreadable:
            raise DatasetError(f"no readable {', '.join(lacking)} table left in {root}: {'; '.join(unreadable)}")
        raise DatasetError(
            f"{root} has no vLLM hook records in table {', '.join(lacking)} ({what}): "
            "KV reuse, chunk timing and service figures need the kvtrace hook inside vLLM (kvtrace attach to a vLLM server)")
    for t in ("arrive", "prompt_blocks", "kv_load", "evict"):
        if not inp.has(t):
            inp.gaps.append(GAP_TEXT[t])
    return inp


GAP_TEXT = {
    "arrive": "no arrive records: queueing before a request's first chunk and TTFT start at its first step, not its arrival",
    "prompt_blocks": "no prompt_blocks records: in-flight sharing, eviction re-references and whatif need prompt block hashes (hook 12+)",
    "kv_load": "no kv_load records: storage wait is 0 and reload cost unknown (no KV connector, or it was not traced)",
    "evict": "no evict records: no eviction seen (cache never full) or the hook's evict wrapper was off",
}


def read_table(inp: Inputs, name: str) -> pa.Table:
    """One table through pyarrow (for whatif and for locating a file an engine could not read)."""
    parts = []
    for path in inp.files.get(name, []):
        parts.append(pq.read_table(path).replace_schema_metadata(None))
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="default")


def find_unreadable(inp: Inputs) -> list[tuple[str, Path, str]]:
    """Files whose data pages cannot be decoded (a footer can be fine while a page is corrupt)."""
    bad = []
    for name, paths in inp.files.items():
        for path in paths:
            try:
                pq.read_table(path)
            except Exception as e:
                bad.append((name, path, f"{type(e).__name__}: {str(e)[:160]}"))
    return bad
