"""Decoder for probes/ulib.bpf.c: calls into user-space KV transfer libraries (UCX, cuFile,
NIXL) caught by uprobes (table ``ulib_calls``).  Opt-in: ``kvtrace attach --uprobe ucx``
(or ``cufile``, ``nixl``; ``LIB=PATH`` names the library file)."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_ULIB, DecodeContext, decode_array, struct_dtype
from kvtrace.host import tracefs

NAME = "ulib"
KIND = KIND_ULIB
SOURCE = "ulib.bpf.c"
STRUCT = "kv_ulib_event"
TABLE = "ulib_calls"
DTYPE = struct_dtype(
    [
        ("ts_entry", "<u8"),
        ("bytes", "<u8"),
        ("arg", "<u8"),
        ("ret", "<i8"),
        ("func", "<u4"),
        ("pad", "<u4"),
    ]
)
# library -> (file name prefixes, [(symbol, BPF function, symbol is a regex)]); "libucp-": a
# wheel's renamed copy (auditwheel: libucp-b39b3ed9.so.0.0.0 in nixl-cu12)
LIBS = {
    "ucx": (("libucp.so", "libucp-"), [("ucp_put_nbx", "kv_ulib_ucp_put", False), ("ucp_get_nbx", "kv_ulib_ucp_get", False)]),
    "cufile": (("libcufile.so", "libcufile-"), [("cuFileRead", "kv_ulib_cufile_read", False), ("cuFileWrite", "kv_ulib_cufile_write", False)]),
    "nixl": (("libnixl.so",), [(r".*nixlAgent.*postXferReq.*", "kv_ulib_nixl_post", True)]),
}
FUNCS = {1: ("ucx", "ucp_put_nbx"), 2: ("ucx", "ucp_get_nbx"), 3: ("cufile", "cuFileRead"), 4: ("cufile", "cuFileWrite"),
         5: ("nixl", "postXferReq")}
# Set by `kvtrace attach --uprobe LIB[=PATH]` before the program is planned: lib -> path or None.
requested: dict[str, str | None] = {}


def config(tp) -> tuple[list[str], str | None]:
    if not requested:
        return [], "not asked for (--uprobe ucx|cufile|nixl)"

    base = tracefs.root()
    if base is None or not (base / "uprobe_events").exists():
        return [], "uprobes unavailable (CONFIG_UPROBE_EVENTS off)"
    return [], None


def mapped(pids, prefixes) -> list[str]:
    """Library files the processes have mapped whose names start with ``prefixes``, as paths
    the host can open (through /proc/PID/root for processes in containers)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5]
            if os.path.basename(path).startswith(prefixes):
                host = f"/proc/{pid}/root{path}"
                p = path if os.path.exists(path) and os.path.samefile(path, host) else host
                if p not in out:
                    out.append(p)
    return out


def attach(bpf, pids, libs: dict[str, str | None] | None = None) -> tuple[list[str], list[str]]:
    """Attach entry and return probes to the asked-for libraries; (notes, warnings)."""
    notes, warnings = [], []
    for lib, path in (libs if libs is not None else requested).items():
        prefixes, funcs = LIBS[lib]
        paths = [path] if path else mapped(pids, prefixes)
        if not paths:
            warnings.append(f"--uprobe {lib}: no {prefixes[0]}* mapped by the traced processes; "
                            f"name it: --uprobe {lib}=/path/to/{prefixes[0]}")
            continue
        for p in paths:
            n = 0
            for sym, fn, regex in funcs:
                try:
                    kw = {"sym_re": sym} if regex else {"sym": sym}
                    bpf.attach_uprobe(name=p, fn_name=fn, **kw)
                    bpf.attach_uretprobe(name=p, fn_name=fn + "_ret", **kw)
                    n += 1
                except Exception as e:
                    warnings.append(f"--uprobe {lib}: {sym} in {p}: {e}")
            if n:
                notes.append(f"uprobes on {lib} ({p}: {n} function{'s' if n > 1 else ''})")
    return notes, warnings


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    names = [FUNCS.get(int(f), ("", str(int(f)))) for f in a["func"]]
    return pa.table({
        "ts_ns": pa.array(a["ts"], pa.uint64()),
        "entry_ns": pa.array(a["ts_entry"], pa.uint64()),
        "latency_ns": pa.array(a["ts"].astype(np.int64) - a["ts_entry"].astype(np.int64), pa.int64()),
        "pid": pa.array(a["tgid"], pa.uint32()),
        "tid": pa.array(a["tid"], pa.uint32()),
        "lib": pa.array([n[0] for n in names], pa.string()),
        "func": pa.array([n[1] for n in names], pa.string()),
        "bytes": pa.array(a["bytes"], pa.uint64()),
        "arg": pa.array(a["arg"], pa.uint64()),
        "ret": pa.array(a["ret"], pa.int64()),
    })
