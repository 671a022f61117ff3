"""Keep a capture of tests/vllm/test_otlp.py as a recorded fixture for the correlator's unit
tests: the run's raw tables (storage file_io only, to stay small) and vLLM's own usage numbers.

    .venv/bin/python tests/data/make_otlp_fixture.py BASETEMP/otlp0
"""
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
KEEP = ("runs", "step", "chunk", "admit", "evict", "preempt", "kv_load", "kv_store", "arrive", "finish", "hook_start",
        "processes", "block_io", "file_io", "io_uring")


def main(base: str) -> None:
    src, out = Path(base) / "ds", HERE / "vllm-otlp-capture"
    shutil.rmtree(out, ignore_errors=True)
    for name in KEEP:
        for f in (src / name).rglob("*.parquet"):
            dst = out / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if name == "file_io":
                t = pq.read_table(f)
                meta = t.schema.metadata
                keep = pc.starts_with(t["path"].cast(pa.string()), "/")
                t = t.filter(keep).replace_schema_metadata(meta)
                pq.write_table(t, dst, compression="zstd")
            else:
                shutil.copyfile(f, dst)
    shutil.copyfile(Path(base) / "vllm_usage.json", out / "vllm_usage.json")
    print(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), "bytes in", out)


if __name__ == "__main__":
    main(sys.argv[1])
