"""The hook's cost per engine step, measured in vLLM's own interpreter (run by bench/overhead.py).

A real vLLM Scheduler (v1, chunked prefill at 256 tokens, prefix caching, 122 blocks of 32
tokens: the configuration of the benchmark server) is driven through bench/overhead.py's own
round (bench/stream.py: the same prompts, output lengths and concurrency, so the steps measured
here are the kind the hook is charged for there) to completion, with a model-runner stand-in
that samples one token per request and step and makes a Worker's calls on a KV connector that
does nothing (the hook's Worker wrappers run on them as on the server's file connector).  The same stream is run with the hook not
installed ("none"), installed with no agent ("detached") and installed with a live agent
("attached"; the records go out as marker writes, caught by the agent's BPF program when this
runs under `kvtrace attach`), interleaved round by round.  The cost per step is the difference
of the per-step times.  The stand-in's steps are short, so "attached" sends almost no frame;
"attached_write_each_step" sends one per step, and the difference is the cost of one marker
write (`write_cost_us`).

    <vllm python> bench/hookstep.py [--short] [--layers N] --rounds 5 --json out.json      (under kvtrace attach)

``--baseline DIR``: the hook of another checkout (``git worktree add DIR REV``) is run too, as
"detached_baseline" and "attached_baseline", alternated round by round with this one's modes,
so a change to the hook is measured against the hook before it in one run (the baseline runs
from its own checkout's files: kvtrace/hook/vllm/hook.py, or kvtrace/hook/vllm_hook.py in a
checkout without kvtrace/hook/vllm/).

Standard library and vLLM only (kvtrace's hook and workload are imported from the repository
by path).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK, BLOCKS, BUDGET = 32, 122, 256
KV_HEADS, HEAD_SIZE = 4, 64   # every kvtrace.demo.server.MODELS preset's attention layers


def make_scheduler_factory():
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtrace.demo.server import write_tiny_model   # the tests' and the demo's model

    tmp = tempfile.mkdtemp(prefix="kvtrace-hookstep-")
    atexit.register(shutil.rmtree, tmp, True)
    model = str(write_tiny_model(tmp))
    args = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, block_size=BLOCK,
                      enable_prefix_caching=True, max_num_batched_tokens=BUDGET, max_model_len=2048,
                      num_gpu_blocks_override=BLOCKS)
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = BLOCKS      # what the engine sets after profiling
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)

    def new():
        kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                         block_size=BLOCK, log_stats=True)

    return new, hasher


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


LAYERS = layer_names(2)   # the tiny model's attention layers (--layers: another model's count)


def make_connector():
    """A KV connector on vLLM's own base class that does nothing, made this process's live
    connector, so install() patches its class as it patches the benchmark server's connector
    (kvtrace's file connector).  run_stream makes a Worker's connector calls on it each step:
    bind_connector_metadata, start_load_kv, wait_for_layer_load per layer, wait_for_save."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class IdleConnector(KVConnectorBase_V1):
        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def wait_for_save(self):
            pass

    IdleConnector.__abstractmethods__ = frozenset()   # the scheduler-side methods are never called here
    conn = object.__new__(IdleConnector)              # (its __init__ wants a whole VllmConfig)
    conn.meta = KVConnectorMetadata()
    kv_transfer_state._KV_CONNECTOR_AGENT = conn
    return conn


def make_requests(hasher, short: bool):
    """bench/overhead.py's round (bench/stream.py) as vLLM Requests: the same prompts, the
    same output lengths, in the same order."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from stream import requests

    return [Request(request_id=r.rid, prompt_token_ids=list(r.prompt),
                    sampling_params=SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0),
                    pooling_params=None, block_hasher=hasher) for r in requests(short)]


def run_stream(new_scheduler, hasher, short: bool, concurrency: int, times: list | None = None,
               conn=None) -> tuple[int, float]:
    """The benchmark's round through a fresh scheduler; (steps, seconds spent in schedule +
    update, and in the connector calls on ``conn`` when given).  ``times`` gets each step's
    seconds (the stream is deterministic: step i is the same work in every round and mode)."""
    from vllm.v1.outputs import ModelRunnerOutput

    sched = new_scheduler()
    pending = make_requests(hasher, short)
    steps, spent = 0, 0.0
    rng = random.Random(1)
    perf = time.perf_counter
    while pending or sched.has_unfinished_requests():
        while pending and len(sched.running) + len(sched.waiting) < concurrency:
            sched.add_request(pending.pop(0))
        t0 = perf()
        so = sched.schedule()
        t1 = perf()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([rng.randrange(100, 31000)] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)
        worker = 0.0
        if conn is not None:   # the Worker's step: what the model runner calls on its connector
            t4 = perf()
            conn.bind_connector_metadata(conn.meta)
            conn.start_load_kv(None)
            for layer in LAYERS:
                conn.wait_for_layer_load(layer)
            conn.wait_for_save()
            worker = perf() - t4
        t2 = perf()
        sched.update_from_output(so, mro)
        t3 = perf()
        step = (t1 - t0) + worker + (t3 - t2)
        spent += step
        if times is not None:
            times.append(step)
        steps += 1
    return steps, spent


def load_baseline(checkout: str):
    """The vLLM hook module of another checkout, imported under a name of its own."""
    import importlib.util

    path = os.path.join(checkout, "kvtrace", "hook", "vllm", "hook.py")
    if not os.path.exists(path):
        path = os.path.join(checkout, "kvtrace", "hook", "vllm_hook.py")
    spec = importlib.util.spec_from_file_location("kvtrace_baseline_hook", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short", action="store_true", help="the short round of bench/overhead.py --short")
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, default=2, help="attention layers: wait_for_layer_load calls per Worker step")
    ap.add_argument("--baseline", help="another checkout whose hook runs too (modes *_baseline)")
    a = ap.parse_args()
    LAYERS[:] = layer_names(a.layers)
    import logging

    logging.disable(logging.WARNING)
    sys.path.insert(0, REPO)
    from stream import CONCURRENCY
    from kvtrace.hook import transport
    from kvtrace.hook.vllm import hook

    new_scheduler, hasher = make_scheduler_factory()
    conn = make_connector()
    live_flag = hook.T.flag_path
    attached_possible = transport.agent_alive(live_flag)
    nowhere = tempfile.mkdtemp(prefix="kvtrace-noagent-")   # a flag with no live agent in it

    base = load_baseline(a.baseline) if a.baseline else None

    def mode(name: str) -> None:
        h, other = (base, hook) if name.endswith("_baseline") else (hook, base)
        if other is not None and other.status()["installed"]:
            other.uninstall()
        if name == "none":
            h.uninstall()
            return
        if not h.status()["installed"]:
            assert h.install(roles=["engine", "worker"]), h.status()
        h.T.flag_path = live_flag if name.startswith("attached") else nowhere
        h.T.next_check = 0                 # re-read the flag at the next step
        # this stand-in's steps take ~0.2 ms, so at the hook's own interval it sends a frame only
        # at the end of a stream; "attached_write_each_step" sends one every step (a real
        # server's ~20 ms steps send one per few): the difference is the cost of a send
        # (the engine's and the worker's wrappers each read their own module's interval)
        h.engine.FLUSH_EVERY_NS = h.worker.FLUSH_EVERY_NS = 0 if name == "attached_write_each_step" else flush_every

    flush_every = hook.FLUSH_EVERY_NS
    modes = ["none", "detached"] + (["attached", "attached_write_each_step"] if attached_possible else [])
    if base is not None:
        modes += ["detached_baseline"] + (["attached_baseline"] if attached_possible else [])
    run_stream(new_scheduler, hasher, a.short, CONCURRENCY, conn=conn)   # warm-up
    per_step = {m: [] for m in modes}
    fastest = {m: None for m in modes}   # per step: its fastest time over the rounds
    steps_seen = {}
    for _ in range(a.rounds):
        for m in modes:
            mode(m)
            times = []
            steps, spent = run_stream(new_scheduler, hasher, a.short, CONCURRENCY, times, conn)
            per_step[m].append(spent / steps * 1e6)
            steps_seen[m] = steps
            f = fastest[m]
            fastest[m] = times if f is None or len(f) != len(times) else [min(x, y) for x, y in zip(f, times)]
    emitted = hook.T.emitted
    hook.uninstall()
    if base is not None:
        base.uninstall()
    med = {m: statistics.median(v) for m, v in per_step.items()}
    # the cost: per round, this mode's time per step minus the hook-free one's of the same round
    diffs = {m: sorted(x - y for x, y in zip(per_step[m], per_step["none"])) for m in modes if m != "none"}
    result = {
        "steps_per_stream": steps_seen, "rounds": a.rounds, "short": a.short,
        "per_step_us": {m: [round(x, 2) for x in v] for m, v in per_step.items()},
        "median_step_us": {m: round(v, 2) for m, v in med.items()},
        "hook_cost_us": {m: round(statistics.median(d), 2) for m, d in diffs.items()},
        "hook_cost_quartiles_us": {m: [round(q, 2) for q in statistics.quantiles(d, n=4)] if len(d) > 1 else [d[0]] * 3
                                   for m, d in diffs.items()},
        "hook_cost_spread_us": {m: [round(d[0], 2), round(d[-1], 2)] for m, d in diffs.items()},
        # robust to a loaded machine: each step's fastest time over the rounds, summed per stream
        # (a step slowed by other processes in one round is taken from another round)
        "fastest_step_us": {m: round(sum(f) / len(f) * 1e6, 2) for m, f in fastest.items()},
        "hook_cost_fastest_us": {m: round((sum(fastest[m]) / len(fastest[m]) - sum(fastest["none"]) / len(fastest["none"])) * 1e6, 2)
                                 for m in modes if m != "none"},
        "records_emitted": emitted, "attached_measured": attached_possible, "layers": len(LAYERS),
    }
    if attached_possible:   # one marker write, from the per-round differences of the two attached modes
        writes = sorted(x - y for x, y in zip(per_step["attached_write_each_step"], per_step["attached"]))
        result["write_cost_us"] = round(statistics.median(writes), 2)
        result["write_cost_fastest_us"] = round(result["hook_cost_fastest_us"]["attached_write_each_step"]
                                                - result["hook_cost_fastest_us"]["attached"], 2)
    text = json.dumps(result, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
