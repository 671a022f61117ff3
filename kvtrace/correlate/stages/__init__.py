"""The stages of one correlation pass (kvtrace.correlate.core.correlate wires them in order).

Each stage is a pure function of the pass's Context (context.py: the input columns, the step
windows, which steps this pass finalises) and of the outputs of earlier stages, returned as
small dataclasses; none keeps state between calls.  In the order correlate() runs them:

    context       Context, the placement primitives (locate, StepIndex, engine_map, thread_match)
    requests      trace ids from the arrive records; the admit / arrive / finish records
    chunks        the chunk index: each chunk's step and admission, which are final
    transfers     KV transfers (kv_load, kv_store): step, request, chunk, how
    storage_io    kernel storage I/O (block_io, file_io, io_uring): thread+time, shared, none
    evictions     evictions and preemptions: the step, request and chunk they name
    overlap       NVMe / NIC rows: every step their interval overlaps (time_overlap)
    nvme          NVMe commands: the KV transfer whose thread issued them; per-step latency
    steps         per-step aggregates (storage wait, compute, I/O bytes); the steps table
    chunk_table   per-chunk sums and step columns; the chunks table
    attributions  one row per placed event, with how it was placed
    spans         what the span builders need: transfers with their kernel I/O and NVMe groups

kvtrace.correlate.core.decided then says which input rows the pass is done with.
"""
