"""`kvtrace whatif` on two real datasets (tests/data/recorded/README.md: a vLLM 0.32.0 and an SGLang
0.5.23 server, closed-loop clients sharing prefixes) gives exactly what the kvtrace that recorded
them gave (expected/<name>.whatif.json at the recorded cache size, .whatif-half.json at half of
it), every figure but those the README says vary (the dataset's path, the replay's own time);
and at the recorded size the replay admits the requests in the recorded order."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.analysis import whatif
from tests import closed_loop

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"
# dataset -> its recorded cache size, half of it (what expected/*.whatif-half.json was made with)
SIZES = {"vllm-0.32.0": (130, 65), "sglang-0.5.23": (3000, 1500)}


def comparable(res: dict) -> dict:
    """The output as `whatif --json` prints it, less what varies between runs of one kvtrace."""
    res = json.loads(json.dumps(res))
    res.pop("dataset")
    for p in res["predictions"]:
        del p["replay_s"], p["lookups_per_s"]
    return res


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("suffix", ["whatif", "whatif-half"])
def test_the_replay_is_what_the_recording_kvtrace_gave(name, suffix):
    recorded, half = SIZES[name]
    expected = comparable(json.loads((RECORDED / "expected" / f"{name}.{suffix}.json").read_text()))
    assert expected["recorded"]["cache_blocks"] == recorded
    got = whatif.run(RECORDED / name, cache_blocks=[half] if suffix == "whatif-half" else None)
    assert comparable(got) == expected


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_recorded_size_admits_in_the_recorded_order(name):
    rate, order, recorded_order = closed_loop.replay_at(RECORDED / name, SIZES[name][0])
    expected = json.loads((RECORDED / "expected" / f"{name}.whatif.json").read_text())
    assert rate == expected["recorded"]["hit_rate"]
    assert order == recorded_order and len(order) == 24
