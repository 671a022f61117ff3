"""KvtraceFileConnector against a real vLLM CPU server (tiny random-weight Llama, token-id
prompts), plus an in-process round trip through the connector in vLLM's interpreter.

The server scenario runs once (module-scoped server); each test checks one aspect against an
independent source: vLLM's responses and /metrics, /proc/<worker>/io, the files on disk,
vLLM's hashing rule, and KV that vLLM computes after a load.

The dummy weights give flat logits (every logprob is -ln(32000)), so greedy token ids do not
depend on the KV: a negative control below shows that wrong KV leaves them unchanged.  KV
correctness is therefore checked on the KV itself: layer 1's K/V of tokens computed after a
load are a function of the loaded layer-0 K/V (through attention), and must come out
byte-identical to those computed without any load.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtrace.demo.server import TINY_LLAMA, VllmServer, vllm_python, write_tiny_model
from tests.helpers import free_port

pytestmark = pytest.mark.skipif(
    not os.path.exists(vllm_python()),
    reason=f"needs the vLLM CPU venv ({vllm_python()}; make setup-vllm)",
)

BLOCK = 32
NUM_BLOCKS = 122
PROMPT = 1000
FULL = (PROMPT - 1) // BLOCK  # 31 blocks: vLLM recomputes the last prompt token
# Independent of the connector: layers x K/V x heads x block tokens x head dim x bf16 bytes.
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
LAYER_BLOCK_BYTES = 2 * TINY_LLAMA["num_key_value_heads"] * BLOCK * HEAD_DIM * 2
BLOCK_BYTES = TINY_LLAMA["num_hidden_layers"] * LAYER_BLOCK_BYTES  # 65,536

# --kv-cache-memory-bytes 8000000 is what gives 122 blocks, but VllmServer exports
# VLLM_CPU_KVCACHE_SPACE=1, which vLLM's CPU platform lets override it; the block-count
# override pins 122 blocks either way.  122 blocks hold 3,904 tokens, less than the
# 4,096-token default max length, hence --max-model-len.
COMMON = [
    "--block-size", str(BLOCK), "--enable-prefix-caching", "--max-num-batched-tokens", "256",
    "--kv-cache-memory-bytes", "8000000", "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--max-model-len", "2048", "--enable-prompt-tokens-details",
]


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def proc_io(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def vllm_block_hashes(tokens: list[int]) -> list[str]:
    """vLLM 0.32's prefix-cache hashes (sha256 over pickle of (parent, block tokens, extra
    keys); the first parent derives from PYTHONHASHSEED or "vllm-none-hash")."""
    h = lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()  # noqa: E731
    parent = h(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    out = []
    for i in range(len(tokens) // BLOCK):
        parent = h((parent, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), None))
        out.append(parent.hex())
    return out


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 16) -> dict:
    r = server.complete(prompt, max_tokens=max_tokens, return_token_ids=True, ignore_eos=True)
    c = r["choices"][0]
    return {"tokens": c["token_ids"], "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}


def connector_importable() -> str | None:
    """vLLM's processes import the connector from their own venv (kvtrace installed editable)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('kvtrace') else 3)"
    r = subprocess.run([vllm_python(), "-c", probe], capture_output=True, timeout=60)
    if r.returncode == 3:
        return f"kvtrace is not installed in the vLLM venv: {Path(vllm_python()).parent}/pip install --no-deps -e <repo>"
    return None if r.returncode == 0 else f"the vLLM venv does not run: {r.stderr.decode(errors='replace')[-300:]}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = connector_importable()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("fileconnector")
    blocks, stats = base / "blocks", base / "stats"
    cfg = {
        "kv_connector": "KvtraceFileConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvtrace.hook.vllm.fileconnector",
        "kv_connector_extra_config": {"path": str(blocks), "stats_dir": str(stats)},
    }
    server = VllmServer(args=[*COMMON, "--kv-transfer-config", json.dumps(cfg)], port=free_port(8200, 8299),
                        workdir=base / "server")
    server.start(timeout=600)
    try:
        yield scenario(server, blocks, stats)
    finally:
        server.stop()


def layer_halves(data: bytes) -> tuple[bytes, bytes]:
    return data[:LAYER_BLOCK_BYTES], data[LAYER_BLOCK_BYTES:]


def scenario(server: VllmServer, blocks: Path, stats: Path) -> dict:
    rng = random.Random(20240603)
    prompt = lambda: [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(PROMPT)]  # noqa: E731
    worker = server.processes()["workers"][0]
    res: dict = {"blocks": blocks}
    A, G, H = prompt(), prompt(), prompt()
    hashes = {name: vllm_block_hashes(p)[:FULL] for name, p in (("A", A), ("G", G), ("H", H))}
    res["hashes"] = hashes
    res["A1"] = complete(server, A)
    res["files_after_A1"] = sorted(f for f in os.listdir(blocks) if f != "layout.json")
    res["G1"] = complete(server, G)
    complete(server, H)
    # 5 x 32 fresh blocks > 122: every block of A, G and H leaves the local prefix cache.
    for _ in range(5):
        complete(server, prompt(), max_tokens=1)

    # 1. A again: all 31 blocks come from the files.
    m0, io0 = server.metrics(), proc_io(worker)
    res["A2"] = complete(server, A)
    m1, io1 = server.metrics(), proc_io(worker)
    res["io"] = {k: io1[k] - io0[k] for k in io0}
    res["metrics"] = {
        key: metric(m1, name, **lab) - metric(m0, name, **lab)
        for key, name, lab in [
            ("external_hits", "vllm:external_prefix_cache_hits_total", {}),
            ("by_source_external", "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
            ("by_source_local", "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
            ("cached_disk", "vllm:prompt_tokens_cached_by_source_total", {"source": "disk"}),
        ]
    }
    res["worker_stats_A2"] = json.loads((stats / "worker.json").read_text())

    # 2. H without its last 11 block files: 20 blocks load, 11 are computed on top of them and
    #    stored again; keep the first run's bytes to compare.
    res["H_tail_before"] = {h: (blocks / h).read_bytes() for h in hashes["H"][20:]}
    for h in hashes["H"][20:]:
        (blocks / h).unlink()
    res["H2"] = complete(server, H)
    res["H_tail_after"] = {h: (blocks / h).read_bytes() for h in hashes["H"][20:] if (blocks / h).exists()}

    # 3. Negative control, the same with G, but G's first 20 files hold A's KV (right size,
    #    wrong content).
    res["G_tail_before"] = {h: (blocks / h).read_bytes() for h in hashes["G"][20:]}
    for h in hashes["G"][20:]:
        (blocks / h).unlink()
    for hg, ha in zip(hashes["G"][:20], hashes["A"][:20]):
        shutil.copyfile(blocks / ha, blocks / hg)
    res["G2"] = complete(server, G)
    res["G_tail_after"] = {h: (blocks / h).read_bytes() for h in hashes["G"][20:] if (blocks / h).exists()}

    res["worker_stats"] = json.loads((stats / "worker.json").read_text())
    res["files"] = {f: (blocks / f).stat().st_size for f in os.listdir(blocks)}
    res["layout"] = json.loads((blocks / "layout.json").read_text())
    return res


def test_reload_comes_from_the_files(run):
    # vLLM's own accounting: 31 blocks (992 tokens; never the last prompt token) from the
    # connector, none from the local prefix cache.
    assert run["A1"]["cached"] == 0
    assert run["A2"]["cached"] == FULL * BLOCK == 992
    assert run["metrics"] == {"external_hits": 992, "by_source_external": 992, "by_source_local": 0,
                              "cached_disk": 992}
    # The kernel's count of bytes the Worker read while A2 ran: the 31 block files, plus a
    # few hundred bytes of unrelated reads.
    want = FULL * BLOCK_BYTES
    assert want <= run["io"]["rchar"] < want + 16384, run["io"]
    assert run["io"]["syscr"] >= FULL
    s = run["worker_stats_A2"]
    assert (s["load_blocks"], s["load_bytes"], s.get("load_errors", 0)) == (FULL, want, 0)


def test_kv_computed_after_a_load_matches_kv_computed_without_one(run):
    before, after = run["H_tail_before"], run["H_tail_after"]
    assert run["H2"]["cached"] == 20 * BLOCK
    assert sorted(after) == sorted(before) and len(after) == 11
    for h in before:
        assert after[h] == before[h], f"block {h[:12]} differs after loading the prefix"
    # The completion smoke check the brief asks for (uninformative here: flat logits).
    assert run["A2"]["tokens"] == run["A1"]["tokens"] and len(run["A2"]["tokens"]) == 16


def test_wrong_kv_is_detected_by_that_check(run):
    # Negative control.  The wrong files have the right size, so they load (the format has no
    # checksum).  Layer 0's K/V depend only on token and position: unchanged.  Layer 1's
    # depend on the loaded prefix: changed.  The greedy tokens do not notice.
    before, after = run["G_tail_before"], run["G_tail_after"]
    assert run["G2"]["cached"] == 20 * BLOCK
    assert len(after) == 11
    for h in before:
        l0_before, l1_before = layer_halves(before[h])
        l0_after, l1_after = layer_halves(after[h])
        assert l0_after == l0_before
        assert l1_after != l1_before
    assert run["G2"]["tokens"] == run["G1"]["tokens"]


def test_one_file_per_block_named_by_hash(run):
    files, layout = run["files"], run["layout"]
    assert layout["layers"] == [f"model.layers.{i}.self_attn.attn" for i in range(TINY_LLAMA["num_hidden_layers"])]
    assert (layout["block_bytes"], layout["layer_block_bytes"]) == (BLOCK_BYTES, LAYER_BLOCK_BYTES)
    blocks = {f: n for f, n in files.items() if f != "layout.json"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", f) for f in blocks), sorted(blocks)[:5]
    assert set(blocks.values()) == {BLOCK_BYTES}
    # A's first run stored exactly A's 31 full blocks (1000 prompt + 15 fed output tokens =
    # 1015 tokens with KV), under vLLM's own chained hashes.
    assert run["files_after_A1"] == sorted(run["hashes"]["A"])
    # A, G, H and 5 evicting prompts, 31 blocks each; nothing half-written left over.
    assert len(blocks) == 8 * FULL
    s = run["worker_stats"]
    assert s["store_blocks"] == 8 * FULL + 11 + 11  # + H's and G's tails, stored again
    assert s["store_bytes"] == s["store_blocks"] * BLOCK_BYTES
    assert s.get("store_errors", 0) == 0 and s.get("load_errors", 0) == 0


# ---------------------------------------------------------------------------------------
# In-process: the connector's two halves driven directly, in vLLM's interpreter.

ROUND_TRIP = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace as NS
    import torch
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvtrace.hook.vllm.fileconnector import BlockTransfer, FileConnectorMetadata, KvtraceFileConnector

    model, d = sys.argv[1], sys.argv[2]
    NB, names = 8, ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kvt = KVTransferConfig(kv_connector="KvtraceFileConnector", kv_role="kv_both",
                           kv_connector_module_path="kvtrace.hook.vllm.fileconnector",
                           kv_connector_extra_config={"path": d})
    vc = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                    max_model_len=2048, kv_transfer_config=kvt).create_engine_config()

    def kv_config(heads):
        spec = FullAttentionSpec(block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)
        page = spec.page_size_bytes
        return KVCacheConfig(num_blocks=NB, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                             kv_cache_tensors=[KVCacheTensor(size=NB * 2 * page, layers=names,
                                                             layer_stride=NB * page, block_stride=page)])

    out = {}
    w = KvtraceFileConnector(vc, KVConnectorRole.WORKER, kv_config(4))
    torch.manual_seed(0)
    kv = {n: torch.randn(NB, 4, 32, 128).to(torch.bfloat16) for n in names}
    w.register_kv_caches(kv)
    h = [f"{i:02x}" * 32 for i in range(1, 7)]

    def step(loads=(), stores=()):
        w.bind_connector_metadata(FileConnectorMetadata(loads=list(loads), stores=list(stores)))
        w.start_load_kv(None)
        w.wait_for_save()
        err = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        return sorted(err)

    def expected(b):  # layer 0's block, then layer 1's, each in [heads, tokens, 2*head_dim] order
        return b"".join(bytes(kv[n][b].contiguous().view(torch.uint8).flatten().tolist()) for n in names)

    def read(x):
        p = os.path.join(d, x)
        return open(p, "rb").read() if os.path.exists(p) else None

    out["store_err"] = step(stores=[BlockTransfer("r1", [(2, h[0]), (5, h[1])])])
    out["stored_bytes_equal"] = [read(h[0]) == expected(2), read(h[1]) == expected(5)]
    for n in names:
        kv[n][6].zero_(); kv[n][7].zero_()
    out["load_err"] = step(loads=[BlockTransfer("r1", [(6, h[0]), (7, h[1])])])
    out["loaded_equal"] = [torch.equal(kv[n][6], kv[n][2]) and torch.equal(kv[n][7], kv[n][5]) for n in names]
    # A missing file in the middle: it and the blocks after it are reported, the request's
    # stores in that step are dropped, another request's stores go ahead.
    for n in names:
        kv[n][0].zero_()
    out["fail_err"] = step(loads=[BlockTransfer("r2", [(0, h[0]), (1, "ee" * 32), (3, h[1])])],
                           stores=[BlockTransfer("r2", [(4, h[2])]), BlockTransfer("r3", [(4, h[3])])])
    out["fail_first_loaded"] = all(torch.equal(kv[n][0], kv[n][2]) for n in names)
    out["fail_stores"] = [read(h[2]) is None, read(h[3]) == expected(4)]
    # A short file: reported and removed.
    open(os.path.join(d, h[4]), "wb").write(b"x" * 100)
    out["short_err"] = step(loads=[BlockTransfer("r4", [(0, h[4])])])
    out["short_removed"] = read(h[4]) is None
    out["worker_stats"] = w.stats.c

    s = KvtraceFileConnector(vc, KVConnectorRole.SCHEDULER, kv_config(4))
    hb = [bytes.fromhex(x) for x in (h[0], h[1], h[3])] + [bytes(32)]  # files exist for 3 blocks
    req = lambda rid, ntok, nhash, done=0: NS(request_id=rid, block_hashes=hb[:nhash], num_tokens=ntok,
                                              num_computed_tokens=done)
    out["match_3_of_4"] = s.get_num_new_matched_tokens(req("a", 133, 4), 0)
    out["match_not_last_token"] = s.get_num_new_matched_tokens(req("b", 96, 3), 0)
    out["match_after_local"] = s.get_num_new_matched_tokens(req("c", 133, 4), 32)
    s.update_state_after_alloc(req("c", 133, 4), NS(get_block_ids=lambda: ([10, 11, 12, 13, 14],)), 64)
    running = req("d", 200, 4, done=40)
    s.on_new_request(running)
    so = NS(num_scheduled_tokens={"d": 60}, scheduled_spec_decode_tokens={},
            kv_connector_block_state=NS(get_block_ids=lambda rid: ([20, 21, 22, 23],)))
    meta = s.build_connector_meta(so)
    out["meta_loads"] = [(j.req_id, j.blocks) for j in meta.loads]
    out["meta_stores"] = [(j.req_id, j.blocks) for j in meta.stores]
    out["failure_policy"] = vc.kv_transfer_config.kv_load_failure_policy
    try:
        KvtraceFileConnector(vc, KVConnectorRole.WORKER, kv_config(2))
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    base = tmp_path_factory.mktemp("fileconnector-inproc")
    model = write_tiny_model(base / "tiny-llama")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([vllm_python(), "-c", ROUND_TRIP, str(model), str(base / "blocks")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=base)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][7:])


def test_round_trip_bytes(round_trip):
    r = round_trip
    assert r["store_err"] == [] and r["stored_bytes_equal"] == [True, True]
    assert r["load_err"] == [] and r["loaded_equal"] == [True, True]
    s = r["worker_stats"]
    assert (s["store_blocks"], s["store_bytes"]) == (3, 3 * BLOCK_BYTES)


def test_load_failure_is_reported_for_recompute(round_trip):
    r = round_trip
    assert r["fail_err"] == [1, 3]
    assert r["fail_first_loaded"] is True
    assert r["fail_stores"] == [True, True]
    assert r["short_err"] == [0] and r["short_removed"] is True
    assert r["worker_stats"]["load_errors"] == 2
    assert r["failure_policy"] == "recompute"


def test_scheduler_matches_and_plans(round_trip):
    r = round_trip
    h = [f"{i:02x}" * 32 for i in range(1, 7)]
    assert r["match_3_of_4"] == [96, False]
    assert r["match_not_last_token"] == [64, False]  # 3 blocks on disk, 96-token prompt
    assert r["match_after_local"] == [64, False]
    assert r["meta_loads"] == [["c", [[11, h[1]], [12, h[3]]]]]
    # 40 tokens done + 60 this step: blocks 1 and 2 become full.
    assert r["meta_stores"] == [["d", [[21, h[1]], [22, h[3]]]]]
    assert "another KV layout" in r["mismatch"] and "num_kv_heads" in r["mismatch"]
