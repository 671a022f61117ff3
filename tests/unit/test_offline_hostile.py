"""Hostile and broken input to the offline commands (summary, analyze, whatif, export, correlate,
compare): one line and a documented exit, never a traceback, never a hang (docs/schema.md,
"Reading a dataset"; README's exit codes).  No root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset
from kvtrace.dataset.writer import DatasetWriter
from kvtrace.errors import DatasetError, OutputError

from . import analysis_fixture as fx

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
DEAD = "http://127.0.0.1:4498"  # nothing is sent: the dataset is refused first


def kvtrace(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([PY, "-m", "kvtrace", *map(str, args)], stderr=subprocess.PIPE, text=True,
                          timeout=timeout, cwd=REPO, **kw)


def one_line(r: subprocess.CompletedProcess, code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def readers(root: Path) -> dict[str, list]:
    return {"summary": ["summary", root], "analyze": ["analyze", root], "whatif": ["whatif", root],
            "export": ["export", root, "--otlp", DEAD, "--timeout", "1"], "correlate": ["correlate", root]}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return fx.build(tmp_path_factory.mktemp("hostile") / "good")


def copy(good: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def part(root: Path, table: str, name: str = "r1") -> Path:
    return root / table / "host=h1" / "date=2026-11-30" / f"{name}.parquet"


# ---------------------------------------------------------------------------------------------
# 1. A FIFO (or a socket, a link) in place of a part file: left out with a warning, never waited on


def test_fifo_part_is_left_out_not_waited_on(good, tmp_path):
    root = copy(good, tmp_path, "fifo")
    fifo = part(root, "step", "r1-p000002")
    os.mkfifo(fifo)
    link = part(root, "chunk", "r1-p000003")
    link.symlink_to("/dev/zero")
    for cmd in ("summary", "analyze"):
        r = kvtrace(cmd, root, "--json", timeout=60)  # before the fix: blocked on the FIFO for ever
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert str(link) in r.stderr and "2 files" in r.stderr, r.stderr
    assert json.loads(r.stdout)["reuse"]["hit_local"] == 960  # the rest analysed as before
    said = json.loads(kvtrace("summary", root, "--json").stdout)["problems"]
    assert f"{fifo}: not a regular file (a FIFO); its rows of step are left out" in said
    assert any(str(link) in p and "symbolic link" in p for p in said)


def test_fifo_as_the_only_step_file_is_one_line(good, tmp_path):
    root = copy(good, tmp_path, "fifo1")
    part(root, "step").unlink()
    os.mkfifo(part(root, "step"))
    line = one_line(kvtrace("analyze", root, timeout=60), 6)
    assert str(part(root, "step")) in line and "not a regular file (a FIFO)" in line


# ---------------------------------------------------------------------------------------------
# 2. The output directory removed before compaction: exit 5, one line, nothing left on disk lost


def processes_rows(n: int) -> pa.Table:
    cols = {f.name: [i for i in range(n)] if pa.types.is_integer(f.type) else ["x"] * n
            for f in schema.TABLES["processes"]}
    return pa.table(cols)


def two_flushes(root: Path) -> DatasetWriter:
    w = DatasetWriter(root, "r1", "h1")
    for _ in range(2):
        w.add("processes", processes_rows(3))
        w.add("file_open", pa.table({f.name: [1] if pa.types.is_integer(f.type) else ["/x"]
                                     for f in schema.TABLES["file_open"]}))
        w.flush({"run": "r1", "status": "running", "start_ns": 0, "stop_ns": 1})
    return w


def test_compaction_of_a_removed_output_dir_is_exit_5(tmp_path):
    w = two_flushes(tmp_path / "out")
    shutil.rmtree(tmp_path / "out")
    with pytest.raises(OutputError) as e:
        w.compact()
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
    assert "was removed during the run" in str(e.value) and "4 part files of run r1" in str(e.value)


def test_compaction_keeps_what_is_still_on_disk(tmp_path):
    root = tmp_path / "out"
    w = two_flushes(root)
    shutil.rmtree(root / "processes")
    with pytest.raises(OutputError, match=r"2 part files of run r1 were removed from .* the rest is compacted") as e:
        w.compact()
    assert "kvtrace correlate" in str(e.value)
    ds = Dataset.open(root, warn=None)
    assert ds.table("file_open").num_rows == 2  # both parts' rows, in one compacted file
    assert [p.name for p in ds.files("file_open")] == ["r1.parquet"]


def test_a_merge_that_fails_keeps_its_parts(tmp_path):
    root = tmp_path / "out"
    w = two_flushes(root)
    torn = w.parts["processes"][1]
    torn.write_bytes(b"PAR1 torn")
    with pytest.raises(OutputError, match="cannot compact processes in .*; its part files stay readable"):
        w.compact()
    assert w.parts["processes"][0].exists() and torn.exists()
    assert Dataset.open(root, warn=None).table("file_open").num_rows == 2  # the other table compacted


# ---------------------------------------------------------------------------------------------
# 3. whatif: a grid above --max-combinations refused; its size and time said before the sweep


def values(start: int, n: int) -> str:
    return ",".join(str(start + i) for i in range(n))


def test_whatif_grid_over_the_limit_is_refused_before_reading(good, tmp_path):
    grid = ["--chunk-size", values(64, 100), "--cache-blocks", values(20, 100)]
    line = one_line(kvtrace("whatif", good, *grid, timeout=60), 2)  # before the fix: minutes of replays
    assert "10,000 combinations (100 --chunk-size × 100 --cache-blocks)" in line
    assert "more than --max-combinations 500" in line
    line = one_line(kvtrace("whatif", tmp_path / "none", *grid, timeout=60), 2)  # the dataset is not read
    assert "10,000 combinations" in line


def test_whatif_says_grid_size_and_estimate_and_option_raises_limit(good):
    grid = ["--chunk-size", values(64, 30), "--cache-blocks", values(20, 20)]
    r = kvtrace("whatif", good, *grid, "--max-combinations", "600", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(json.loads(r.stdout)["predictions"]) == 600
    said = r.stderr.splitlines()
    assert said[0] == "kvtrace: whatif: 600 combinations of 6 requests; timing the first for an estimate"
    assert said[1].startswith("kvtrace: whatif: the first combination took ") and "for the other 599" in said[1]


def test_whatif_run_limit_in_process(good):
    from kvtrace.analysis import whatif
    from kvtrace.errors import UsageError

    with pytest.raises(UsageError, match="6 combinations .* more than --max-combinations 5"):
        whatif.run(good, chunk_sizes=[64, 128, 256], cache_blocks=[20, 30], max_combinations=5)
    said = []
    res = whatif.run(good, chunk_sizes=[64, 128, 256], cache_blocks=[20, 30], max_combinations=6, say=said.append)
    assert len(res["predictions"]) == 6 and len(said) == 2 and "about" in said[1]


# ---------------------------------------------------------------------------------------------
# 4. Standard output to a full device: exit 5, one line; a closed pipe: quiet, exit 141


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_stdout_to_a_full_device_is_exit_5(good, tmp_path):
    ds = copy(good, tmp_path, "full")
    for args in (["summary", ds], ["summary", ds, "--json"], ["analyze", ds], ["analyze", ds, "--json"],
                 ["whatif", ds], ["compare", ds, ds], ["correlate", ds, "--json"], ["--help"]):
        with open("/dev/full", "w") as full:
            line = one_line(kvtrace(*args, stdout=full), 5)
        assert line == "kvtrace: cannot write the output to stdout: No space left on device; what was written " \
                       "before it stays", (args, line)


def test_a_closed_pipe_ends_quietly(good):
    for args in (["analyze", good], ["analyze", good, "--json"], ["summary", good, "--json"]):
        p = subprocess.Popen([PY, "-m", "kvtrace", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=REPO)
        p.stdout.close()  # before it prints anything: every write to it fails
        err = p.stderr.read().decode()
        assert p.wait(60) == 141 and "Traceback" not in err, (args, err)
        assert [line for line in err.splitlines() if "gap" not in line] == [], (args, err)


# ---------------------------------------------------------------------------------------------
# 5. Null, negative, wrongly typed and missing columns: exit 6 naming table and column, the same
# line from every command; names over the system's limits: one line too


def rewrite(path: Path, change) -> None:
    t = pq.read_table(path)
    pq.write_table(change(t).replace_schema_metadata(t.schema.metadata), path)


def set_column(name: str, make):
    return lambda t: t.set_column(t.column_names.index(name), name, make(t[name]))


def null_first(col):
    return pa.array([None] + col.to_pylist()[1:], col.type)


def negative_first(col):
    return pa.array([-5] + col.to_pylist()[1:], pa.int64())


def as_text(col):
    return pa.array([f"x{v}" for v in col.to_pylist()])


HOSTILE = {  # name -> (table, column, change, what the line says)
    "null t_ns": ("arrive", "t_ns", set_column("t_ns", null_first), "1 null value"),
    "negative t_ns": ("evict", "t_ns", set_column("t_ns", negative_first), "negative values (down to -5)"),
    "text in an int column": ("step", "t_start_ns", set_column("t_start_ns", as_text),
                              "text (string) where kvtrace writes integer (uint64)"),
    "missing column": ("admit", "prompt_len", lambda t: t.drop_columns(["prompt_len"]), "missing"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_column_is_one_line_from_every_command(good, tmp_path, case):
    table, column, change, says = HOSTILE[case]
    root = copy(good, tmp_path, "h")
    rewrite(part(root, table), change)
    got = {name: one_line(kvtrace(*args), 6) for name, args in readers(root).items()}
    assert len(set(got.values())) == 1, got  # the same line from all five
    line = got["analyze"]
    assert line.startswith(f"kvtrace: table {table}, column {column}: {says}") and str(part(root, table)) in line


def test_the_reader_knows_the_hook_tables_as_the_agent_stores_them():
    from kvtrace.capture.usermark import schema_for
    from kvtrace.hook.wire import RECORDS

    for name, _ in RECORDS.values():
        assert schema.hook_schema(name) == schema_for(name), name


def test_columns_checked_without_statistics(good, tmp_path):
    root = copy(good, tmp_path, "nostats")
    path = part(root, "chunk")
    t = pq.read_table(path)
    t = set_column("step", null_first)(t).replace_schema_metadata(t.schema.metadata)
    pq.write_table(t, path, write_statistics=False)
    with pytest.raises(DatasetError, match=r"^table chunk, column step: 1 null value"):
        Dataset.open(root, warn=None)


def test_derived_tables_with_their_documented_nulls_are_read(good, tmp_path):
    root = copy(good, tmp_path, "derived")
    assert kvtrace("correlate", root).returncode == 0
    steps = pq.read_table(next((root / "attributions").rglob("*.parquet")))["step"]
    assert steps.null_count > 0  # block I/O outside every step (docs/schema.md)
    r = kvtrace("summary", root, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["tables"]["attributions"]["rows"] > 0, r.stderr


def test_names_over_the_system_limits(good, tmp_path):
    component = tmp_path / ("a" * 300)
    path = Path("/tmp/" + "/".join(["b" * 200] * 25))
    for name, args in readers(component).items():
        assert "File name too long" in one_line(kvtrace(*args), 6), name
    assert "File name too long" in one_line(kvtrace("compare", path, good), 6)
    assert "File name too long" in one_line(kvtrace("summary", path), 6)
    for args in (["analyze", good], ["whatif", good], ["compare", good, good]):
        line = one_line(kvtrace(*args, "--html", component, stdout=subprocess.DEVNULL), 5)
        assert line.startswith("kvtrace: cannot write ") and line.endswith("File name too long"), line


# ---------------------------------------------------------------------------------------------
# 6. One run under two host partitions: named in one line, every figure counted once


def two_hosts(good: Path, tmp_path: Path) -> Path:
    root = copy(good, tmp_path, "two-hosts")
    for table in root.iterdir():
        shutil.copytree(table / "host=h1", table / "host=h2")
    return root


def same(rep: dict) -> dict:
    return {k: v for k, v in rep.items() if k not in ("dataset", "elapsed_s")}


def test_a_run_under_two_hosts_is_counted_once(good, tmp_path):
    from kvtrace.analysis import whatif
    from kvtrace.analysis.report import analyze
    from kvtrace.commands.summary import summarize
    from kvtrace.correlate.derive import correlate_dataset

    dup = two_hosts(good, tmp_path)
    assert same(analyze(dup)) == same(analyze(good))
    assert summarize(Dataset.open(dup, warn=None)) == summarize(Dataset.open(good, warn=None))
    timing = ("replay_s", "lookups_per_s")
    preds = [[{k: v for k, v in p.items() if k not in timing} for p in whatif.run(d, chunk_sizes=[64, 256])["predictions"]]
             for d in (dup, good)]
    assert preds[0] == preds[1]
    (one,), (two,) = correlate_dataset(good, write=False), correlate_dataset(dup, write=False)
    assert (two[0].requests.num_rows, two[0].result.chunks.num_rows, two[0].info.host) == \
           (one[0].requests.num_rows, one[0].result.chunks.num_rows, "h1")


def test_a_run_under_two_hosts_is_named_in_one_line(good, tmp_path):
    dup = two_hosts(good, tmp_path)
    r = kvtrace("analyze", dup, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [line for line in r.stderr.splitlines() if "host partitions" in line]
    assert line.startswith("kvtrace: warning: run r1 is under 2 host partitions (host=h1 and host=h2")
    assert "read once, from host=h1" in line and "host=h2 are left out" in line
    assert json.loads(r.stdout)["reuse"]["hit_local"] == 960


# ---------------------------------------------------------------------------------------------
# 7. --run of a run that is not there


def test_run_that_does_not_exist_is_exit_6(good):
    assert "has no run 'nope'" in one_line(kvtrace("summary", good, "--run", "nope"), 6)
    assert "has no run nope" in one_line(kvtrace("correlate", good, "--run", "nope"), 6)
    assert "has no run nope" in one_line(kvtrace("export", good, "--run", "nope", "--otlp", DEAD), 6)
    assert kvtrace("summary", good, "--run", "r1").returncode == 0
