"""Read a recorded dataset (no root, no bcc): the one reader of kvtrace's Parquet files.

Every command that reads a dataset (summary, correlate, export, analyze, whatif) opens it
here, so one rule holds for all of them (docs/schema.md, "Reading a dataset"):

- no directory, not a directory, no Parquet file under it: DatasetError (exit 6);
- a file whose footer reads but that carries no kvtrace ``schema_version``, or one this kvtrace
  does not read (schema.READABLE): DatasetError naming the file (its columns may mean something
  else).  Version 1 and 2 files may be mixed (a version 1 dataset correlated by this kvtrace);
  ``run_versions`` says which version each run was written in;
- a file that cannot be read (a part torn by a crash, truncated, a corrupt footer or page,
  no permission, not a regular file: a FIFO, a socket, a link): left out, named in ``problems``
  and in one warning line on stderr, and the rest is read; every file unreadable: DatasetError.
  Files are opened without blocking and without following links (kvtrace.dataset.files).  A
  command that may still fail on what is left opens with ``defer=True`` and lets the warnings out
  (``go_on``) once it goes on, so an error stays one line;
- a column that is not what kvtrace writes (another type, a key column missing or null, a
  negative time): DatasetError naming the file, table and column (kvtrace.dataset.columns);
- a run under several host partitions: read once, from one of them, with a warning
  (kvtrace.dataset.copies).

Files are listed once, at open, and every footer is read then (versions, columns, row
counts).  Partition columns ``host`` and ``date`` come from the paths.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.dataset import columns, copies, schema
from kvtrace.dataset.files import NotRegular, check_root, open_regular, shown
from kvtrace.errors import DatasetError

HIDDEN = (".", "_")  # temp files of an atomic write, _SUCCESS and the like


def warn_stderr(line: str) -> None:
    """The one way a reading problem is reported: one line on stderr."""
    sys.stderr.write(f"kvtrace: warning: {line}\n")
    sys.stderr.flush()


def partition_values(path: Path) -> dict[str, str]:
    return dict(part.split("=", 1) for part in path.parts if "=" in part)


@dataclass
class Skipped:
    """A file left out because it cannot be read."""
    table: str
    path: Path
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}; its rows of {self.table} are left out"


@dataclass
class Footer:
    schema: pa.Schema
    rows: int
    version: object  # the kvtrace schema_version it carries (None: none)
    meta: pq.FileMetaData | None = None


def _footer_why(e: Exception) -> str:
    if isinstance(e, NotRegular):
        return e.why
    if isinstance(e, OSError) and e.strerror:
        return f"unreadable ({e.strerror})"
    text = str(e).splitlines()[0][:200] if str(e) else ""
    if any(w in text.lower() for w in ("footer", "magic", "size")):
        return "truncated or corrupt (no readable Parquet footer)"
    return f"unreadable ({type(e).__name__}: {text})"


def _read_footer(path: Path) -> Footer:
    with open_regular(path) as f:
        md = pq.read_metadata(f)
    arrow = md.schema.to_arrow_schema()
    try:
        version = json.loads((arrow.metadata or {}).get(schema.META_KEY, b"{}")).get("schema_version")
    except (ValueError, AttributeError):
        version = None
    return Footer(arrow, md.num_rows, version, md)


def list_files(root: Path) -> dict[str, list[Path]]:
    """Every table directory of root (runs included) -> its Parquet files, sorted."""
    try:
        dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(HIDDEN))
        return {d.name: sorted(p for p in d.rglob("*.parquet") if not p.name.startswith(HIDDEN)) for d in dirs}
    except OSError as e:
        raise DatasetError(f"cannot read {shown(root)}: {e.strerror}") from None


def readable() -> str:
    """The schema versions this kvtrace reads, in words ("versions 1 and 2")."""
    *first, last = schema.READABLE
    return f"versions {', '.join(map(str, first))} and {last}" if first else f"version {last}"


def version_error(bad: list[tuple[Path, object]], mixed: bool) -> DatasetError:
    path, v = bad[0]
    what = "no kvtrace schema version (not written by kvtrace, or its metadata was stripped)" if v is None \
        else f"schema version {v}"
    more = f" ({len(bad) - 1} more files like it)" if len(bad) > 1 else ""
    mix = " (the dataset mixes versions: other files are of a version it reads)" if mixed else ""
    return DatasetError(f"{path} has {what}; this kvtrace reads {readable()}{more}{mix}")


@dataclass
class Dataset:
    root: Path
    warn: Callable[[str], None] | None = warn_stderr
    skipped: list[Skipped] = field(default_factory=list)
    footers: dict[str, dict[Path, Footer]] = field(default_factory=dict)  # readable files per table
    pending: list[str] | None = None  # warnings held back until go_on()

    @classmethod
    def open(cls, root, warn: Callable[[str], None] | None = warn_stderr, defer: bool = False) -> "Dataset":
        """The dataset at root, every file's footer read and its version checked (module docstring)."""
        root = Path(root)
        check_root(root)
        found = list_files(root)
        if not any(found.values()):
            raise DatasetError(f"{shown(root)} is an empty dataset: no kvtrace tables in it "
                               f"(expected e.g. {shown(root)}/block_io/host=*/date=*/*.parquet)")
        ds = cls(root, warn, pending=[] if defer else None)
        for name, paths in found.items():
            ds.footers[name] = {p: f for p in paths if (f := ds._footer(name, p)) is not None}
        ds._check_versions()
        if not any(ds.footers.values()):
            raise DatasetError(f"none of the {len(ds.skipped)} Parquet files of {shown(root)} can be read: "
                               f"{ds.skipped[0].path}: {ds.skipped[0].why}")
        ds._check_columns()
        ds._report(ds.skipped)
        for line in copies.drop_copies(root, ds.footers):
            ds.say(line)
        return ds

    def _footer(self, name: str, path: Path) -> Footer | None:
        try:
            return _read_footer(path)
        except Exception as e:  # noqa: BLE001 - any failure to read a file is the same problem
            self.skipped.append(Skipped(name, path, _footer_why(e)))
            return None

    def _check_versions(self) -> None:
        seen = [(p, f.version) for files in self.footers.values() for p, f in files.items()]
        bad = [(p, v) for p, v in seen if v not in schema.READABLE]
        if bad:
            raise version_error(bad, mixed=len(bad) < len(seen))

    def _check_columns(self) -> None:
        for name, files in self.footers.items():
            for p, f in files.items():
                columns.check(name, p, f.schema, f.meta)
                f.meta = None  # only needed for the check

    def check_run(self, run: str | None) -> None:
        """DatasetError (exit 6) when run is given and the dataset has no run of that id."""
        if run is None:
            return
        known = sorted({r["run"] for r in self.table("runs").to_pylist()} |
                       {copies.run_of(p) for files in self.footers.values() for p in files})
        if run not in known:
            some = ", ".join(known[:5]) + (f" and {len(known) - 5} more" if len(known) > 5 else "")
            raise DatasetError(f"{shown(self.root)} has no run {run!r} (its runs: {some or 'none'}; "
                               "kvtrace summary DIR lists them)")

    def run_versions(self) -> dict[str, int]:
        """Run id -> the schema version it was written in: the lowest of its files' (a version 1
        run keeps version 1 when a later kvtrace adds derived tables to it)."""
        out: dict[str, int] = {}
        for files in self.footers.values():
            for p, f in files.items():
                run = copies.run_of(p)
                out[run] = min(out.get(run, f.version), f.version)
        return out

    def say(self, line: str) -> None:
        """A warning: one line on stderr (held back while deferred)."""
        if self.pending is not None:
            self.pending.append(line)
        elif self.warn is not None:
            self.warn(line)

    def go_on(self) -> None:
        """Let the held-back warnings out: the command goes on with what could be read."""
        pending, self.pending = self.pending or [], None
        for line in pending:
            self.say(line)

    def _report(self, skipped: list[Skipped]) -> None:
        if not skipped:
            return
        if len(skipped) == 1:
            self.say(str(skipped[0]))
            return
        tables = ", ".join(sorted({s.table for s in skipped}))
        self.say(f"{len(skipped)} files of {self.root} cannot be read and are left out (tables {tables}): "
                  f"{skipped[0]}; and {len(skipped) - 1} more (kvtrace summary --json lists them)")

    @property
    def problems(self) -> list[str]:
        """What could not be read, one line per file."""
        return [str(s) for s in self.skipped]

    def names(self) -> list[str]:
        """The tables with a readable file, but runs."""
        return sorted(n for n, files in self.footers.items() if files and n != "runs")

    def files(self, name: str, run: str | None = None, host: str | None = None) -> list[Path]:
        """Readable files of a table; of one run (files named after it) on one host, if given."""
        out = []
        for p in self.footers.get(name, {}):
            if run is not None and not (p.stem == run or p.stem.startswith(run + "-p")):
                continue
            if host is not None and partition_values(p.relative_to(self.root)).get("host") != host:
                continue
            out.append(p)
        return out

    def rows(self, name: str, run: str | None = None, host: str | None = None) -> int:
        """Rows of a table (from the footers: nothing is read)."""
        return sum(self.footers[name][p].rows for p in self.files(name, run, host))

    def columns(self, name: str, paths: list[Path] | None = None) -> set[str]:
        """Column names found in the table's files (or in those of paths)."""
        files = self.footers.get(name, {})
        return {c for p in (files if paths is None else paths) if p in files for c in files[p].schema.names}

    def read(self, path: Path, partitions: bool = True) -> pa.Table | None:
        """One file's rows, or None when its pages cannot be read (then left out and reported)."""
        name = path.relative_to(self.root).parts[0]
        try:
            with open_regular(path) as f:
                t = pq.read_table(f)
        except Exception as e:  # noqa: BLE001
            skip = Skipped(name, path, f"corrupt ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            self.skipped.append(skip)
            self.footers.get(name, {}).pop(path, None)
            self._report([skip])
            return None
        if partitions:
            for k, v in partition_values(path.relative_to(self.root)).items():
                t = t.append_column(k, pa.array([v] * t.num_rows, pa.string()))
        return t.replace_schema_metadata(None)

    def why(self, path: Path) -> str | None:
        """Why path was left out (None: it was not)."""
        return next((s.why for s in reversed(self.skipped) if s.path == path), None)

    def table(self, name: str, run: str | None = None, host: str | None = None,
              paths: list[Path] | None = None, partitions: bool = True) -> pa.Table:
        """All readable rows of one table (of a run, a host, or the files in paths), with the
        partition columns host and date unless partitions is False."""
        parts = [t for p in (self.files(name, run, host) if paths is None else paths)
                 if (t := self.read(p, partitions)) is not None]
        if not parts:
            return empty(name)
        try:
            return pa.concat_tables(parts, promote_options="default")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DatasetError(f"the files of {self.root / name} do not join into one table: "
                               f"{str(e).splitlines()[0][:200]}") from None

    def runs(self) -> list[dict]:
        """The runs table's rows (host and date included), JSON columns decoded (an object each:
        {} when absent, not JSON or not an object)."""
        rows = self.table("runs").to_pylist()
        for r in rows:
            for key in ("probes_skipped", "events", "lost_events", "sampling", "kernel_skips"):
                if isinstance(r.get(key), str):
                    try:
                        r[key] = json.loads(r[key])
                    except ValueError:
                        r[key] = {}
                    if not isinstance(r[key], dict):
                        r[key] = {}
        return rows


def empty(name: str) -> pa.Table:
    """No rows, with the table's documented columns where it has a schema here."""
    want = schema.RUNS if name == "runs" else schema.TABLES.get(name)
    if want is None:
        return pa.table({})
    return pa.table({f.name: pa.array([], f.type) for f in want})
