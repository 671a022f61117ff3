"""The files of each table the analysis reads, as kvtrace.dataset lists and checks them.

The dataset's one rule (kvtrace.dataset.reader, docs/schema.md): a file that cannot be read
(truncated, corrupt) is left out, said on stderr and named in the gaps, so the rest of the
dataset is still analysed; a file without a schema version, or of one this kvtrace does not
read, stops the analysis with its name.  The engines (DuckDB's read_parquet, Spark) read the
files by path for their SQL, but only the files listed here.  Columns are given safe names
(``start`` -> ``tok_start`` ...) so one SQL text runs on DuckDB and Spark alike.

What server each run recorded, and its /metrics samples, are read in one place each,
server_kinds and server_metrics, for datasets of every version this kvtrace reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.errors import DatasetError
from kvtrace.servers import registry

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
    "kv_group": [("pid", "pid", "I"), ("group", "grp", "I"), ("kind", "kind", "S"), ("block_size", "block_size", "I"),
                 ("window", "window", "I"), ("align", "align", "I"), ("retention", "retention", "I")],
    "evict": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("block_hash", "block_hash", "H"),
              ("request", "request", "S"), ("group", "grp", "I")],
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
    "token_causes": [("engine_pid", "pid", "I"), ("request", "request", "S"), ("attempt", "attempt", "I"),
                     ("step", "step", "I"), ("token_start", "seg_start", "I"), ("token_end", "seg_end", "I"),
                     ("tokens", "tokens", "I"), ("cause", "cause", "S"), ("block_hash", "block_hash", "H"),
                     ("evicted_by", "evicted_by", "S"), ("distance_blocks", "distance_blocks", "I"),
                     ("distance_ns", "distance_ns", "I"), ("other_engine", "other_engine", "I"),
                     ("elsewhere", "elsewhere", "I")],
    # the servers a capture traced (several: a fleet's replicas), pid -> server (its port)
    # prefill/decode pairs (kvtrace.correlate.pd): both sides, the KV handed over, TTFT's parts
    "handovers": [(c, c, t) for c, t in (
        ("d_pid", "I"), ("d_request", "S"), ("p_host", "S"), ("p_pid", "I"), ("p_request", "S"), ("how", "S"),
        ("connector", "S"), ("p_blocks", "I"), ("p_bytes", "I"), ("d_blocks", "I"), ("d_bytes", "I"),
        ("d_transport_calls", "I"), ("d_transport_bytes", "I"), ("clock_shift_ns", "I"), ("clock_error_ns", "I"), ("queue_ns", "I"), ("prefill_ns", "I"),
        ("handoff_ns", "I"), ("pull_ns", "I"), ("first_decode_ns", "I"), ("ttft_ns", "I"))],
    "servers": [("server", "server", "I"), ("pid", "pid", "I"), ("role", "role", "S"), ("kind", "kind", "S")],
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
    # built here from the dataset (server_metrics below), not read from files by the engines
    "server_metrics": [("kind", "kind", "S"), ("ts_ns", "ts_ns", "I"), ("name", "name", "S"),
                       ("labels", "labels", "S"), ("value", "value", "F"), ("server", "server", "I")],
    "engine": [("pid", "pid", "I"), ("name", "name", "S"), ("version", "version", "S"), ("block_size", "block_size", "I")],
    # a KV connector as the scheduler sees it (kvtrace.analysis.connector)
    "kv_alloc": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                 ("first", "tok_first", "I"), ("external", "ext_tokens", "I"), ("blocks", "blocks", "I"),
                 ("nbytes", "nbytes", "I"), ("async", "is_async", "I"), ("connector", "connector", "S")],
    "kv_done": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                ("direction", "direction", "S"), ("ok", "ok", "I"), ("connector", "connector", "S")],
    "kv_finish": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                  ("blocks", "blocks", "I"), ("nbytes", "nbytes", "I"), ("delay_free", "delay_free", "I"),
                  ("connector", "connector", "S")],
    "kv_invalid": [("pid", "pid", "I"), ("step", "step", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                   ("blocks", "blocks", "I"), ("connector", "connector", "S")],
    # a KV tier's own server (the hook inside it) and the tier servers attach found (kvtrace.analysis.tier)
    "tier_lookup": [("pid", "pid", "I"), ("t_ns", "t_ns", "I"), ("request", "request", "S"),
                    ("chunks", "n_chunks", "I"), ("l1", "l1_hits", "I"), ("l2", "l2_hits", "I"),
                    ("l2_chunks", "l2_idx", "HL"), ("tier", "tier", "S")],
    "tier_op": [("pid", "pid", "I"), ("t_start_ns", "t_start_ns", "I"), ("t_end_ns", "t_end_ns", "I"),
                ("request", "request", "S"), ("op", "op", "S"), ("keys", "n_keys", "I"), ("num_tokens", "num_tokens", "I"),
                ("nbytes", "nbytes", "I"), ("ok", "ok", "I"), ("tier", "tier", "S")],
    "tiers": [("ts_ns", "ts_ns", "I"), ("kind", "kind", "S"), ("pid", "pid", "I"), ("port", "port", "I"),
              ("connector", "connector", "S"), ("version", "version", "S"), ("storage", "storage", "S"),
              ("chunk_tokens", "chunk_tokens", "I")],
    "spec_step": [("pid", "pid", "I"), ("step", "step", "I"), ("drafts", "drafts", "I"), ("accepted", "accepted", "I"),
                  ("kept", "kept", "I"), ("generated", "generated", "I")],
    "spec_req": [("pid", "pid", "I"), ("request", "request", "S"), ("drafts", "drafts", "I"),
                 ("accepted", "accepted", "I"), ("output_tokens", "output_tokens", "I")],
    "file_map": [("pid", "pid", "I"), ("op", "op", "S"), ("dev_major", "dev_major", "I"), ("dev_minor", "dev_minor", "I"),
                 ("ino", "ino", "I"), ("pages", "pages", "I")],
}
HOOK_TABLES = ("step", "chunk", "admit", "evict", "preempt", "kv_load", "kv_store", "arrive", "finish", "prompt_blocks",
               "kv_alloc", "kv_done", "kv_finish", "kv_invalid", "tier_lookup", "tier_op", "spec_step", "spec_req")
# Without these there is nothing of vLLM to analyse.
REQUIRED = ("step", "chunk", "admit")


@dataclass
class Inputs:
    root: Path
    files: dict[str, list[Path]] = field(default_factory=dict)       # usable files per table
    present: dict[str, set[str]] = field(default_factory=dict)       # columns found per table
    gaps: list[str] = field(default_factory=list)                    # what is missing and why
    rows: dict[str, int] = field(default_factory=dict)
    ds: Dataset | None = None                                        # the reader that listed them

    def has(self, table: str) -> bool:
        return bool(self.files.get(table))


def scan(root) -> Inputs:
    """The files of the tables the analysis uses, from kvtrace.dataset (which lists them, checks
    their versions and leaves out unreadable ones); raise DatasetError when nothing usable is left."""
    ds = Dataset.open(root, defer=True)
    inp = Inputs(Path(root), gaps=list(ds.problems), ds=ds)
    for name in (*COLUMNS, *schema.V1_METRICS_TABLES):
        if ds.files(name):
            inp.files[name] = ds.files(name)
            inp.present[name] = ds.columns(name)
    _drop_keyless(inp)
    _require(inp, ds)
    ds.go_on()
    for t in ("arrive", "prompt_blocks", "kv_load", "evict", "token_causes"):
        if not inp.has(t):
            inp.gaps.append(GAP_TEXT[t])
    return inp


def _drop_keyless(inp: Inputs) -> None:
    """Leave out a table without the columns its rows are keyed on."""
    for name, cols in COLUMNS.items():
        if not inp.has(name):
            continue
        key = [c for c, _, _ in cols if c in ("request", "step", "t_ns", "ts_ns", "t_start_ns")]
        missing = [c for c in key if c not in inp.present[name]]
        if missing:
            inp.gaps.append(f"table {name} has no column {', '.join(missing)} ({inp.files[name][0]}); it is left out")
            inp.files.pop(name)


def _require(inp: Inputs, ds: Dataset) -> None:
    """DatasetError unless the hook tables the analysis cannot do without are there."""
    lacking = [t for t in REQUIRED if not inp.has(t)]
    if not lacking:
        return
    unreadable = [f"{s.path}: {s.why}" for s in ds.skipped if s.table in lacking]
    if unreadable:
        raise DatasetError(f"no readable {', '.join(lacking)} table left in {inp.root}: {'; '.join(unreadable)}")
    hook = [t for t in HOOK_TABLES if inp.has(t)]
    kernel = [t for t in ds.names() if t not in HOOK_TABLES]
    what = f"only kernel tables ({', '.join(kernel)})" if kernel and not hook else f"tables {', '.join(hook) or 'none'}"
    raise DatasetError(
        f"{inp.root} has no hook records in table {', '.join(lacking)} ({what}): KV reuse, chunk timing and "
        "service figures need the kvtrace hook inside the engine (kvtrace attach to a vLLM or SGLang server)")


GAP_TEXT = {
    "arrive": "no arrive records: queueing before a request's first chunk and TTFT start at its first step, not its arrival",
    "prompt_blocks": "no prompt_blocks records: in-flight sharing, eviction re-references and whatif need prompt block hashes (hook 12+)",
    "token_causes": "no token_causes table: the miss causes come from `kvtrace correlate DIR` (a clean stop of attach runs it)",
    "kv_load": "no kv_load records: storage wait is 0 and reload cost unknown (no KV connector, or it was not traced)",
    "evict": "no evict records: no eviction seen (cache never full) or the hook's evict wrapper was off",
}


def read_table(inp: Inputs, name: str) -> pa.Table:
    """One table through kvtrace.dataset (for whatif); a file whose pages cannot be read is left out and said."""
    if not inp.files.get(name):
        return pa.table({})
    return inp.ds.table(name, paths=inp.files[name], partitions=False)


def find_unreadable(inp: Inputs) -> list[tuple[str, Path, str]]:
    """Files whose data pages cannot be decoded (a footer can be fine while a page is corrupt)."""
    bad = []
    for name, paths in inp.files.items():
        for path in paths:
            if inp.ds.read(path, partitions=False) is None:
                bad.append((name, path, inp.ds.why(path)))
    return bad


# The run row names the server from this version on; older runs are read by the rules of
# _kinds_before (docs/schema.md, "Datasets of version 1").
STATED_SINCE = 2
# Hooks before version 5 sent no engine record, and ran only in vLLM.
KIND_WITHOUT_ENGINE_RECORD = "vllm"


def server_kinds(inp: Inputs) -> list[str]:
    """The server kinds (kvtrace.servers.registry names) the dataset's runs recorded, sorted;
    empty when none says.  The one place analysis learns the kind of server recorded: the run
    row's ``server_kind``, which discovery gave; for a run whose attach found no server (a
    server kvtrace started, ``attach -- CMD``), the kind its hook's engine records name; for a
    run written before the run row named it, _kinds_before.  A kind this kvtrace does not know:
    UnknownServerKind (exit 6)."""
    versions = inp.ds.run_versions()
    stated = {r["run"]: r.get("server_kind") for r in inp.ds.runs()}
    current = [run for run, v in versions.items() if v >= STATED_SINCE]
    kinds = {stated.get(run) for run in current}
    unstated = [run for run in current if not stated.get(run)]
    if unstated:
        named = _hook_kinds(inp)
        kinds |= {k for run in unstated for k in named.get(run, ())}
    kinds |= _kinds_before(inp, sorted(run for run, v in versions.items() if v < STATED_SINCE))
    return sorted(registry.kind(k).name for k in kinds if k)


def _hook_kinds(inp: Inputs) -> dict[str, set[str]]:
    """run -> the kinds its hook's engine records name."""
    engine = read_table(inp, "engine") if inp.has("engine") else pa.table({})
    named: dict[str, set[str]] = {}
    for run, name in zip(_strings(engine, "run"), _strings(engine, "name")):
        if name:
            named.setdefault(run, set()).add(name)
    return named


def _kinds_before(inp: Inputs, runs: list[str]) -> set[str]:
    """The kinds of runs whose run row does not name one: the names in the hook's engine records
    (without any, a run with hook records is vLLM's: KIND_WITHOUT_ENGINE_RECORD), and the kind
    of each per-kind metrics table the run has (schema.V1_METRICS_TABLES)."""
    if not runs:
        return set()
    named = _hook_kinds(inp)
    kinds = set()
    for run in runs:
        kinds |= named.get(run) or ({KIND_WITHOUT_ENGINE_RECORD} if inp.ds.rows("step", run) else set())
        kinds |= {kind for table, kind in schema.V1_METRICS_TABLES.items() if inp.ds.rows(table, run)}
    return kinds


def _strings(t: pa.Table, column: str) -> list:
    return t.column(column).cast(pa.string()).to_pylist() if column in t.column_names else [None] * t.num_rows


METRICS = pa.schema([("run", pa.string()), ("kind", pa.string()), ("ts_ns", pa.uint64()), ("name", pa.string()),
                     ("labels", pa.string()), ("value", pa.float64()),
                     ("server", pa.uint32())])   # null: the run's one server (a capture of several tags each sample)


def server_metrics(inp: Inputs) -> pa.Table:
    """Every scraped /metrics sample of every run, in one table (METRICS: run, kind, ts_ns, name,
    labels, value); no rows when none was scraped.  The samples of the server_metrics table, and
    for runs written before it each per-kind table's (schema.V1_METRICS_TABLES), their kind the
    table's.  A kind this kvtrace does not know: UnknownServerKind (exit 6)."""
    parts = [_metrics(read_table(inp, "server_metrics"), None)] if inp.has("server_metrics") else []
    parts += [_metrics(read_table(inp, table), kind) for table, kind in schema.V1_METRICS_TABLES.items()
              if inp.has(table)]
    out = pa.concat_tables(parts) if parts else METRICS.empty_table()
    for k in set(out.column("kind").to_pylist()) - {None}:
        registry.kind(k)
    return out


def _metrics(t: pa.Table, kind: str | None) -> pa.Table:
    """t's rows in METRICS' columns; the kind column ``kind`` when given."""
    cols = []
    for f in METRICS:
        if f.name == "kind" and kind is not None:
            cols.append(pa.array([kind] * t.num_rows, f.type))
        elif f.name in t.column_names:
            cols.append(t.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.table(cols, schema=METRICS)


# Tables the engines are given as built here, not as the dataset's files.
BUILT = {"server_metrics": server_metrics}
