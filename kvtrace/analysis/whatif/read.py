"""`kvtrace whatif`'s workload from a recorded dataset: the requests (requests.py), the server kind
recorded, the recorded figures and step times (recorded.py), the storage model (storage.py)."""
from __future__ import annotations

import pyarrow as pa

from kvtrace.analysis import load
from kvtrace.analysis.whatif.lmcache import fit as fit_tier
from kvtrace.analysis.whatif.recorded import clock, figures, fit_steps, ttft
from kvtrace.analysis.whatif.requests import chains, closed_loop, first_hits, recorded_requests
from kvtrace.analysis.whatif.storage import fit, quiet_steps
from kvtrace.analysis.whatif.workload import Workload
from kvtrace.correlate.hybrid import Hybrid
from kvtrace.errors import DatasetError


def workload(directory) -> Workload:
    inp = load.scan(directory)
    if not inp.has("prompt_blocks"):
        raise DatasetError(f"{directory} has no prompt_blocks records: whatif needs each request's prompt block hashes "
                           "(recorded by the kvtrace hook at first admission)")
    kind = server_kind(directory, inp)
    notes = [g for g in inp.gaps if "prompt_blocks" not in g and "token_causes" not in g]
    prompts, b0 = chains(directory, load.read_table(inp, "prompt_blocks"))
    steps = load.read_table(inp, "step")
    reqs, finish_at = recorded_requests(inp, kind, prompts, steps, notes)
    closed = closed_loop(reqs, finish_at)
    rec = figures(inp, kind, steps, b0)
    storage = fit(inp)
    quiet = quiet_steps(steps, inp)
    model = fit_steps(steps.filter(pa.array(quiet)) if steps.num_rows and quiet.sum() >= 3 else steps)
    rec["ttft"] = ttft(inp, steps)
    tier = fit_tier(inp, storage.block_bytes, b0)
    rec["storage_tier"] = tier.spec() if tier.recorded else "file" if storage.loads else "none"
    notes = notes + [f"{closed} of {len(reqs)} requests replayed closed-loop at other settings"]
    return Workload(reqs, b0, rec, model, notes + ([f"storage: {storage.note}"] if storage.note else []), storage,
                    clock(steps, reqs, finish_at), first_hits(inp, b0), kind=kind, tier=tier, groups=groups(inp))


def groups(inp: load.Inputs) -> dict:
    """The recorded KV cache groups (kv_group rows of the first engine), group -> GroupSpec."""
    t = load.read_table(inp, "kv_group")
    if not t.num_rows:
        return {}
    rows = t.to_pylist()
    pid = rows[0]["pid"]
    return {int(r["group"]): Hybrid().group(r).specs[int(r["group"])] for r in rows if r["pid"] == pid}


def server_kind(directory, inp: load.Inputs) -> str:
    """The one server kind the dataset recorded (its cache is the model replayed)."""
    kinds = load.server_kinds(inp)
    if len(kinds) != 1:
        said = f"several server kinds ({', '.join(kinds)})" if kinds else "no server kind"
        raise DatasetError(f"{directory} records {said}: whatif replays the requests of one server kind at a time")
    return kinds[0]
