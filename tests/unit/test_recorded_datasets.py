"""Datasets written before the run row named the server (schema version 1) still analyse to the
same report.  `kvtrace analyze --json` and `kvtrace compare --json` of this kvtrace, on datasets
recorded by a real vLLM 0.32.0 and a real SGLang 0.5.23 server (tests/data/recorded/) and on an
older vLLM capture without engine records or /metrics (tests/data/vllm-otlp-capture), equal
what the kvtrace that recorded them gave (tests/data/recorded/expected/; its README says how they
were made).  Only the keys that README names as varying are left out: the run time and the
dataset path.  Also checked: the server kind and the /metrics samples kvtrace.analysis.load reads
from them (docs/schema.md, "Datasets of version 1")."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kvtrace.analysis import load
from kvtrace.dataset import schema
from kvtrace.dataset.reader import Dataset

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
RECORDED = DATA / "recorded"
EXPECTED = RECORDED / "expected"
DATASETS = {"vllm-0.32.0": RECORDED / "vllm-0.32.0", "sglang-0.5.23": RECORDED / "sglang-0.5.23",
            "vllm-otlp-capture": DATA / "vllm-otlp-capture"}


def cli_json(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def expected(name: str) -> dict:
    return json.loads((EXPECTED / f"{name}.json").read_text())


# Figures kvtrace added after these datasets were recorded (tests/data/recorded/README.md): left
# out of what this kvtrace says before comparing, wherever they appear (a key, or a row naming it).
ADDED = {"miss_tier_partial", "miss_other_engine", "miss_group", "miss_match_unit", "miss_spec_dropped",
         "mapped_files", "engines", "by_group"}


def without(rep: dict, *keys: str) -> dict:
    """rep without the keys that vary from run to run, and without ADDED."""
    return {k: _old(v) for k, v in rep.items() if k not in keys and k not in ADDED}


def _old(x):
    if isinstance(x, dict):
        return {k: _old(v) for k, v in x.items() if k not in ADDED}
    if isinstance(x, list):
        return [_old(v) for v in x if not (isinstance(v, dict) and v.get("figure") in ADDED)]
    return x


@pytest.mark.parametrize("name", DATASETS)
def test_the_datasets_are_of_version_1(name):
    assert set(Dataset.open(DATASETS[name]).run_versions().values()) == {1}


@pytest.mark.parametrize("name", DATASETS)
def test_analyze_gives_the_report_of_the_kvtrace_that_recorded_it(name):
    got = cli_json("analyze", DATASETS[name], "--json")
    assert without(got, "elapsed_s", "dataset") == without(expected(f"{name}.analyze"), "elapsed_s", "dataset")


def test_compare_gives_the_comparison_of_the_kvtrace_that_recorded_them():
    got = cli_json("compare", DATASETS["vllm-0.32.0"], DATASETS["sglang-0.5.23"], "--json")
    want = expected("vllm-0.32.0-vs-sglang-0.5.23.compare")
    for side in ("base", "new"):
        got[side], want[side] = without(got[side], "dataset"), without(want[side], "dataset")
    assert without(got) == want


@pytest.mark.parametrize("name,kinds,table", [
    ("vllm-0.32.0", ["vllm"], "vllm_metrics"),         # its engine record, and vllm_metrics
    ("sglang-0.5.23", ["sglang"], "sglang_metrics"),   # its engine record, and sglang_metrics
    ("vllm-otlp-capture", ["vllm"], None),             # hook records without an engine record: a hook before 5
])
def test_the_kind_and_metrics_of_a_version_1_dataset(name, kinds, table):
    inp = load.scan(DATASETS[name])
    assert load.server_kinds(inp) == kinds
    m = load.server_metrics(inp)
    assert m.schema == load.METRICS
    if table is None:
        assert m.num_rows == 0
        return
    old = load.read_table(inp, table)
    assert m.num_rows == old.num_rows > 0 and set(m.column("kind").to_pylist()) == set(kinds)
    cols = ["ts_ns", "name", "labels", "value"]
    assert repr(m.select(cols).to_pylist()) == repr(old.select(cols).to_pylist())   # repr: NaN samples too
    assert set(m.column("run").to_pylist()) == set(old.column("run").cast(pa.string()).to_pylist())


def test_a_version_1_dataset_correlated_again_stays_version_1(tmp_path):
    """`kvtrace correlate` of this kvtrace writes version 2 derived tables into the version 1
    dataset: the run is still read by the rules of version 1, to the same report."""
    ds = shutil.copytree(DATASETS["vllm-0.32.0"], tmp_path / "ds")
    r = subprocess.run([sys.executable, "-m", "kvtrace", "correlate", str(ds)], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    opened = Dataset.open(ds)
    assert {f.version for f in opened.footers["token_causes"].values()} == {schema.SCHEMA_VERSION}
    assert set(opened.run_versions().values()) == {1}
    assert load.server_kinds(load.scan(ds)) == ["vllm"]
    got = cli_json("analyze", ds, "--json")
    assert without(got, "elapsed_s", "dataset") == without(expected("vllm-0.32.0.analyze"), "elapsed_s", "dataset")
