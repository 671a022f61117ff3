"""One reader, one rule: the same bad dataset gets the same answer from every command that reads
a dataset (summary, correlate, analyze, export, whatif), and `kvtrace correlate` never replaces
derived tables by fewer rows without saying so (docs/schema.md, "Reading a dataset").  No root.
"""
from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.errors import DatasetError, OutputError

from . import analysis_fixture as fx

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
DEAD = "http://127.0.0.1:4498"  # nothing is sent: the dataset is refused first


def kvtrace(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def commands(root: Path, url: str = DEAD) -> dict[str, list]:
    return {"summary": ["summary", root], "correlate": ["correlate", root], "analyze": ["analyze", root],
            "export": ["export", root, "--otlp", url, "--timeout", "2"], "whatif": ["whatif", root]}


def lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return fx.build(tmp_path_factory.mktemp("one") / "good")


def copy(good: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def strip_version(path: Path) -> None:
    pq.write_table(pq.read_table(path).replace_schema_metadata(None), path)


def set_version(path: Path, version: int) -> None:
    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[schema.META_KEY])
    meta["schema_version"] = version
    pq.write_table(t.replace_schema_metadata({schema.META_KEY: json.dumps(meta).encode()}), path)


def first(root: Path, table: str) -> Path:
    return next((root / table).rglob("*.parquet"))


def bad_datasets(good: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (dataset, what its one error line must say)."""
    out = {"missing dir": (tmp_path / "nope", "no dataset at")}
    (tmp_path / "empty").mkdir()
    out["empty dir"] = (tmp_path / "empty", "is an empty dataset")
    (tmp_path / "empty-tables" / "step" / "host=h1").mkdir(parents=True)
    out["empty table dirs"] = (tmp_path / "empty-tables", "is an empty dataset")
    nov = copy(good, tmp_path, "nov")
    strip_version(first(nov, "block_io"))
    out["missing schema_version"] = (nov, f"{first(nov, 'block_io')} has no kvtrace schema version")
    v99 = copy(good, tmp_path, "v99")
    set_version(first(v99, "step"), 99)  # a table file, not the runs table: summary read it before
    out["version 99"] = (v99, f"{first(v99, 'step')} has schema version 99; this kvtrace reads versions 1 and 2")
    torn = copy(good, tmp_path, "torn")
    for f in (torn).rglob("*.parquet"):
        f.write_bytes(f.read_bytes()[:60])
    out["every file torn"] = (torn, "none of the")
    return out


def test_the_same_bad_dataset_gets_the_same_one_line_error_from_every_command(good, tmp_path):
    for case, (root, says) in bad_datasets(good, tmp_path).items():
        got = {}
        for name, args in commands(root).items():
            r = kvtrace(*args)
            assert r.returncode == 6, (case, name, r.returncode, r.stderr[-2000:])
            assert "Traceback" not in r.stderr and len(lines(r)) == 1, (case, name, r.stderr)
            got[name] = lines(r)[0]
        assert len(set(got.values())) == 1, (case, got)  # the very same line from all five
        line = got["summary"]
        assert line.startswith("kvtrace: ") and says in line, (case, line)


def test_a_torn_file_is_left_out_with_one_warning_by_every_command(good, tmp_path):
    """A part torn by a crash: named once on stderr, the rest read, every command goes on."""
    from tests.otlp_receiver import Receiver

    root = copy(good, tmp_path, "torn1")
    torn = first(root, "kv_load")
    torn.write_bytes(torn.read_bytes()[:100])
    want = f"kvtrace: warning: {torn}: truncated or corrupt (no readable Parquet footer); its rows of kv_load are left out"
    with Receiver() as rx:
        for name, args in commands(root, rx.url("grpc")).items():
            r = kvtrace(*args)
            assert r.returncode == 0, (name, r.stderr[-2000:])
            assert "Traceback" not in r.stderr
            assert [line for line in lines(r) if "warning" in line and str(torn) in line] == [want], (name, r.stderr)
    ds = Dataset.open(root, warn=None)
    assert ds.table("step").num_rows == 12 and ds.problems == [want.removeprefix("kvtrace: warning: ")]


def test_summary_json_lists_what_was_left_out(good, tmp_path):
    root = copy(good, tmp_path, "torn2")
    torn = [first(root, "kv_load"), first(root, "evict")]
    for f in torn:
        f.write_bytes(b"PAR1 torn")
    r = kvtrace("summary", root, "--json")
    assert r.returncode == 0, r.stderr
    (warning,) = lines(r)
    assert warning.startswith("kvtrace: warning: 2 files of") and "(tables evict, kv_load)" in warning
    problems = json.loads(r.stdout)["problems"]
    assert [p.split(":")[0] for p in problems] == [str(torn[1]), str(torn[0])]
    assert json.loads(r.stdout)["tables"]["step"]["rows"] == 12


# ---------------------------------------------------------------------------------------------
# The reader itself


def test_reader_rule_in_process(good, tmp_path):
    said = []
    root = copy(good, tmp_path, "r")
    part = first(root, "block_io").with_name("r1-p000002.parquet")
    part.write_bytes(b"PAR1" + b"\0" * 40)
    ds = Dataset.open(root, warn=said.append, defer=True)
    assert said == []  # held back until the command goes on
    ds.go_on()
    assert len(said) == 1 and str(part) in said[0] and ds.table("block_io").num_rows == 4
    assert ds.files("step", run="r1", host="h1") == [first(root, "step")]
    assert ds.files("step", run="r2") == [] and ds.files("step", host="h2") == []
    assert ds.rows("step") == 12 and "t_start_ns" in ds.columns("step")
    assert {"host", "date"} <= set(ds.table("step").column_names)
    assert "host" not in ds.table("step", partitions=False).column_names
    with pytest.raises(DatasetError, match="is not a directory"):
        Dataset.open(first(root, "step"))


def test_a_corrupt_page_is_left_out_when_read(good, tmp_path):
    root = copy(good, tmp_path, "page")
    f = first(root, "evict")
    data = bytearray(f.read_bytes())
    for i in range(8, 120):  # the first data page; the footer stays readable
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))
    said = []
    ds = Dataset.open(root, warn=said.append)
    assert said == [] and ds.files("evict") == [f]
    assert ds.table("evict").num_rows == 0 and ds.files("evict") == []
    assert len(said) == 1 and str(f) in said[0] and "corrupt" in said[0]
    ds.table("evict")
    assert len(said) == 1  # said once


# ---------------------------------------------------------------------------------------------
# correlate: derived tables are never replaced by fewer rows without saying so


def derived_rows(root: Path) -> dict[str, int]:
    ds = Dataset.open(root, warn=None)
    return {n: ds.rows(n) for n in ("requests", "chunks", "steps", "attributions")}


def test_correlate_refuses_to_shrink_derived_tables_unless_forced(good, tmp_path):
    root = copy(good, tmp_path, "c")
    r = kvtrace("correlate", root, "--json")
    assert r.returncode == 0, r.stderr
    before = derived_rows(root)
    assert before["chunks"] == 10 and before["steps"] == 12
    r = kvtrace("correlate", root)  # the same rows again: fine
    assert r.returncode == 0 and lines(r) == ["kvtrace: run r1 (h1): 6 requests, 10 chunks, 12 steps, 12 attributions, 20 token_causes"]
    for t in ("step", "chunk", "admit"):
        shutil.rmtree(root / t)
    r = kvtrace("correlate", root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = lines(r)
    assert line == ("kvtrace: not replacing the derived tables of run r1 (h1) by fewer rows: chunks 10 -> 0, "
                    "steps 12 -> 0, token_causes 20 -> 0 (no readable step, chunk, admit records of the run); nothing written "
                    "(give --force to replace them)")
    assert derived_rows(root) == before
    r = kvtrace("correlate", root, "--force")
    assert r.returncode == 0, r.stderr
    assert lines(r)[0] == ("kvtrace: warning: --force: replacing the derived tables of run r1 (h1) by fewer rows: "
                           "chunks 10 -> 0, steps 12 -> 0, token_causes 20 -> 0 (no readable step, chunk, admit records of the run)")
    assert derived_rows(root)["chunks"] == 0 and derived_rows(root)["steps"] == 0


def test_a_torn_input_does_not_shrink_derived_tables_silently(good, tmp_path):
    root = copy(good, tmp_path, "c2")
    assert kvtrace("correlate", root).returncode == 0
    torn = first(root, "kv_load")
    torn.write_bytes(torn.read_bytes()[:100])
    r = kvtrace("correlate", root)
    (line,) = lines(r)
    assert r.returncode == 2 and "attributions 12 -> 11" in line and f"unreadable, left out: {torn}" in line


def test_export_does_not_write_and_does_not_refuse(good, tmp_path):
    from kvtrace.correlate.derive import correlate_dataset

    root = copy(good, tmp_path, "c3")
    assert kvtrace("correlate", root).returncode == 0
    for t in ("step", "chunk", "admit"):
        shutil.rmtree(root / t)
    (rc, written), = correlate_dataset(root, write=False)
    assert written == {} and rc.result.chunks.num_rows == 0 and derived_rows(root)["chunks"] == 10


def test_correlate_disk_full_speaks_of_correlate(good, tmp_path, monkeypatch):
    from kvtrace.correlate.derive import correlate_dataset
    from kvtrace.dataset import writer

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    root = copy(good, tmp_path, "full")
    monkeypatch.setattr(writer.pq, "write_table", full)
    with pytest.raises(OutputError) as e:
        correlate_dataset(root)
    msg = str(e.value)
    assert e.value.exit_code == 5 and "output disk full writing" in msg and "kvtrace correlate stopped" in msg
    assert "capture" not in msg and "\n" not in msg
