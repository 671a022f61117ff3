"""Tracepoint format files (``events/<system>/<event>/format``): parse them, and read or
build raw tracepoint records by them.

bcc generates each TRACEPOINT_PROBE's argument struct from the same files at compile time,
so a record laid out by a format here is what the BPF program reads on that kernel.  The
probes' ``config()`` use the parsed fields to pick variants; the tests build records for the
layouts of several kernels and check the pairing rules and decoders against them.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from kvtrace.host import tracefs

_FIELD = re.compile(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);\s*signed:(?P<signed>-?\d+);")
_INT = {1: "b", 2: "h", 4: "i", 8: "q"}


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str          # declared type, e.g. "u16", "char", "const void *"
    offset: int
    size: int
    signed: bool
    count: int = 0      # array length (0: scalar)
    data_loc: bool = False

    @property
    def is_bytes(self) -> bool:
        """char/u8 arrays are read as bytes."""
        return self.count > 0 and self.size == self.count

    def unpack(self, rec: bytes):
        raw = rec[self.offset:self.offset + self.size]
        if len(raw) < self.size:
            raise ValueError(f"record too short for {self.name}")
        if self.data_loc:  # u32: offset in the low 16 bits, length in the high 16
            (loc,) = struct.unpack("<I", raw[:4])
            start, length = loc & 0xFFFF, loc >> 16
            return rec[start:start + length].split(b"\0", 1)[0]
        if self.is_bytes:
            return bytes(raw)
        if self.count:
            width = self.size // self.count
            code = _INT[width] if self.signed else _INT[width].upper()
            return list(struct.unpack(f"<{self.count}{code}", raw))
        code = _INT.get(self.size)
        if code is None:
            return bytes(raw)
        return struct.unpack("<" + (code if self.signed else code.upper()), raw)[0]

    def pack_into(self, buf: bytearray, value) -> None:
        if self.is_bytes or self.data_loc:
            data = bytes(value)[: self.size]
            buf[self.offset:self.offset + len(data)] = data
            return
        if self.count:
            width = self.size // self.count
            code = _INT[width] if self.signed else _INT[width].upper()
            vals = list(value) + [0] * (self.count - len(value))
            struct.pack_into(f"<{self.count}{code}", buf, self.offset, *vals)
            return
        code = _INT[self.size]
        mask = (1 << (8 * self.size)) - 1
        struct.pack_into("<" + code.upper(), buf, self.offset, int(value) & mask)


@dataclass
class Format:
    system: str
    name: str
    id: int
    fields: dict[str, Field] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.fields

    @property
    def size(self) -> int:
        """Bytes of a record (the last field's end, rounded up to 8)."""
        end = max((f.offset + f.size for f in self.fields.values()), default=0)
        return (end + 7) // 8 * 8

    def decode(self, rec: bytes) -> dict:
        """Every field of one record, common_* included."""
        return {n: f.unpack(rec) for n, f in self.fields.items()}

    def encode(self, values: dict, pid: int = 0) -> bytes:
        """A record with these field values (others zero), as the kernel would lay it out."""
        buf = bytearray(self.size)
        if "common_type" in self.fields:
            self.fields["common_type"].pack_into(buf, self.id)
        if "common_pid" in self.fields:
            self.fields["common_pid"].pack_into(buf, pid)
        for name, value in values.items():
            f = self.fields.get(name)
            if f is None:
                continue  # a field this kernel's layout does not have
            f.pack_into(buf, value)
        return bytes(buf)


def _split_decl(decl: str) -> tuple[str, str, int, bool]:
    decl = decl.strip()
    data_loc = decl.startswith("__data_loc")
    if data_loc:
        decl = decl[len("__data_loc"):].strip()
    count = 0
    m = re.search(r"\[(\w*)\]\s*$", decl)
    if m:
        count = int(m.group(1)) if m.group(1).isdigit() else 0
        decl = decl[: m.start()].rstrip()
    m = re.match(r"(.*?)([A-Za-z_]\w*)$", decl)
    if not m:
        raise ValueError(f"cannot read field declaration {decl!r}")
    return m.group(1).strip(), m.group(2), count, data_loc


def parse(text: str, system: str = "", name: str = "") -> Format:
    """Parse a format file's text.  Raises ValueError on text that is not one."""
    fmt = Format(system, name, 0)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("name:"):
            fmt.name = line.split(":", 1)[1].strip()
        elif line.startswith("ID:"):
            fmt.id = int(line.split(":", 1)[1])
        elif line.startswith("field:"):
            m = _FIELD.search(line)
            if not m:
                raise ValueError(f"cannot read format line {line!r}")
            ctype, fname, count, data_loc = _split_decl(m.group("decl"))
            size = int(m.group("size"))
            if count == 0 and "[" in m.group("decl") and not data_loc:
                count = size  # "[]" with the size given by the kernel
            fmt.fields[fname] = Field(fname, ctype, int(m.group("off")), size, m.group("signed") == "1", count, data_loc)
    if not fmt.fields:
        raise ValueError("no fields: not a tracepoint format file")
    return fmt


def read(system: str, event: str, root=None) -> Format | None:
    """The format of ``system:event`` from tracefs (or a tree with the same layout at ``root``)."""
    from pathlib import Path

    if root is None:

        root = tracefs.root()
        if root is None:
            return None
    try:
        text = (Path(root) / "events" / system / event / "format").read_text()
    except OSError:
        return None
    try:
        return parse(text, system, event)
    except ValueError:
        return None


def field_names(system: str, event: str, root=None) -> set[str] | None:
    fmt = read(system, event, root)
    return None if fmt is None else set(fmt.fields)
