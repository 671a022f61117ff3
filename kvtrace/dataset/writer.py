"""Write the dataset so a crash loses at most the last flush interval.

A Parquet file without its footer is unreadable, so rows are written as small complete
part files every flush (``<run>-p000001.parquet``, atomically renamed into place), and a
clean stop compacts a run's parts into one file per table.  The ``runs`` table, rewritten
at every flush, carries the run's metadata and exact lost-event counts, and the kind and
version of the server traced (``state_server``; null when there is none).
"""
from __future__ import annotations

import datetime as dt
import errno
import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace import __version__
from kvtrace.dataset import schema
from kvtrace.dataset.files import shown
from kvtrace.errors import OutputError

FILE_MODE = 0o600


def private_open(path, mode: str = "wb"):
    """Open ``path`` for writing, emptied, with the dataset's mode (0600: what kvtrace writes can
    hold what the traced processes read and wrote); an existing regular file gets that mode too.
    A device or pipe (/dev/null, a fifo) keeps its mode: root must not chmod /dev/null.  A
    symbolic link there is refused (ELOOP), never followed: root writes only the file named; a
    regular file of another user is refused too (EPERM): root does not take over others' files."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"it belongs to uid {st.st_uid}")
        if stat.S_ISREG(st.st_mode):
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    try:
        if stat.S_ISREG(st.st_mode):
            os.fchmod(fd, FILE_MODE)
    except OSError:
        pass  # a file we may write but not chmod keeps its mode
    return os.fdopen(fd, mode)


def write_text(path, text: str) -> None:
    """An output file of a command (--html), written with the dataset's mode; OutputError (exit 5,
    one line) when it cannot be (no such directory, no permission, a name too long, disk full)."""
    try:
        with private_open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"cannot write {shown(path)}: {e.strerror or e}") from None
# A part lives from one flush to the stop's compaction, so it is written the cheap way: LZ4 and
# no dictionaries cost about 35% less CPU than zstd on a flush's small tables (docs/performance.md).
# Compacted tables and the runs table are written with zstd.
PART = {"compression": "lz4", "use_dictionary": False}
FINAL = {"compression": "zstd"}


def _write(table: pa.Table, path: Path, meta: dict, options: dict = FINAL,
           on_full: str = "capture stopped writing; files already written stay readable") -> None:
    """Write table to path atomically (hidden temp file, then rename), mode 0600; on_full: what a
    full disk means for the writer (the disk-full message after the path)."""
    kv = dict(table.schema.metadata or {})
    kv[schema.META_KEY] = json.dumps(meta).encode()
    table = table.replace_schema_metadata(kv)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _exclusive(tmp)
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f, **options)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if e.errno == errno.ENOSPC:
            raise OutputError(f"output disk full writing {path}: {on_full}") from None
        raise OutputError(f"cannot write {path}: {e.strerror}") from None


def _exclusive(tmp: Path) -> int:
    """A new temporary file: whatever an earlier, killed writer left at its name (a file, or a
    link someone planted) is unlinked, never followed or truncated."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)


def check_out_dir(root: Path) -> None:
    """An existing output directory is used only when it is not a link, is this user's (or the
    sudo caller's), and nobody else can write in it (they could plant links at its file names)."""
    try:
        st = os.lstat(root)
    except OSError:
        return      # not there (or not reachable): making it says why, if it cannot be made
    mine = {os.geteuid()} | ({int(os.environ["SUDO_UID"])} if os.environ.get("SUDO_UID", "").isdigit() else set())
    why = ("it is a symbolic link" if stat.S_ISLNK(st.st_mode) else "it is not a directory" if not stat.S_ISDIR(st.st_mode)
           else f"it belongs to uid {st.st_uid}" if st.st_uid not in mine
           else f"others can write in it (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 else "")
    if why:
        raise OutputError(f"output directory {shown(root)} not used: {why}; choose a directory of your own for --out")


class DatasetWriter:
    def __init__(self, root: str | os.PathLike, run: str, host: str):
        self.root = Path(root)
        self.run = run
        self.host = host
        self.seq = 0
        self.pending: dict[str, list[pa.Table]] = {}
        self.rows: dict[str, int] = {}
        self.parts: dict[str, list[Path]] = {}
        self.server: dict[str, str | None] = {"server_kind": None, "server_version": None}
        self.check_writable()

    def state_server(self, kind: str | None, version: str | None) -> None:
        """The traced server's kind (kvtrace.servers.registry name) and version, written in every
        run row from now on: the one place a dataset says what server it recorded."""
        self.server = {"server_kind": kind, "server_version": version}

    def check_writable(self) -> None:
        check_out_dir(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OutputError(f"output directory {self.root} is not writable: choose another --out")

    def _dir(self, table: str) -> Path:
        date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        return self.root / table / f"host={self.host}" / f"date={date}"

    def _meta(self, table: str) -> dict:
        return {"schema_version": schema.SCHEMA_VERSION, "kvtrace_version": __version__, "run": self.run, "table": table}

    def add(self, name: str, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if name in schema.TABLES:
            table = schema.conform(table, schema.TABLES[name])
        self.pending.setdefault(name, []).append(table)
        self.rows[name] = self.rows.get(name, 0) + table.num_rows

    def flush(self, run_row: dict) -> None:
        """Write pending rows as part files, then the run's metadata row."""
        self.seq += 1
        for name, tables in self.pending.items():
            if not tables:
                continue
            table = schema.with_run(pa.concat_tables(tables), self.run)
            path = self._dir(name) / f"{self.run}-p{self.seq:06d}.parquet"
            _write(table, path, self._meta(name), PART)
            self.parts.setdefault(name, []).append(path)
        self.pending = {}
        self.write_run(run_row)

    def write_run(self, run_row: dict) -> None:
        run_row = {**self.server, **run_row}
        row = {f.name: [run_row.get(f.name)] for f in schema.RUNS}
        table = pa.table(row, schema=schema.RUNS)
        _write(table, self._dir("runs") / f"{self.run}.parquet", self._meta("runs"))

    def compact(self) -> None:
        """Merge each table's part files of this run into one file per partition directory
        (streaming, so memory stays bounded by one part).  Parts are removed only once the file
        holding their rows is in place.  Parts gone from the disk (the output directory removed
        during the run) or a merge that fails: OutputError (exit 5) after every other table is
        compacted, so what is still on the disk stays, readable."""
        gone: list[Path] = []
        failed: list[str] = []
        for name, parts in self.parts.items():
            by_dir: dict[Path, list[Path]] = {}
            for p in parts:
                by_dir.setdefault(p.parent, []).append(p)
            merged = []
            for folder, group in by_dir.items():
                here = [p for p in group if p.is_file()]
                gone += [p for p in group if p not in here]
                if not here:
                    continue
                try:
                    merged.append(self._merge(name, folder, here) if len(here) > 1 else here[0])
                except OutputError as e:
                    failed.append(str(e))
                    merged += [p for p in here if p.is_file()]
            self.parts[name] = merged
        if failed or gone:
            raise OutputError(self._compact_error(failed, gone))

    def _compact_error(self, failed: list[str], gone: list[Path]) -> str:
        after = f"; kvtrace correlate {self.root} adds the derived tables to what is left"
        if failed:
            return failed[0] + (f" ({len(failed) - 1} more tables like it)" if len(failed) > 1 else "") + after
        if not any(self.parts.values()):
            return (f"the output directory {self.root} was removed during the run: the {len(gone)} part files of run "
                    f"{self.run} are gone (the first: {gone[0]}); nothing is left to compact")
        return (f"{len(gone)} part files of run {self.run} were removed from {self.root} during the run (the first: "
                f"{gone[0]}); the rest is compacted and readable" + after)

    def _merge(self, name: str, folder: Path, group: list[Path]) -> Path:
        out = folder / f"{self.run}.parquet"
        tmp = folder / f".{out.name}.tmp"
        try:
            first = pq.read_schema(group[0])
            fd = _exclusive(tmp)
            with os.fdopen(fd, "wb") as f, pq.ParquetWriter(f, first, **FINAL) as w:
                for p in group:
                    w.write_table(pq.read_table(p, schema=first))
            os.replace(tmp, out)
        except (OSError, pa.ArrowException) as e:
            tmp.unlink(missing_ok=True)
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
            raise OutputError(f"cannot compact {name} in {folder}: {why}; its part files stay readable") from None
        for p in group:
            p.unlink(missing_ok=True)
        return out
