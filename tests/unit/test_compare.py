"""`kvtrace compare` on constructed datasets: each figure is the one each run's own `analyze
--json` gives, deltas and ratios follow, gates pass and fail with exit 8, bad gates exit 2.
(Two real runs, without and with the file connector: tests/vllm/test_whatif_storage.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.analysis import compare
from kvtrace.analysis.report import analyze

from . import analysis_fixture as fx

REPO = Path(__file__).resolve().parents[2]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = fx.build(tmp_path_factory.mktemp("cmp") / "base")
    new = fx.build(tmp_path_factory.mktemp("cmp") / "new", with_arrivals=False)
    for d in (base, new):   # the miss causes come with the derived tables
        assert cli("correlate", d).returncode == 0
    return base, new


def test_figures_are_each_runs_analyze(runs):
    base, new = runs
    p = cli("compare", base, new, "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    reps = {"base": json.loads(cli("analyze", base, "--json").stdout), "new": json.loads(cli("analyze", new, "--json").stdout)}
    for f in got["figures"]:
        where = dict((n, w) for n, w, _, _ in compare.FIGURES)[f["figure"]]
        for side in ("base", "new"):
            assert f[side] == compare.figure(reps[side], where), (f["figure"], side)
        if f["base"] is not None and f["new"] is not None:
            assert f["delta"] == pytest.approx(f["new"] - f["base"])
            assert f["ratio"] == (pytest.approx(f["new"] / f["base"]) if f["base"] else None)
    by = {f["figure"]: f for f in got["figures"]}
    # no arrivals in NEW: its TTFT starts at the first step, so it is shorter than BASE's
    assert by["ttft_p50"]["new"] < by["ttft_p50"]["base"]
    assert by["ttft_p50"]["base"] == reps["base"]["service"]["ttft_p50_ns"] / 1e9
    assert got["compared"].startswith("6 requests in each run")


def test_gates_pass_fail_and_exit_8(runs, tmp_path):
    base, new = runs
    rep_b, rep_n = analyze(base), analyze(new)
    change = (rep_n["service"]["ttft_p50_ns"] / rep_b["service"]["ttft_p50_ns"] - 1) * 100
    ok = cli("compare", base, new, "--gate", f"ttft_p50<={change + 1:.1f}%", "--gate", "hit_rate>=+0")
    assert ok.returncode == 0, ok.stderr
    assert "pass" in ok.stdout and "FAIL" not in ok.stdout
    bad = cli("compare", base, new, "--gate", f"ttft_p50<={change - 1:.1f}%", "--json", "--html", tmp_path / "c.html")
    assert bad.returncode == 8, bad.stderr
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith(f"kvtrace: gate ttft_p50<={change - 1:.1f}% failed: the change is {change:+.4g}%")
    out = json.loads(bad.stdout)   # the comparison is printed before the failure
    assert out["gates"][0]["passed"] is False and not out["passed"]
    html = (tmp_path / "c.html").read_text()
    assert html.count("<svg") == 5 and "BASE" in html and "NEW" in html


@pytest.mark.parametrize("gate, why", [("ttft<=-25%", "no figure 'ttft'"), ("ttft_p50 about -25%", "write FIGURE OP CHANGE")])
def test_bad_gates_are_one_line_exit_2(runs, gate, why):
    base, new = runs
    p = cli("compare", base, new, "--gate", gate)
    assert p.returncode == 2 and why in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_missing_dataset_exits_6(runs, tmp_path):
    p = cli("compare", runs[0], tmp_path / "nothing")
    assert p.returncode == 6 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_reload_speedup_from_kvtraces_loads_else_from_the_kv_tier():
    """A run whose loads went through a KV tier (LMCache) has no kv_load rows of kvtrace's own:
    its speedup is recompute per token over the tier's L2 reads and retrieves per loaded token."""
    tier = {"reload_vs_recompute": {"retrieve": {"tokens": 512, "ms": 2.0}, "l2_read": {"tokens": 256, "ms": 3.12},
                                    "recompute": {"ms_per_token": 0.05}}}
    assert compare.figure({"reload_vs_recompute": {"speedup": 4.5}, "tier": tier}, compare._reload_speedup) == 4.5
    got = compare.figure({"reload_vs_recompute": {"speedup": None}, "tier": tier}, compare._reload_speedup)
    assert got == pytest.approx(0.05 / (5.12 / 512))
    assert compare.figure({"reload_vs_recompute": {"speedup": None}}, compare._reload_speedup) is None
    empty = {"reload_vs_recompute": {"retrieve": {"tokens": 0, "ms": 0}, "l2_read": {"tokens": 0, "ms": 0},
                                     "recompute": {"ms_per_token": 0.05}}}
    assert compare.figure({"reload_vs_recompute": {}, "tier": empty}, compare._reload_speedup) is None
