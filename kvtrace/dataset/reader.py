"""Read a recorded dataset (no root, no bcc): tables by name, runs, and what could not be read.

Files are read one by one so a truncated or corrupt file is reported by name and the rest
is still analysed.  Partition columns ``host`` and ``date`` come from the paths.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.dataset import schema
from kvtrace.errors import DatasetError


def _partition_values(path: Path) -> dict[str, str]:
    out = {}
    for part in path.parts:
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
    return out


@dataclass
class Dataset:
    root: Path
    problems: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, root) -> "Dataset":
        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"no dataset at {root}: give the --out directory of a kvtrace attach")
        ds = cls(root)
        if not ds.files("runs") and not ds.names():
            raise DatasetError(f"{root} holds no kvtrace tables (expected e.g. {root}/block_io/host=*/date=*/*.parquet)")
        ds._check_versions()
        return ds

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name != "runs" and not p.name.startswith((".", "_")) and self.files(p.name))

    def files(self, name: str) -> list[Path]:
        base = self.root / name
        if not base.is_dir():
            return []
        return sorted(p for p in base.rglob("*.parquet") if not p.name.startswith((".", "_")))

    def _check_versions(self) -> None:
        for path in self.files("runs"):
            try:
                meta = json.loads((pq.read_schema(path).metadata or {}).get(schema.META_KEY, b"{}"))
            except Exception as e:
                self.problems.append(f"{path}: unreadable ({e})")
                continue
            version = meta.get("schema_version")
            if version != schema.SCHEMA_VERSION:
                raise DatasetError(
                    f"{path} has schema version {version}; this kvtrace reads version {schema.SCHEMA_VERSION}"
                )

    def table(self, name: str) -> pa.Table:
        """All rows of one table, with host and date columns; unreadable files are noted in problems."""
        parts = []
        for path in self.files(name):
            try:
                t = pq.read_table(path)
            except Exception as e:
                self.problems.append(f"{path}: unreadable ({type(e).__name__}: {e}); skipped")
                continue
            for k, v in _partition_values(path.relative_to(self.root)).items():
                t = t.append_column(k, pa.array([v] * t.num_rows, pa.string()))
            parts.append(t.replace_schema_metadata(None))
        if not parts:
            want = schema.RUNS if name == "runs" else schema.TABLES.get(name)
            if want is None:
                return pa.table({})
            return pa.table({f.name: pa.array([], f.type) for f in want})
        return pa.concat_tables(parts, promote_options="default")

    def runs(self) -> list[dict]:
        rows = self.table("runs").to_pylist()
        for r in rows:
            for key in ("probes_skipped", "events", "lost_events", "sampling", "kernel_skips"):
                if isinstance(r.get(key), str):
                    r[key] = json.loads(r[key])
        return rows
