"""The Parquet dataset: round trip, crash safety (parts without compaction), corrupt files,
schema versions, file modes.  No root."""
from __future__ import annotations

import json
import os
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.errors import DatasetError, OutputError


def rows(n, start=0):
    text = lambda f: pa.types.is_string(f.type) or pa.types.is_dictionary(f.type)
    t = {f.name: pa.array(["x"] * n).cast(f.type) if text(f) else pa.array([0] * n, f.type) for f in schema.TABLES["file_io"]}
    t["ts_ns"] = pa.array(range(start, start + n), pa.uint64())
    t["bytes"] = pa.array([4096] * n, pa.uint64())
    return pa.table(t, schema=schema.TABLES["file_io"])


def run_row(**kw):
    r = {"run": "r1", "status": "running", "schema_version": schema.SCHEMA_VERSION, "kvtrace_version": "t",
         "kernel": "k", "start_ns": 1, "stop_ns": 2, "clock_offset_ns": 3, "start_wall": "w", "pids": [1],
         "command": "", "probes_attached": ["fileio"], "probes_skipped": "{}", "events": "{}",
         "lost_events": json.dumps({"file_io": 2}), "dropped_events": 0}
    r.update(kw)
    return r


def test_round_trip_with_partitions_and_compaction(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "hostA")
    for i in range(3):
        w.add("file_io", rows(10, i * 10))
        w.flush(run_row())
    assert len(w.parts["file_io"]) == 3
    w.compact()
    files = list((tmp_path / "file_io").rglob("*.parquet"))
    assert len(files) == 1 and files[0].parent.parent.name == "host=hostA"
    ds = Dataset.open(tmp_path)
    t = ds.table("file_io")
    assert t["ts_ns"].to_pylist() == list(range(30))
    assert set(t["host"].to_pylist()) == {"hostA"} and set(t["run"].cast(pa.string()).to_pylist()) == {"r1"}
    assert ds.runs()[0]["lost_events"] == {"file_io": 2}


def codecs(path) -> set[str]:
    md = pq.ParquetFile(path).metadata
    return {md.row_group(g).column(c).compression for g in range(md.num_row_groups) for c in range(md.num_columns)}


def test_parts_are_cheap_to_write_and_compaction_writes_zstd(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "h")
    for i in range(2):
        w.add("file_io", rows(10, i * 10))
        w.flush(run_row())
    parts = list(w.parts["file_io"])
    assert [codecs(p) for p in parts] == [{"LZ4"}, {"LZ4"}]
    assert all(not pq.ParquetFile(p).metadata.row_group(0).column(0).has_dictionary_page for p in parts)
    assert codecs(next((tmp_path / "runs").rglob("*.parquet"))) == {"ZSTD"}
    w.compact()
    (merged,) = (tmp_path / "file_io").rglob("*.parquet")
    assert codecs(merged) == {"ZSTD"} and not any(p.exists() for p in parts)
    assert Dataset.open(tmp_path).table("file_io")["ts_ns"].to_pylist() == list(range(20))


def test_parts_left_by_a_crash_read_back_and_a_torn_file_is_named(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "h")
    w.add("file_io", rows(5))
    w.flush(run_row())
    w.add("file_io", rows(5, 5))
    w.flush(run_row())
    # the process dies here: no compaction; a half-written temp file and a torn part remain
    part = w.parts["file_io"][0]
    (part.parent / ".r1-p000003.parquet.tmp").write_bytes(b"PAR1garbage")
    torn = part.parent / "r1-p000009.parquet"
    torn.write_bytes(part.read_bytes()[:50])
    ds = Dataset.open(tmp_path)
    t = ds.table("file_io")
    assert t.num_rows == 10
    assert len(ds.problems) == 1 and "r1-p000009.parquet" in ds.problems[0]


def test_files_are_private(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "h")
    w.add("file_io", rows(1))
    w.flush(run_row())
    for p in tmp_path.rglob("*.parquet"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_other_schema_version_is_refused_by_name(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "h")
    w.flush(run_row())
    (runs,) = (tmp_path / "runs").rglob("*.parquet")
    t = pq.read_table(runs)
    meta = json.loads(t.schema.metadata[schema.META_KEY])
    meta["schema_version"] = 99
    pq.write_table(t.replace_schema_metadata({schema.META_KEY: json.dumps(meta).encode()}), runs)
    with pytest.raises(DatasetError, match="schema version 99"):
        Dataset.open(tmp_path)


def test_a_table_file_of_another_or_no_schema_version_is_refused_by_name(tmp_path):
    w = DatasetWriter(tmp_path, "r1", "h")
    w.add("file_io", rows(3))
    w.flush(run_row())
    (part,) = (tmp_path / "file_io").rglob("*.parquet")
    t = pq.read_table(part)
    pq.write_table(t.replace_schema_metadata(None), part)
    with pytest.raises(DatasetError, match=f"^{part} has no kvtrace schema version"):
        Dataset.open(tmp_path)
    meta = {"schema_version": 99, "kvtrace_version": "t", "run": "r1", "table": "file_io"}
    pq.write_table(t.replace_schema_metadata({schema.META_KEY: json.dumps(meta).encode()}), part)
    with pytest.raises(DatasetError, match=f"^{part} has schema version 99; this kvtrace reads versions 1 and 2 "
                                           r"\(the dataset mixes versions"):
        Dataset.open(tmp_path)


def test_missing_and_empty_directories(tmp_path):
    with pytest.raises(DatasetError, match="no dataset"):
        Dataset.open(tmp_path / "nope")
    with pytest.raises(DatasetError, match="is an empty dataset: no kvtrace tables"):
        Dataset.open(tmp_path)
    (tmp_path / "file_io" / "host=h").mkdir(parents=True)
    with pytest.raises(DatasetError, match="is an empty dataset"):
        Dataset.open(tmp_path)


def test_unwritable_output_is_an_output_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create output directory"):
        DatasetWriter(tmp_path / "file" / "sub", "r1", "h")


def test_duckdb_reads_the_dataset_as_is(tmp_path):
    import duckdb

    w = DatasetWriter(tmp_path, "r1", "h1")
    w.add("file_io", rows(4))
    w.flush(run_row())
    w2 = DatasetWriter(tmp_path, "r2", "h2")
    w2.add("file_io", rows(6))
    w2.flush(run_row(run="r2"))
    q = f"select host, count(*), sum(bytes) from read_parquet('{tmp_path}/file_io/*/*/*.parquet', hive_partitioning=true) group by host order by host"
    assert duckdb.sql(q).fetchall() == [("h1", 4, 16384), ("h2", 6, 24576)]
