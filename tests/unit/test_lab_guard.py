"""The storage lab's table guard (tests/lab/test_lab.py, Lab.table), without booting the lab:
a table of the schema missing from the dataset fails the check that needs it, naming the
table (a skip would leave CI green while kvtrace stopped writing it); a name the schema does
not have is a bug in the lab's tests and fails too.  No root."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from kvtrace.dataset import schema
from tests.lab.test_lab import Lab

LAB = Path(__file__).resolve().parents[1] / "lab" / "test_lab.py"


def outcome(lab: Lab, name: str) -> tuple[str, str]:
    """What lab.table(name) does to the check calling it: ok, fail or skip, and the message."""
    try:
        return "ok", str(lab.table(name))
    except pytest.fail.Exception as e:
        return "fail", str(e)
    except pytest.skip.Exception as e:
        return "skip", str(e)


def lab_with(*names: str) -> Lab:
    ds = SimpleNamespace(names=lambda: sorted(names), table=lambda n: pa.table({"ctrl": ["nvme0"]}))
    return Lab(out=Path("."), reader={}, ds=ds, ftrace=[], timings={})


def test_a_schema_table_missing_from_the_dataset_fails_naming_it():
    lab = lab_with("block_io", "file_io")
    assert outcome(lab, "block_io") == ("ok", "[{'ctrl': 'nvme0'}]")
    assert outcome(lab, "nvme_cmd") == ("fail", "the dataset has no nvme_cmd table: kvtrace did not write it")


def test_a_name_the_schema_does_not_have_fails():
    kind, msg = outcome(lab_with("nvme_cmds"), "nvme_cmds")
    assert kind == "fail" and "'nvme_cmds' is no table of the dataset schema" in msg


def test_every_table_the_lab_checks_is_in_the_schema():
    used = set(re.findall(r'lab\.table\("(\w+)"\)', LAB.read_text()))
    assert len(used) == 10 and used <= set(schema.TABLES), used - set(schema.TABLES)
