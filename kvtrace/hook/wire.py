"""The records the hook sends to the agent, and their byte encoding (shared by both sides).

A frame is ``b"KVT1"`` followed by records; a record is ``u16 type, u16 body length, body``.
Bodies are little-endian fields in the order of RECORDS[type]; ``s`` is a string (u16
length + UTF-8), ``U`` a list of u64 (u16 count + count little-endian u64), every other code is
a struct code.  Times are CLOCK_MONOTONIC ns
(``time.monotonic_ns()``), the clock of bpf_ktime_get_ns().
Prompt token ids are never encoded: prompts appear only as block hashes.
"""
from __future__ import annotations

import array
import struct
import sys

MAGIC = b"KVT1"
_HDR = struct.Struct("<HH")
_U16 = struct.Struct("<H")
MAX_FRAME = 4000  # bytes per marker write, magic included (the BPF side copies at most 4080)

# type id -> (record name, [(field, code)]).  Append new types; never renumber.
RECORDS: dict[int, tuple[str, list[tuple[str, str]]]] = {
    1: ("hook_start", [("t_ns", "Q"), ("role", "s"), ("vllm_version", "s"), ("hook_version", "s")]),
    2: ("hook_stats", [("t_ns", "Q"), ("emitted", "Q"), ("dropped", "Q"), ("errors", "Q"), ("last_error", "s")]),
    # EngineCore (kvtrace.hook.vllm.hook; docs/hook.md).  `step` is vLLM's Scheduler.current_step.
    # One per engine step: schedule() start, schedule() return, update_from_output() end.
    3: ("step", [("step", "Q"), ("t_start_ns", "Q"), ("t_sched_end_ns", "Q"), ("t_end_ns", "Q"),
                 ("num_reqs", "I"), ("total_tokens", "I"), ("prefill_reqs", "I"), ("prefill_tokens", "I"),
                 ("decode_reqs", "I"), ("decode_tokens", "I"), ("new_reqs", "I"), ("resumed_reqs", "I"),
                 ("preempted", "I"), ("evicted", "I"), ("alloc_failures", "I"), ("running", "I"),
                 ("waiting", "I"), ("free_blocks", "I"), ("finished", "I")]),
    # One per prefill chunk: tokens [start, start+length) of the request computed in this step.
    # attempt = preemptions before this admission; chunk_index restarts at 0 on each admission
    # (-1: the agent attached after the request's first chunk).  prefill_len = tokens this
    # admission must compute up to (the prompt; prompt + generated tokens after a preemption).
    4: ("chunk", [("step", "Q"), ("request", "s"), ("attempt", "H"), ("chunk_index", "i"),
                  ("start", "I"), ("length", "I"), ("prompt_len", "I"), ("prefill_len", "I"),
                  ("last", "B"), ("resumed", "B")]),
    # One per admission (first, and re-admission after preemption).  cached_* are the prefix-cache
    # hit (local) and the connector's hit (external); start = first token computed.
    # last_hit_hash is the chained hash of the last hit block (it names the whole hit prefix), in
    # the 64-bit form of vLLM's KV events; 0 when nothing hit.
    5: ("admit", [("step", "Q"), ("request", "s"), ("attempt", "H"), ("prompt_len", "I"),
                  ("prefill_len", "I"), ("cached_local", "I"), ("cached_external", "I"), ("start", "I"),
                  ("hit_blocks", "I"), ("last_hit_hash", "Q"), ("resumed", "B")]),
    # One per block hash dropped from the prefix cache when its block is reused (BlockRemoved in
    # vLLM's KV events: same 64-bit hash, group and medium); request = whose allocation reused it.
    6: ("evict", [("step", "Q"), ("t_ns", "Q"), ("block_hash", "Q"), ("group", "I"), ("block_id", "I"),
                  ("medium", "s"), ("request", "s")]),
    # One per preemption: computed tokens dropped (their blocks stay cached until reused) and the
    # request whose allocation failed (empty outside the scheduler's allocation loop).
    7: ("preempt", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("computed_before", "I"),
                    ("num_tokens", "I"), ("num_preemptions", "H"), ("for_request", "s")]),
    # KV connector transfers, in the process doing the copy.  Per worker step from the connector API
    # (source "connector:<class>"; request empty, blocks/nbytes 0): kv_load spans start_load_kv entry
    # to the later of its return and the last wait_for_layer_load return; kv_store spans
    # wait_for_save.  Or one per kvtrace.hook.api.kv_transfer() call (source given by the caller).
    8: ("kv_load", [("t_start_ns", "Q"), ("t_end_ns", "Q"), ("t_issue_end_ns", "Q"), ("seq", "Q"),
                    ("layer_waits", "I"), ("wait_ns", "Q"), ("blocks", "I"), ("nbytes", "Q"),
                    ("request", "s"), ("source", "s")]),
    9: ("kv_store", [("t_start_ns", "Q"), ("t_end_ns", "Q"), ("t_issue_end_ns", "Q"), ("seq", "Q"),
                     ("layer_waits", "I"), ("wait_ns", "Q"), ("blocks", "I"), ("nbytes", "Q"),
                     ("request", "s"), ("source", "s")]),
    # A request's first admission: its arrival (vLLM's arrival_time, on CLOCK_MONOTONIC) and the
    # W3C trace context it carried (vLLM keeps it only when started with --otlp-traces-endpoint),
    # so kvtrace's spans join the request's trace (kvtrace.correlate, docs/otlp.md).
    10: ("arrive", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("traceparent", "s"), ("tracestate", "s")]),
    # A request vLLM reports finished (or aborted) in the SchedulerOutput of `step`; t_ns is that
    # step's schedule() start.
    11: ("finish", [("step", "Q"), ("t_ns", "Q"), ("request", "s")]),
    # A request's prompt as its chain of block hashes, at first admission (kvtrace whatif replays
    # them): hashes[i] is block first+i, in the 64-bit form of vLLM's KV events; long prompts come
    # as several records (first = index of their first block).  max_output is the request's output
    # limit (its output length when it is not stopped early).  Token ids are never sent.
    12: ("prompt_blocks", [("step", "Q"), ("request", "s"), ("block_size", "I"), ("prompt_len", "I"),
                           ("max_output", "I"), ("num_blocks", "I"), ("first", "I"), ("hashes", "U")]),
    # The evictions of one allocation, batched (hook version 2 sends these instead of one `evict` per
    # hash): blocks holds two u64 per hash dropped, the 64-bit block hash, then
    # group << 32 | block_id.  The agent stores them as `evict` rows (evict_rows), one per hash,
    # all with this record's t_ns (the first eviction of the batch).
    13: ("evicts", [("step", "Q"), ("t_ns", "Q"), ("medium", "s"), ("request", "s"), ("blocks", "U")]),
    # First in a frame the hook's sender thread writes for the Worker: the records after it in
    # the frame were made on thread `tid` (the marker's own tid is the sender's).  Not stored:
    # the agent puts `tid` in those records' tid column.  Older agents skip it (unknown type).
    14: ("thread", [("tid", "I")]),
    # One Worker step of a KV connector (hook version 4 sends this instead of a kv_load and a
    # kv_store): the agent stores it as those two rows (kv_step_rows), the kv_load only when
    # `loaded` (start_load_kv ran, or a layer waited).
    15: ("kv_step", [("load_start_ns", "Q"), ("load_end_ns", "Q"), ("load_issue_end_ns", "Q"), ("seq", "Q"),
                     ("layer_waits", "I"), ("wait_ns", "Q"), ("save_start_ns", "Q"), ("save_end_ns", "Q"),
                     ("loaded", "B"), ("source", "s")]),
    # An admission whose prefix-cache lookup differs from plain: `skipped` (the request skips
    # reading the prefix cache: prompt logprobs, or caching off for it), `keyed` (its block hashes
    # carry extra keys: a LoRA adapter, a cache_salt, multimodal inputs).  Not sent for the others.
    16: ("lookup", [("step", "Q"), ("request", "s"), ("attempt", "H"), ("skipped", "B"), ("keyed", "B")]),
    # A keyed request's prompt as the chain its blocks would have without extra keys (vLLM's own
    # hash, 64-bit KV-event form): the same tokens at the same place as another request's blocks
    # have the same hash here.  Sent at first admission after its prompt_blocks; first = index.
    17: ("prompt_plain", [("step", "Q"), ("request", "s"), ("first", "I"), ("hashes", "U")]),
    # The prefix cache's block hashes when the hook began recording for an agent (KV-event form):
    # what was stored before the agent attached and is still there.  first = index of the
    # record's first hash, total = hashes in all; served: 1 when the scheduler had run steps
    # before (so blocks may have been stored and evicted unseen), 0 when not, 2 unknown.
    18: ("cached", [("t_ns", "Q"), ("step", "Q"), ("served", "B"), ("first", "I"), ("total", "I"),
                    ("hashes", "U")]),
    # A re-admission after preemption: the request's block hashes past its prompt (its generated
    # tokens' full blocks), first = their index in the request's chain.
    19: ("resume_blocks", [("step", "Q"), ("request", "s"), ("attempt", "H"), ("first", "I"), ("hashes", "U")]),
    # After each hook_start: the serving engine the hook is in ("vllm", "sglang"), its version, and
    # its KV cache's tokens per block (SGLang's page size; 0: as prompt_blocks says).
    20: ("engine", [("t_ns", "Q"), ("name", "s"), ("version", "s"), ("block_size", "I")]),
    # Any KV connector, as the scheduler that drives it sees it (kvtrace.hook.vllm.connector;
    # `connector` is its class name).  An admission granted with tokens to load from the connector:
    # `first` = the first of them (the local hit before them), `external` tokens into `blocks`
    # KV blocks of `nbytes` (each block counted at its group's bytes per block); `async`: the
    # request waits for the load (done at its kv_done), else the load runs in this step.
    21: ("kv_alloc", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("first", "I"), ("external", "I"),
                      ("blocks", "I"), ("nbytes", "Q"), ("async", "B"), ("connector", "s")]),
    # An asynchronous transfer the workers reported finished this step: direction "load"
    # (finished receiving; ok 0 when it failed) or "store" (finished sending or saving).
    22: ("kv_done", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("direction", "s"), ("ok", "B"),
                     ("connector", "s")]),
    # A request's end as the connector was told it: the blocks of its computed tokens handed to it
    # (what it may store or send) and their bytes; delay_free: it keeps them while it stores or
    # sends them asynchronously (until a kv_done "store").
    23: ("kv_finish", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("blocks", "I"), ("nbytes", "Q"),
                       ("delay_free", "B"), ("connector", "s")]),
    # Blocks of a request's load that the workers reported failed to load (request empty: blocks
    # of no load the hook saw); vLLM recomputes them.
    24: ("kv_invalid", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("blocks", "I"), ("connector", "s")]),
    # A Worker step of a KV connector (hook version 6 sends this instead of kv_step): kv_step's
    # fields and the connector's save_kv_layer calls (per layer, during the forward): how many,
    # their time inside, the first's start.  Stored as kv_load and kv_store rows (kv_step_rows).
    25: ("kv_step2", [("load_start_ns", "Q"), ("load_end_ns", "Q"), ("load_issue_end_ns", "Q"), ("seq", "Q"),
                      ("layer_waits", "I"), ("wait_ns", "Q"), ("save_start_ns", "Q"), ("save_end_ns", "Q"),
                      ("loaded", "B"), ("source", "s"), ("save_layers", "I"), ("save_layer_ns", "Q"),
                      ("save_first_ns", "Q")]),
    # Inside a KV tier's own server (kvtrace.hook.lmcache; `tier` names its kind): a lookup the
    # engine made for `request`, done: its chunks (per key row), those L1 held, those loaded from
    # L2, and the indices of the L2 ones (the chunk index times the tier's chunk size is a token).
    26: ("tier_lookup", [("t_ns", "Q"), ("request", "s"), ("chunks", "I"), ("l1", "I"), ("l2", "I"),
                         ("l2_chunks", "U"), ("tier", "s")]),
    # One operation of the tier: op "l2_read" (an L2 load, disk -> memory, for the lookup of
    # `request`), "l2_write" (memory -> disk; no request), "retrieve" (memory -> the engine),
    # "store" (the engine -> memory), "evict" (keys its memory tier dropped).  keys or num_tokens,
    # bytes, ok = 0 when it failed.
    27: ("tier_op", [("t_start_ns", "Q"), ("t_end_ns", "Q"), ("request", "s"), ("op", "s"), ("keys", "I"),
                     ("num_tokens", "I"), ("nbytes", "Q"), ("ok", "B"), ("tier", "s")]),
    # Speculative decoding (kvtrace.hook.vllm.spec): a step that scheduled draft tokens, with the
    # drafts the model accepted (as vLLM counts them: sampled tokens - 1 per drafted request), those
    # of them kept as output (a request that reached its end drops the rest) and the tokens every
    # request got in it; and, at a request's finish on a server that speculates, its drafts,
    # accepted drafts and output tokens.
    28: ("spec_step", [("step", "Q"), ("t_ns", "Q"), ("drafts", "I"), ("accepted", "I"), ("kept", "I"),
                       ("generated", "I")]),
    29: ("spec_req", [("step", "Q"), ("t_ns", "Q"), ("request", "s"), ("drafts", "I"), ("accepted", "I"),
                     ("output_tokens", "I")]),
    # After each hook_start on a vLLM engine: one per KV cache group (kvtrace.hook.vllm.groups).
    # kind: its spec ("full_attention", "sliding_window", "chunked_local_attention", "mamba", ...);
    # block_size: tokens per block of its manager; window: the sliding window or local chunk in
    # tokens (0: none); layers and page_bytes (a block's bytes over all its layers); hash_block:
    # tokens per block hash (prompt_blocks' block_size); align: tokens a hit is a multiple of (the
    # match unit); num_blocks: the block pool all groups share; retention: vLLM's
    # prefix_cache_retention_interval for sliding-window and Mamba groups (-1: None, every block
    # kept; 0: only the blocks a hit at a prompt's end or a shared-prefix junction needs; k: also
    # those of every k tokens); eagle: its manager drops the last matched block (an EAGLE-style
    # drafter: the draft needs the KV of the block's last token computed again).
    30: ("kv_group", [("t_ns", "Q"), ("group", "I"), ("kind", "s"), ("block_size", "I"), ("window", "I"),
                      ("layers", "I"), ("page_bytes", "Q"), ("hash_block", "I"), ("align", "I"), ("num_blocks", "I"),
                      ("retention", "i"), ("eagle", "B")]),
    # With several KV cache groups: the `cached` snapshot of one group (the hashes its blocks are
    # cached under), sent after that snapshot with the same t_ns; first and total as there.
    31: ("cached_in", [("t_ns", "Q"), ("group", "I"), ("first", "I"), ("total", "I"), ("hashes", "U")]),
}

EVICTS_MAX = 200  # evictions per `evicts` record (3,200 bytes of blocks: one record fits a frame)
PROMPT_PIECE = 448  # hashes per prompt_blocks, resume_blocks, prompt_plain or cached record (3,584 bytes)


def evict_rows(rec: dict) -> list[dict]:
    """The `evict` rows of one `evicts` record (a trailing odd value is ignored)."""
    b = rec["blocks"]
    step, t, medium, req = rec["step"], rec["t_ns"], rec["medium"], rec["request"]
    return [{"step": step, "t_ns": t, "block_hash": b[i], "group": b[i + 1] >> 32, "block_id": b[i + 1] & 0xFFFFFFFF,
             "medium": medium, "request": req} for i in range(0, len(b) - 1, 2)]


def kv_step_rows(rec: dict) -> list[tuple[str, dict]]:
    """The kv_load (when the step loaded) and kv_store rows of one `kv_step` or `kv_step2`
    record, as the hook sent them one by one before version 4.  With save_kv_layer calls
    (kv_step2), the store starts at the first of them and its layer_waits / wait_ns are their
    count and time inside."""
    seq, source = rec["seq"], rec["source"]
    rows = []
    if rec["loaded"]:
        rows.append(("kv_load", {"t_start_ns": rec["load_start_ns"], "t_end_ns": rec["load_end_ns"],
                                 "t_issue_end_ns": rec["load_issue_end_ns"], "seq": seq,
                                 "layer_waits": rec["layer_waits"], "wait_ns": rec["wait_ns"], "blocks": 0,
                                 "nbytes": 0, "request": "", "source": source}))
    layers = rec.get("save_layers", 0)
    start = min(rec["save_first_ns"], rec["save_start_ns"]) if layers else rec["save_start_ns"]
    rows.append(("kv_store", {"t_start_ns": start, "t_end_ns": rec["save_end_ns"],
                              "t_issue_end_ns": rec["save_end_ns"], "seq": seq, "layer_waits": layers,
                              "wait_ns": rec.get("save_layer_ns", 0) if layers else 0,
                              "blocks": 0, "nbytes": 0, "request": "", "source": source}))
    return rows


# Variable-size codes: "s" a string (u16 length + UTF-8), "U" a list of u64 (u16 count + values).
VARIABLE = {"s": "s", "U": "U"}


def _u64s(values) -> bytes:
    """A list of u64 as little-endian bytes (OverflowError for a value out of range)."""
    if _LITTLE:
        return array.array("Q", values).tobytes()
    return struct.pack(f"<{len(values)}Q", *values)


def _str_bytes(value) -> bytes:
    return str(value).encode("utf-8", "replace")


_LITTLE = sys.byteorder == "little" and array.array("Q").itemsize == 8


class Codec:
    """Precompiled encoders/decoders for RECORDS.

    Each record type gets one generated encoder: its variable-size fields are encoded first, then
    the header, every run of fixed-size fields and each variable field's length prefix go out
    through one precompiled ``struct.Struct`` per run, joined with the variable bytes.  The
    encoders take the record name first, so a queued ``(name, *values)`` tuple is encoded with
    ``encoders[rec[0]](*rec)``.
    """

    def __init__(self, records=RECORDS):
        self.records = records
        self.by_name = {name: (tid, fields) for tid, (name, fields) in records.items()}
        self.encoders = {name: self._compile(tid, name, fields) for tid, (name, fields) in records.items()}
        # type id -> (record name, decoder): the agent decodes hundreds of records a second
        self.decoders = {tid: (name, self._compile_decoder(name, fields)) for tid, (name, fields) in records.items()}

    @staticmethod
    def _compile(tid: int, name: str, fields):
        """The encoder of one record type, as Python source compiled once."""
        params = [f"v{i}" for i in range(len(fields))]
        pre, structs, pieces = [], {}, []     # lines before the return; Struct constants; return pieces
        fmt, args, fixed = "<HH", [str(tid), "n"], 0
        for i, (_, code) in enumerate(fields):
            v = params[i]
            if code in VARIABLE:
                if code == "s":
                    # str.encode() without arguments takes CPython's fast path; anything else
                    # (not a str, lone surrogates) goes through str() and the 'replace' handler
                    pre += [f"try:", f"    b{i} = {v}.encode()", f"except Exception:",
                            f"    b{i} = _str_bytes({v})", f"if len(b{i}) > 1024:", f"    b{i} = b{i}[:1024]"]
                    count = f"len(b{i})"
                    pre.append(f"n += {count}")
                else:  # "U": u16 count + little-endian u64s
                    pre.append(f"b{i} = _u64s({v})")
                    count = f"len({v})"
                    pre.append(f"n += len(b{i})")
                fmt += "H"
                args.append(count)
                fixed += 2
                key = f"_S{len(structs)}"
                structs[key] = struct.Struct(fmt)
                pieces.append(f"{key}.pack({', '.join(args)})")
                pieces.append(f"b{i}")
                fmt, args = "<", []
            else:
                fmt += code
                args.append(v)
                fixed += struct.calcsize("<" + code)
        if args:
            key = f"_S{len(structs)}"
            structs[key] = struct.Struct(fmt)
            pieces.append(f"{key}.pack({', '.join(args)})")
        body = [f"n = {fixed}"] + pre + [f"return {' + '.join(pieces)}"]
        src = f"def encode_{name}(_name, {', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
        env = {"_u64s": _u64s, "_str_bytes": _str_bytes, **structs}
        exec(compile(src, f"<kvtrace.hook.wire {name}>", "exec"), env)
        fn = env[f"encode_{name}"]
        fn.source = src
        return fn

    @staticmethod
    def _compile_decoder(name: str, fields):
        """The decoder of one record type, as Python source compiled once: each run of fixed-size
        fields is one precompiled ``unpack_from``.  It gives what ``_decode_body`` (the reference,
        field by field) gives for every body, short and garbled ones included."""
        lines, structs, fmt, names, pos = [], {}, "<", [], "0"

        def flush_run():
            nonlocal fmt, names, pos
            if names:
                key = f"_S{len(structs)}"
                structs[key] = struct.Struct(fmt)
                lines.append(f"({', '.join(names)},) = {key}.unpack_from(body, {pos})")
                lines.append(f"pos = {pos} + {structs[key].size}")
                pos = "pos"
            fmt, names = "<", []

        for i, (_, code) in enumerate(fields):
            if code in VARIABLE:
                flush_run()
                lines.append(f"(n,) = _U16.unpack_from(body, {pos})")
                if code == "s":
                    lines.append(f"v{i} = body[{pos} + 2:{pos} + 2 + n].decode('utf-8', 'replace')")
                    lines.append(f"pos = {pos} + 2 + n")
                else:
                    lines.append(f"v{i} = list(struct.unpack_from('<%dQ' % n, body, {pos} + 2))")
                    lines.append(f"pos = {pos} + 2 + 8 * n")
                pos = "pos"
            else:
                fmt += code
                names.append(f"v{i}")
        flush_run()
        ret = "{" + ", ".join(f"{f!r}: v{i}" for i, (f, _) in enumerate(fields)) + "}"
        src = (f"def decode_{name}(body):\n    try:\n" + "".join(f"        {line}\n" for line in lines)
               + f"    except struct.error:\n        return None\n    return {ret}\n")
        env = {"struct": struct, "_U16": _U16, **structs}
        exec(compile(src, f"<kvtrace.hook.wire decode {name}>", "exec"), env)
        fn = env[f"decode_{name}"]
        fn.source = src
        return fn

    def encode(self, name: str, *values) -> bytes:
        return self.encoders[name](name, *values)

    def decode_frame(self, frame: bytes) -> list[tuple[str, dict]]:
        """Records of one frame; an unknown type is skipped by its length, a short one ends the frame."""
        if not frame.startswith(MAGIC):
            return []
        out, pos, end = [], len(MAGIC), len(frame)
        decoders, unpack = self.decoders, _HDR.unpack_from
        while pos + 4 <= end:
            tid, n = unpack(frame, pos)
            pos += 4
            body = frame[pos:pos + n]
            pos += n
            if len(body) < n:
                break
            spec = decoders.get(tid)
            if spec is None:
                continue
            rec = spec[1](body)
            if rec is not None:
                out.append((spec[0], rec))
        return out

    @staticmethod
    def _decode_body(fields, body: bytes) -> dict | None:
        """One body, field by field: the reference the compiled decoders are tested against."""
        rec, pos = {}, 0
        try:
            for field, code in fields:
                if code == "s":
                    (n,) = struct.unpack_from("<H", body, pos)
                    rec[field] = body[pos + 2:pos + 2 + n].decode("utf-8", "replace")
                    pos += 2 + n
                elif code == "U":
                    (n,) = struct.unpack_from("<H", body, pos)
                    rec[field] = list(struct.unpack_from(f"<{n}Q", body, pos + 2))
                    pos += 2 + 8 * n
                else:
                    (rec[field],) = struct.unpack_from("<" + code, body, pos)
                    pos += struct.calcsize("<" + code)
        except struct.error:
            return None
        return rec


CODEC = Codec()
