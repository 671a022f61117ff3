"""Correlation of recorded events: kernel I/O and vLLM records joined to steps, chunks, requests
and KV transfers (docs/correlate.md).  Pure functions, no root, no bcc; used live and offline."""
