"""Find exported symbols of a mapped ELF file (x86-64, ELF64) in a running process."""
from __future__ import annotations

import struct
from pathlib import Path

from kvtrace.errors import KvtraceError, TargetError
from kvtrace.host import confined

SHT_SYMTAB, SHT_DYNSYM = 2, 11
ET_EXEC = 2


ELF_LIMIT = 1 << 30


def symbols(path: str | Path, wanted: set[str]) -> tuple[int, dict[str, int]]:
    """(ELF type, {name: st_value}) for the wanted names found in .dynsym or .symtab.  ``path``
    is read as the file it names (``/proc/PID/map_files/…``: the very file mapped, whatever
    now lies at its name), regular and at most ELF_LIMIT bytes, without blocking."""
    data = confined.read_regular(None, str(path), ELF_LIMIT, follow=True)
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise TargetError(f"{path} is not a 64-bit ELF file")
    e_type = struct.unpack_from("<H", data, 16)[0]
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    found: dict[str, int] = {}
    for sh in sections:
        if sh[1] not in (SHT_DYNSYM, SHT_SYMTAB):
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        off, size, entsize = sh[4], sh[5], sh[9] or 24
        for i in range(size // entsize):
            st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", data, off + i * entsize)
            if not st_value or st_shndx == 0:
                continue
            end = data.index(b"\0", str_off + st_name)
            name = data[str_off + st_name:end].decode("ascii", "replace")
            if name in wanted and name not in found:
                found[name] = st_value
        if wanted <= found.keys():
            break
    return e_type, found


def resolve(pid: int, names: set[str]) -> dict[str, int]:
    """Run-time addresses of names in pid: from libpython if it is mapped, else the executable."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    files: dict[str, int] = {}
    ranges: dict[str, str] = {}   # a mapping of each file, to open it by /proc/PID/map_files
    order: list[str] = []
    for line in maps:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        start = int(parts[0].split("-")[0], 16)
        offset = int(parts[2], 16)
        path = parts[5].strip()
        ranges.setdefault(path, "-".join(f"{int(x, 16):x}" for x in parts[0].split("-")))
        if path not in files:
            order.append(path)
            files[path] = start - offset if offset == 0 else files.get(path, start - offset)
        elif offset == 0:
            files[path] = min(files[path], start)
    candidates = [p for p in order if "libpython3" in p] + [p for p in order if "/python" in p and "libpython" not in p]
    for path in candidates:
        try:
            e_type, syms = symbols(f"/proc/{pid}/map_files/{ranges[path]}", names)
        except (OSError, KvtraceError, struct.error, ValueError, IndexError):
            continue
        if names <= syms.keys():
            base = 0 if e_type == ET_EXEC else files[path]
            return {n: base + v for n, v in syms.items()}
    raise TargetError(f"process {pid} exports no {', '.join(sorted(names))} (not a CPython process?)")
