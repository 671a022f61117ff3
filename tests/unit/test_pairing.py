"""Each probes/<name>.bpf.c pairs with kvtrace/capture/<name>.py, and each decoder's numpy
mirror has exactly the C struct's fields, order, offsets and size (parsed from the C text,
so this runs without a compiler or root)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrace.capture import PROBES
from kvtrace.capture.events import HEADER

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = REPO / "probes"
CAPTURE_DIR = REPO / "kvtrace" / "capture"
SIZES = {"u8": 1, "s8": 1, "char": 1, "u16": 2, "s16": 2, "u32": 4, "s32": 4, "int": 4, "u64": 8, "s64": 8}


def c_struct_fields(text: str, name: str) -> list[tuple[str, int, int]]:
    """(field, size, align) of ``struct name`` in C text; ``struct kv_hdr h`` is expanded."""
    for macro, value in re.findall(r"#define\s+(\w+)\s+(\d+)\b", text):
        text = re.sub(r"\[%s\]" % macro, f"[{value}]", text)
    m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(name), text, re.S)
    assert m, f"struct {name} not found"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    out = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        if decl.startswith("struct kv_hdr"):
            for fname, code in HEADER:
                size = int(code[-1]) if code[-1].isdigit() else 1
                out.append((fname, size, size))
            continue
        fm = re.match(r"(\w+)\s+(\w+)(?:\[(\d+)\])?$", decl)
        assert fm, f"cannot parse {decl!r} in struct {name}"
        ctype, fname, count = fm.group(1), fm.group(2), fm.group(3)
        size = SIZES[ctype]
        out.append((fname, size * int(count or 1), size))
    return out


def layout(fields):
    off, res = 0, []
    for fname, size, align in fields:
        off = (off + align - 1) // align * align
        res.append((fname, off))
        off += size
    max_align = max(a for _, _, a in fields)
    return res, (off + max_align - 1) // max_align * max_align


def test_every_bpf_source_has_a_decoder_and_back():
    sources = {p.name[: -len(".bpf.c")] for p in PROBE_DIR.glob("*.bpf.c")}
    decoders = {p.NAME for p in PROBES}
    assert sources == decoders
    for probe in PROBES:
        assert probe.SOURCE == f"{probe.NAME}.bpf.c"
        assert (CAPTURE_DIR / f"{probe.NAME}.py").exists()
        assert probe.__name__ == f"kvtrace.capture.{probe.NAME}"


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.NAME)
def test_numpy_mirror_matches_c_struct(probe):
    text = (PROBE_DIR / "kvtrace.h").read_text() + (PROBE_DIR / probe.SOURCE).read_text()
    fields = c_struct_fields(text, probe.STRUCT)
    offsets, size = layout(fields)
    dt = probe.DTYPE
    assert [f for f, _ in offsets] == list(dt.names)
    assert [o for _, o in offsets] == [dt.fields[n][1] for n in dt.names]
    assert size == dt.itemsize


def test_only_the_loader_imports_bcc():
    offenders = []
    for path in (REPO / "kvtrace").rglob("*.py"):
        text = path.read_text()
        if re.search(r"^\s*(from bcc|import bcc)", text, re.M) and path.name not in ("loader.py", "checks.py"):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_probe_sources_ship_as_package_data():
    from kvtrace import bpf

    for probe in PROBES:
        assert (bpf.SOURCE_DIR / probe.SOURCE).is_file()
    assert (bpf.SOURCE_DIR / "kvtrace.h").is_file()
