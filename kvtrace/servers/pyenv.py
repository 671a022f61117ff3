"""The Python environment of a server (vLLM, SGLang), read from outside through /proc/PID/root (so a
container's own filesystem): where its site-packages are, its Python and engine versions, and
whether the kvtrace plugin is installed there.

Every file is read confined (``_Fs``): a FIFO, device, link or oversized file where a
pyvenv.cfg, METADATA, entry_points.txt or RECORD should be raises UnsafePath (discovery then
lists the process as unreadable), and no link leads out of the server's root.
"""
from __future__ import annotations

import configparser
import errno
import os
import re
from pathlib import Path

from kvtrace.host import confined

PLUGIN_NAME = "kvtrace"
READ_LIMIT = 1 << 20          # a config, a dist-info's small files, a _version.py
METADATA_LIMIT = 4 << 20      # METADATA / PKG-INFO (the long description is in it)
RECORD_LIMIT = 16 << 20       # RECORD: a line per installed file
CFG_LIMIT = 64 << 10          # pyvenv.cfg
BINARY_HEAD = 64 << 20        # the part of the interpreter's binary searched for its version
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM)


class _Fs:
    """Paths of one process's mount namespace, read confined (kvtrace.host.confined): beneath
    /proc/PID/root held open, directory links followed only inside it, and every file read a
    regular file (no link, FIFO or device), opened without blocking, of at most a set size.
    A file that is absent (or not ours to read) is None; one that is unsafe raises UnsafePath.
    Close it (or use it as a context manager)."""

    def __init__(self, pid: int):
        self.root = f"/proc/{pid}/root"
        try:
            self._root = confined.Root(self.root)
            self.usable = True
            theirs, ours = os.fstat(self._root.fd), os.stat("/")
            self.container = (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)
        except (confined.UnsafePath, OSError):
            self._root, self.usable, self.container = confined.Root("/"), False, False

    def __enter__(self) -> "_Fs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_root", None) is not None:
            self._root.close()

    def show(self, path: str) -> str:
        """The path as read from here: /proc/PID/root/… (or itself where that cannot be used)."""
        return self._root.show(_abs(path))

    def p(self, path: str) -> Path:
        return Path(self.show(path))

    def opendir(self, path: str) -> int | None:
        """An fd of the directory (links followed inside the root only); None when absent."""
        try:
            return self._root.opendir(_abs(path), follow_links=True)
        except confined.UnsafePath as e:
            if _absent(e):
                return None
            raise

    def exists(self, path: str) -> bool:
        head, name = os.path.split(_abs(path))
        fd = self.opendir(head)
        if fd is None:
            return False
        try:
            if name:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def read_bytes(self, path: str, limit: int = READ_LIMIT, head: bool = False) -> bytes | None:
        """The file's bytes; None when absent; UnsafePath when it is not a regular file or is
        over ``limit`` bytes (``head``: its first ``limit`` bytes)."""
        d, name = os.path.split(_abs(path))
        fd = self.opendir(d)
        if fd is None:
            return None
        try:
            return confined.read_regular(fd, name, limit, shown=self.show(path), head=head)
        except confined.UnsafePath as e:
            if _absent(e):
                return None
            raise
        finally:
            os.close(fd)

    def read(self, path: str, limit: int = READ_LIMIT) -> str | None:
        data = self.read_bytes(path, limit)
        return None if data is None else data.decode("utf-8", "replace")

    def listdir(self, path: str) -> list[str]:
        fd = self.opendir(path)
        if fd is None:
            return []
        try:
            return sorted(os.listdir(fd))
        except OSError:
            return []
        finally:
            os.close(fd)


def _abs(path: str) -> str:
    return path if path.startswith("/") else "/" + path


def _absent(e: confined.UnsafePath) -> bool:
    """True when a refusal only says the file is not there (or not ours to read), not that it
    is unsafe: the OSError it was raised from."""
    cause = e.__context__
    return isinstance(cause, OSError) and cause.errno in _ABSENT


def _mapped_paths(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            out = []
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    out.append(parts[5].strip().removesuffix(" (deleted)"))
            return list(dict.fromkeys(out))
    except OSError:
        return []


def _resolve_arg0(fs: _Fs, arg0: str, cwd: str | None, env: dict) -> str | None:
    if "/" in arg0:
        return arg0 if arg0.startswith("/") else os.path.normpath(os.path.join(cwd or "/", arg0))
    for d in (env.get("PATH") or "/usr/local/bin:/usr/bin:/bin").split(":"):
        if d and fs.exists(f"{d}/{arg0}"):
            return f"{d}/{arg0}"
    return None


def _site_candidates(fs: _Fs, pid: int, arg0: str | None, exe: str | None, xy: str | None, env: dict,
                     package: str = "vllm") -> tuple[list[str], str | None]:
    """(site-packages directories to look in, venv root or None), for the engine's ``package``."""
    cands: list[str] = []
    # PYTHONPATH comes before site-packages in the import path: a vLLM there is the one imported
    # (its mapped libraries may be links into a site-packages)
    for pp in (env.get("PYTHONPATH") or "").split(":"):
        if pp.startswith("/") and fs.exists(f"{pp}/{package}/__init__.py"):
            cands.append(pp)
    maps = _mapped_paths(pid)
    for m in maps:
        hit = re.search(rf"^(.*/(?:site|dist)-packages)/{package}/", m)
        if hit:
            cands.append(hit.group(1))
    for m in maps:
        hit = re.search(r"^(.*/(?:site|dist)-packages)/", m)
        if hit:
            cands.append(hit.group(1))
    venv = None
    if arg0:
        bindir = os.path.dirname(arg0)
        root = os.path.dirname(bindir)
        if fs.exists(f"{root}/pyvenv.cfg"):
            venv = root
    for pp in (env.get("PYTHONPATH") or "").split(":"):
        if pp.startswith("/"):
            cands.append(pp)
    vers = [xy] if xy else []
    for base in [venv, env.get("VIRTUAL_ENV"), os.path.dirname(os.path.dirname(exe)) if exe else None]:
        if not base:
            continue
        for v in vers or [d.removeprefix("python") for d in fs.listdir(f"{base}/lib") if d.startswith("python3")]:
            cands += [f"{base}/lib/python{v}/site-packages", f"{base}/local/lib/python{v}/dist-packages"]
    cands += ["/usr/lib/python3/dist-packages"] + [f"/usr/local/lib/python{v}/dist-packages" for v in vers]
    return list(dict.fromkeys(cands)), venv


def _python_version(fs: _Fs, pid: int, exe: str | None, venv: str | None, site: str | None) -> str | None:
    """X.Y.Z of the server's interpreter: pyvenv.cfg, patchlevel.h, or the version string in the binary."""
    xy = None
    for s in [exe or "", site or ""] + [m for m in _mapped_paths(pid) if "libpython" in m]:
        hit = re.search(r"python(3\.\d+)", s)
        if hit:
            xy = hit.group(1)
            break
    if venv:
        cfg = fs.read(f"{venv}/pyvenv.cfg", CFG_LIMIT) or ""
        hit = re.search(r"^\s*version(?:_info)?\s*=\s*(\d+\.\d+\.\d+\S*)", cfg, re.M)
        if hit:
            return hit.group(1)
    if exe:
        prefix = os.path.dirname(os.path.dirname(exe))
        for inc in ([f"{prefix}/include/python{xy}/patchlevel.h"] if xy else []):
            text = fs.read(inc) or ""
            hit = re.search(r'#define\s+PY_VERSION\s+"([^"]+)"', text)
            if hit:
                return hit.group(1)
    if xy:
        pat = re.compile(rb"(?<![\d.])(" + re.escape(xy.encode()) + rb"\.\d{1,3}(?:(?:a|b|rc)\d+)?\+?)\x00")
        for binary in [exe] + [m for m in _mapped_paths(pid) if "libpython" in m]:
            if not binary:
                continue
            data = fs.read_bytes(binary, BINARY_HEAD, head=True) or b""
            found = [m.group(1).decode() for m in pat.finditer(data)]
            if found:
                return max(set(found), key=found.count)
    return xy


def _dist_infos(fs: _Fs, site: str) -> list[str]:
    return [d for d in fs.listdir(site) if d.endswith((".dist-info", ".egg-info"))]


def package_version(fs: _Fs, site: str, package: str) -> str | None:
    """The version of the server kind's ``package`` ("vllm", "sglang") installed in ``site``."""
    for d in _dist_infos(fs, site):
        if not re.match(rf"^{package}([_-][a-z0-9]+)?-\d", d):
            continue
        top = fs.read(f"{site}/{d}/top_level.txt")
        record = None if top else fs.read(f"{site}/{d}/RECORD", RECORD_LIMIT)
        if (top and package in top.split()) or (record and f"{package}/__init__.py" in record) or (not top and not record):
            meta = fs.read(f"{site}/{d}/METADATA", METADATA_LIMIT) or fs.read(f"{site}/{d}/PKG-INFO", METADATA_LIMIT) or ""
            hit = re.search(r"^Version:\s*(\S+)", meta, re.M)
            if hit:
                return hit.group(1)
            hit = re.match(r"^[^-]+-([^-]+?)(?:\.dist-info|\.egg-info|-py)", d)
            if hit:
                return hit.group(1)
    for name in ("_version.py", "version.py"):
        text = fs.read(f"{site}/{package}/{name}") or ""
        hit = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        if hit:
            return hit.group(1)
    return None


def plugin_installed(fs: _Fs, sites: list[str], group: str) -> bool:
    """True when some dist in these directories declares entry point ``kvtrace`` in ``group``
    (vllm.general_plugins; sglang.srt.plugins for SGLang)."""
    for site in sites:
        for d in _dist_infos(fs, site):
            text = fs.read(f"{site}/{d}/entry_points.txt")
            if not text or group not in text:
                continue
            cp = configparser.ConfigParser(delimiters=("=",), interpolation=None, strict=False)
            cp.optionxform = str
            try:
                cp.read_string(text)
            except configparser.Error:
                continue
            if cp.has_section(group) and any(k.strip() == PLUGIN_NAME for k in cp[group]):
                return True
    return False
