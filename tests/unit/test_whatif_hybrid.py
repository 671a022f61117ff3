"""`kvtrace whatif`'s model of a hybrid model's block pool (kvtrace.analysis.whatif.hybridpool)
on a hand-made workload whose hits follow from vLLM's hybrid rule: full attention's cached
prefix, cut where the sliding-window group lacks the blocks before it; that group keeps (by its
default retention) only the blocks before a prompt's end and before a shared-prefix junction."""
from __future__ import annotations

import pytest

from kvtrace.analysis.whatif import Replay, Req, Workload
from kvtrace.correlate.hybrid import GroupSpec
from kvtrace.errors import UsageError

SEC = 1_000_000_000
B = 4
GROUPS = {0: GroupSpec("full_attention", B, 0, B, B, 0), 1: GroupSpec("sliding_window", B, 2 * B, B, B, 0)}


def workload(*chains, groups=GROUPS) -> Workload:
    reqs = [Req(f"r{i}", i * SEC, len(c) * B + 1, 1, list(c)) for i, c in enumerate(chains)]
    return Workload(reqs, B, {}, (1e6, 0.0, 0.0), [], kind="vllm", groups=groups)


def test_the_window_group_cuts_a_shared_prefix_until_a_junction_is_pinned():
    a = ["a0", "a1", "a2", "a3", "a4", "a5"]
    b, c = a[:4] + ["b4", "b5"], a[:4] + ["c4", "c5"]
    s = Replay(workload(a, b, c, a), chunk=256, block=B, cache_blocks=200).run()
    # A: cold.  B: full attention holds 4 blocks, the window group only A's blocks 4-5 (before
    # its end): hit 0; B pins the junction at token 16.  C: 16.  A again: its 6 blocks, the
    # window's 4-5 still there: 24.  (One cache of full attention alone would give B 16.)
    assert s["hit_local"] == 0 + 0 + 16 + 24
    one_group = Replay(workload(a, b, c, a, groups={}), chunk=256, block=B, cache_blocks=200).run()
    assert one_group["hit_local"] == 0 + 16 + 16 + 24


def test_dense_retention_keeps_every_window_block():
    dense = {g: GroupSpec(s.kind, s.block_size, s.window, s.align, s.hash_block, -1) for g, s in GROUPS.items()}
    a = ["a0", "a1", "a2", "a3", "a4", "a5"]
    s = Replay(workload(a, a[:4] + ["b4", "b5"], groups=dense), chunk=256, block=B, cache_blocks=200).run()
    assert s["hit_local"] == 16


def test_refusals():
    with pytest.raises(UsageError, match="recorded block size"):
        Replay(workload(["a0"]), 256, 2 * B, 200)
    mamba = {**GROUPS, 1: GroupSpec("mamba", B, 0, B, B, 0)}
    with pytest.raises(UsageError, match="also has mamba"):
        Replay(workload(["a0"], groups=mamba), 256, B, 200)
