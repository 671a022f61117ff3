"""kvtrace: see why a prefill chunk is slow — KV reuse, eviction and storage I/O, on one clock."""

__version__ = "0.1.0"
