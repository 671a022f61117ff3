"""A fleet dataset of many hosts, synthesised for scale from one real run.

``replicate(src, dst, hosts)`` copies one recorded dataset (tests/data/recorded/fleet-router: one
`kvtrace attach` tracing two vLLM replicas behind vllm-router) into ``hosts`` host partitions
``host=h000 ...``, so that the result looks like ``hosts`` agents, each tracing its own pair of
replicas.  Nothing in it was measured on those hosts: every copy is the same real run, rewritten
so that the copies do not collide, consistently in every table (the derived ones and ``runs``
too):

- a run id of its own: the recorded run's start time and a 6-hex suffix numbering the copy
  (``20261207T202924-00000c``), in the ``run`` column, the file names and the files' kvtrace
  metadata, and wherever the runs row's text names it;
- pids of their own: every pid/tid column (``pid``, ``tid``, ``api_pid``, ``engine_pid``,
  ``other_engine``, ``child_pid``, ...; 0 stays 0: "none"), the runs row's ``pids`` and the
  pids its JSON columns name, moved by ``copy * 2**22`` (above Linux's largest pid_max, so no
  copy's pid is another's);
- server ports of their own per host: the ``server`` column (servers, kv_events,
  server_metrics) and the ports the runs row's JSON names, moved by ``host * span`` (span: the
  recorded ports' range), so a port names one replica in the whole dataset (the fleet report
  tells servers apart by run and port, so it would tell them apart without this too).

Timestamps, request ids, block hashes and every other value are kept: each copy is the recorded
run as its own agent saw it, and the figures of a copy are the recorded run's.  (A table that
names another run, a prefill/decode pair's ``p_run``, is not rewritten: the recorded fleet has
none.)

``runs_per_host`` > 1 puts that many copies of the run in each host partition (one host's
requests multiplied: the same two replicas recorded again, each copy with its own run id and
pids, the host's ports).

    python -m tests.fleet.synth SRC DST --hosts 8 [--runs-per-host 1]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvtrace.dataset import schema
from kvtrace.dataset.copies import run_of

PID_STRIDE = 1 << 22       # Linux's PID_MAX_LIMIT: a pid is below it
PID_COLUMNS = {"pid", "tid", "api_pid", "engine_pid", "other_engine", "child_pid", "setup_tid", "complete_tid",
               "d_pid", "p_pid"}
PORT_COLUMNS = {"server"}  # the server's port (kv_events, server_metrics, servers)
# In the runs row's JSON text (sidecars ...): keys whose integer is a pid, or a server's port
PID_KEYS = {"pid", "api_pid", "engine_pid", "pids"}
PORT_KEYS = {"port", "server"}
WRITE = {"compression": "zstd"}  # as kvtrace.dataset.writer writes a finished file


def _files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*.parquet") if not p.name.startswith((".", "_")))


def source_run(src: Path) -> tuple[str, list[int]]:
    """The one run of ``src`` and its servers' ports (sorted); ValueError unless it holds one run."""
    runs = {run_of(p) for p in _files(src)}
    if len(runs) != 1:
        raise ValueError(f"{src}: one run expected, found {sorted(runs) or 'none'}")
    ports: set[int] = set()
    for p in (src / "servers").rglob("*.parquet"):
        ports |= {v for v in pq.read_table(p, columns=["server"]).column("server").to_pylist() if v}
    return runs.pop(), sorted(ports)


def run_id(run: str, copy: int) -> str:
    """The copy's run id: the recorded run's start time, the copy's number as the 6-hex suffix."""
    return f"{run.rsplit('-', 1)[0]}-{copy:06x}"


class Copy:
    """How one copy rewrites values: its run id, pid offset and port map."""

    def __init__(self, run: str, ports: list[int], host: int, copy: int):
        self.old_run, self.run = run, run_id(run, copy)
        self.pid_off = copy * PID_STRIDE
        span = (max(ports) - min(ports) + 1) if ports else 0
        self.ports = {p: p + host * span for p in ports}
        if self.ports and max(self.ports.values()) > 65535:
            raise ValueError(f"host {host}: ports past 65535 ({max(self.ports.values())})")

    def pid(self, v):
        return v + self.pid_off if v else v

    def port(self, v):
        return self.ports.get(v, v) if v else v

    def text(self, s: str) -> str:
        """A runs-row JSON text (its pids and ports by key; URLs' ports) with the run id replaced."""
        try:
            obj = json.loads(s)
        except ValueError:
            obj = None
        if isinstance(obj, (dict, list)):
            s = json.dumps(self._walk(obj, None))
        for old, new in self.ports.items():
            s = re.sub(rf":{old}(?!\d)", f":{new}", s)
        return s.replace(self.old_run, self.run)

    def _walk(self, o, key):
        if isinstance(o, dict):
            return {k: self._walk(v, k) for k, v in o.items()}
        if isinstance(o, list):
            return [self._walk(v, key) for v in o]
        if isinstance(o, int) and not isinstance(o, bool):
            return self.pid(o) if key in PID_KEYS else self.port(o) if key in PORT_KEYS else o
        if isinstance(o, str):
            return self.text(o) if o[:1] in "[{" else o
        return o

    def table(self, t: pa.Table) -> pa.Table:
        cols = []
        for f, col in zip(t.schema, t.columns):
            cols.append(self._column(f, col))
        md = dict(t.schema.metadata or {})
        if schema.META_KEY in md:
            meta = json.loads(md[schema.META_KEY])
            if meta.get("run") == self.old_run:
                meta["run"] = self.run
            md[schema.META_KEY] = json.dumps(meta).encode()
        return pa.Table.from_arrays(cols, schema=t.schema).replace_schema_metadata(md)

    def _column(self, f: pa.Field, col: pa.ChunkedArray) -> pa.ChunkedArray:
        name, typ = f.name, f.type
        if name == "run":
            if col.null_count == 0 and pc.all(pc.equal(col.cast(pa.string()), self.old_run)).as_py() is not False:
                return _constant(self.run, len(col), typ)
            vals = [None if v is None else self.run if v == self.old_run else v for v in col.to_pylist()]
        elif name in PID_COLUMNS and pa.types.is_integer(typ):
            if not self.pid_off:
                return col
            moved = pc.add_checked(col.cast(pa.int64()), self.pid_off).cast(typ)   # past the type: an error
            return pc.if_else(pc.equal(col, 0), col, moved)
        elif name in PORT_COLUMNS and pa.types.is_integer(typ):
            out = col
            for old, new in self.ports.items():
                if old != new:
                    out = pc.if_else(pc.equal(col, old), pa.scalar(new, typ), out)
            return out
        elif name == "pids" and pa.types.is_list(typ):
            vals = [None if v is None else [self.pid(x) for x in v] for v in col.to_pylist()]
        elif pa.types.is_string(typ) and name in RUNS_TEXT:
            vals = [None if v is None else self.text(v) for v in col.to_pylist()]
        else:
            return col
        if pa.types.is_dictionary(typ):
            return pa.chunked_array([pa.array(vals, typ.value_type).dictionary_encode().cast(typ)])
        return pa.chunked_array([pa.array(vals, typ)])


def _constant(v: str, n: int, typ: pa.DataType) -> pa.ChunkedArray:
    """n times the text v, as a column of type typ (text, or dictionary-encoded text)."""
    if pa.types.is_dictionary(typ):
        return pa.chunked_array([pa.DictionaryArray.from_arrays(pa.array([0] * n, typ.index_type),
                                                                pa.array([v], typ.value_type))], typ)
    return pa.chunked_array([pa.array([v] * n, typ)], typ)


# The runs row's text columns that name pids, ports or the run (JSON or plain text)
RUNS_TEXT = {"command", "probes_skipped", "events", "lost_events", "sidecars", "sinks", "sampling", "kernel_skips"}


def replicate(src: Path, dst: Path, hosts: int, runs_per_host: int = 1) -> None:
    """``dst`` (made anew) holds ``hosts`` × ``runs_per_host`` copies of the one run in ``src``,
    in partitions ``host=h000 ...`` (the date partition kept), each copy rewritten as the module
    docstring says."""
    src, dst = Path(src), Path(dst)
    if hosts < 1 or runs_per_host < 1:
        raise ValueError("hosts and runs_per_host must be 1 or more")
    if (hosts * runs_per_host) * PID_STRIDE + PID_STRIDE > 1 << 32:
        raise ValueError(f"at most {(1 << 32) // PID_STRIDE - 1} copies (pids are 32-bit)")
    run, ports = source_run(src)
    files = [(p, p.relative_to(src), pq.read_table(p)) for p in _files(src)]
    if dst.exists():
        shutil.rmtree(dst)
    for h in range(hosts):
        for r in range(runs_per_host):
            c = Copy(run, ports, h, h * runs_per_host + r)
            for _, rel, t in files:
                parts = [f"host=h{h:03d}" if x.startswith("host=") else x for x in rel.parts[:-1]]
                out = dst.joinpath(*parts, rel.name.replace(run, c.run, 1))
                out.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(c.table(t), out, **WRITE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fleet.synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a dataset of one run (e.g. tests/data/recorded/fleet-router)")
    ap.add_argument("dst", type=Path, help="the dataset to make (replaced if it exists)")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--runs-per-host", type=int, default=1)
    a = ap.parse_args(argv)
    replicate(a.src, a.dst, a.hosts, a.runs_per_host)
    n = sum(1 for _ in a.dst.rglob("*.parquet"))
    print(f"{a.dst}: {a.hosts} hosts x {a.runs_per_host} runs of {a.src} ({n} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
