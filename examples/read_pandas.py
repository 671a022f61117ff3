"""Read a kvtrace dataset into pandas DataFrames (and polars, when installed) and join them.

    python examples/read_pandas.py DIR

Each table is a directory of Parquet files partitioned Hive-style (DIR/chunks/host=H/date=D/*.parquet):
pandas (through pyarrow) and polars read a table's directory as one frame with host and date
columns.  The derived tables (requests, chunks, steps, attributions) need `kvtrace correlate DIR`
once if the capture did not stop cleanly.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

SCHEMA_VERSIONS = {1, 2}  # docs/schema.md: the derived tables read here are the same in both
KEYS = ["run", "engine_pid", "request"]


def load(dataset) -> dict[str, pd.DataFrame]:
    """The run metadata and the derived tables, with nullable integer columns (no NaN for a missing step)."""
    root = Path(dataset)
    frames = {name: pd.read_parquet(root / name, dtype_backend="numpy_nullable")
              for name in ("runs", "requests", "chunks", "steps", "attributions")}
    versions = set(frames["runs"]["schema_version"])
    if not versions <= SCHEMA_VERSIONS:
        raise SystemExit(f"{dataset}: schema version {sorted(versions)}; this example reads versions 1 and 2")
    return frames


def chunk_table(f: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per chunk with its request's hit ratio and its step's batch and storage reads, slowest step first."""
    req = f["requests"][KEYS + ["prompt_len", "cached_tokens"]]
    step = f["steps"][["run", "engine_pid", "step", "num_reqs", "total_tokens", "file_read_bytes", "block_read_bytes"]]
    c = (f["chunks"].merge(req, on=KEYS, suffixes=("", "_req"))
         .merge(step, on=["run", "engine_pid", "step"], suffixes=("", "_step")))
    c["hit_ratio"] = c["cached_tokens_req"] / c["prompt_len"]
    c["step_ms"] = (c["t_end_ns"] - c["t_start_ns"]) / 1e6
    c["storage_ms"] = c["storage_wait_ns"] / 1e6
    cols = ["request", "attempt", "chunk_index", "step", "tokens", "hit_ratio", "step_ms", "storage_ms", "load_bytes",
            "file_read_bytes", "block_read_bytes", "total_tokens", "file_read_bytes_step", "block_read_bytes_step"]
    return c.sort_values(["step_ms", "step"], ascending=[False, True])[cols].reset_index(drop=True)


def io_by_attribution(f: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Kernel storage I/O per source and how the correlator placed it (thread_time, shared, none)."""
    a = f["attributions"]
    a = a[a["source"].isin(["block_io", "file_io", "io_uring"])].astype({"source": str, "how": str})
    return (a.groupby(["source", "how"]).agg(ios=("bytes", "size"), bytes=("bytes", "sum"))
            .reset_index().sort_values(["source", "how"]).reset_index(drop=True))


def arrivals(f: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Request arrivals on the wall clock: monotonic ns + the run's clock_offset_ns."""
    r = f["requests"].merge(f["runs"][["run", "clock_offset_ns"]], on="run")
    wall = (r["arrival_ns"].astype("int64") + r["clock_offset_ns"]).where(r["arrival_ns"] > 0)  # 0: arrived before the attach
    r["arrival"] = pd.to_datetime(wall, unit="ns", utc=True)
    return r[["request", "arrival", "prompt_len", "cached_tokens", "chunks"]]


def polars_chunks(dataset):
    """The chunks joined with their requests' hit ratio in polars, slowest step first (None without polars)."""
    try:
        import polars as pl
    except ImportError:
        return None
    read = lambda t: pl.read_parquet(f"{dataset}/{t}/*/*/*.parquet", hive_partitioning=True)  # noqa: E731
    return (read("chunks").join(read("requests").select(KEYS + ["cached_tokens", "prompt_len"]), on=KEYS, suffix="_req")
            .with_columns(hit_ratio=pl.col("cached_tokens_req") / pl.col("prompt_len"),
                          step_ms=(pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6)
            .sort(["step_ms", "step"], descending=[True, False])
            .select(["request", "attempt", "chunk_index", "step", "tokens", "hit_ratio", "step_ms"]))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    f = load(argv[0])
    print(", ".join(f"{name} {len(df)} rows" for name, df in f.items()))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print("\nchunks with their request's hit ratio and their step's storage reads (slowest step first)")
        print(chunk_table(f).head(5).to_string())
        print("\nkernel storage I/O by how it was attributed")
        print(io_by_attribution(f).to_string())
        print("\nrequests on the wall clock")
        print(arrivals(f).to_string())
    pl_chunks = polars_chunks(argv[0])
    if pl_chunks is None:
        print("\n(polars is not installed: `pip install polars` to read the same tables with it)")
    else:
        print("\npolars: the chunks joined with their requests\n", pl_chunks.head(5), sep="")


if __name__ == "__main__":
    main()
