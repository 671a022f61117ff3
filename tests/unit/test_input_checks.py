"""Input a hostile user tried, each refused with one line and a documented exit code before
anything is attached, read or allocated: time options (nan, inf, 0, negative, below the stated
minimum), OTLP URLs and timeouts, whatif settings (block counts, storage tiers, a cache too
large to replay), the --raw-out file's mode, and a full disk under --raw-out."""
from __future__ import annotations

import errno
import os
import stat
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtrace.errors import OutputError, UsageError

from .test_analysis import whatif_ds


def one_line(r, code: int) -> str:
    """The single stderr line of a refused command (exit `code`, no traceback)."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("kvtrace: ")
    return r.stderr


@pytest.fixture(scope="module")
def wds(tmp_path_factory) -> Path:
    return whatif_ds(tmp_path_factory.mktemp("iq") / "w")


# ---------------------------------------------------------------------------------------------
# attach: --flush-interval, --duration, --metrics-interval (one type, kvtrace/commands/params.py)

@pytest.mark.parametrize("option,value,bound", [
    ("--flush-interval", "nan", "at least 0.1"), ("--flush-interval", "0", "at least 0.1"),
    ("--flush-interval", "-1", "at least 0.1"), ("--flush-interval", "0.05", "at least 0.1"),
    ("--flush-interval", "inf", "at least 0.1"),
    ("--duration", "nan", "more than 0"), ("--duration", "0", "more than 0"), ("--duration", "-5", "more than 0"),
    ("--duration", "inf", "more than 0"),
    ("--metrics-interval", "nan", "at least 0.1"), ("--metrics-interval", "0", "at least 0.1"),
    ("--metrics-interval", "-inf", "at least 0.1"),
])
def test_attach_refuses_bad_seconds_before_attaching(tmp_path, kvtrace_cli, option, value, bound):
    out = tmp_path / "ds"
    msg = one_line(kvtrace_cli("attach", "--out", str(out), option, value, "--", "true"), 2)
    assert f"Invalid value for '{option}': {value} is out of range: give a finite number of seconds, {bound}" in msg
    assert not out.exists()  # refused while parsing: no dataset, nothing attached


def test_attach_refuses_a_word_for_seconds(tmp_path, kvtrace_cli):
    msg = one_line(kvtrace_cli("attach", "--out", str(tmp_path / "ds"), "--flush-interval", "soon", "--", "true"), 2)
    assert "'--flush-interval': 'soon' is not a number: give a finite number of seconds, at least 0.1" in msg


def test_attach_help_states_the_bounds(kvtrace_cli):
    r = kvtrace_cli("attach", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # as wrapped to any width
    assert "--flush-interval SECONDS Seconds between Parquet part files, at least 0.1 " in text
    assert "--metrics-interval SECONDS Seconds between /metrics scrapes, at least 0.1 " in text
    assert "--duration SECONDS Stop after this many seconds (more than 0)." in text


def test_seconds_type_accepts_what_it_should():
    from kvtrace.commands.params import Seconds

    assert Seconds(0.1).convert("0.1", None, None) == 0.1
    assert Seconds().convert("1e-3", None, None) == 0.001
    assert Seconds().convert(30.0, None, None) == 30.0  # the defaults go through it too


# ---------------------------------------------------------------------------------------------
# OTLP: URLs (one function, parse_endpoint, for attach --otlp and export --otlp) and --timeout

BAD_URLS = [
    ("notaurl", "is not an http(s)://host:port URL"),
    ("localhost:4317", "is not an http(s)://host:port URL"),
    ("ftp://x", "is not an http(s)://host:port URL"),
    ("http://", "is not an http(s)://host:port URL"),
    ("http:/host:4317", "is not an http(s)://host:port URL"),
    ("http://[zz]:4317", "is not an http(s)://host:port URL (bad [address])"),
    ("http://a b:4317", "has a bad host name 'a b'"),
    ("http://host:0", "has a bad port: give a number from 1 to 65535"),
    ("http://host:99999", "has a bad port: give a number from 1 to 65535"),
    ("http://host:43x7", "has a bad port: give a number from 1 to 65535"),
    ("http://user:pw@host:4317", "credentials in the URL are not sent"),
]


@pytest.mark.parametrize("url,words", BAD_URLS)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_parse_endpoint_refuses(url, words, protocol):
    from kvtrace.otlp.exporter import parse_endpoint

    with pytest.raises(UsageError) as e:
        parse_endpoint(url, protocol)
    assert str(e.value).startswith(f"--otlp {url!r}") and words in str(e.value) and "\n" not in str(e.value)


def test_parse_endpoint_accepts():
    from kvtrace.otlp.exporter import parse_endpoint

    assert parse_endpoint("http://127.0.0.1:4317", "grpc") == {"protocol": "grpc", "target": "127.0.0.1:4317", "secure": False}
    assert parse_endpoint("https://collector.example", "grpc")["target"] == "collector.example:4317"
    assert parse_endpoint("http://[::1]:9", "grpc")["target"] == "[::1]:9"
    ep = parse_endpoint(" HTTP://Collector_1:4318/base/v1/traces ", "http")
    assert (ep["host"], ep["port"], ep["traces"], ep["metrics"]) == ("collector_1", 4318, "/base/v1/traces", "/base/v1/metrics")
    assert parse_endpoint("https://c.example", "http")["port"] == 443


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_export_refuses_a_bad_url_before_reading_the_dataset(tmp_path, kvtrace_cli, protocol):
    # no dataset there at all: the URL is refused first (2), not the dataset (6) nor a DNS look-up (7)
    msg = one_line(kvtrace_cli("export", str(tmp_path / "none"), "--otlp", "notaurl", "--otlp-protocol", protocol), 2)
    assert "--otlp 'notaurl' is not an http(s)://host:port URL: give e.g. http://localhost:4317" in msg


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_export_refuses_a_bad_timeout(tmp_path, kvtrace_cli, value):
    msg = one_line(kvtrace_cli("export", str(tmp_path / "none"), "--otlp", "http://127.0.0.1:4317", "--timeout", value), 2)
    assert f"Invalid value for '--timeout': {value} is out of range: give a finite number of seconds, more than 0" in msg


def test_attach_refuses_a_bad_otlp_url_before_attaching(tmp_path, kvtrace_cli):
    out = tmp_path / "ds"
    msg = one_line(kvtrace_cli("attach", "--out", str(out), "--otlp", "http://host:0", "--", "true"), 2)
    assert "--otlp 'http://host:0' has a bad port" in msg
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# whatif: the settings, checked before the dataset is read

@pytest.mark.parametrize("option,value,words", [
    ("--chunk-size", "0", "'--chunk-size': 0 is too small: give whole numbers of at least 1"),
    ("--chunk-size", "nan", "'--chunk-size': 'nan' is not a whole number"),
    ("--chunk-size", "256,,512", "'--chunk-size': '' is not a whole number"),
    ("--block-size", "-32", "'--block-size': -32 is too small: give whole numbers of at least 1"),
    ("--block-size", "0", "'--block-size': 0 is too small"),
    ("--block-size", "inf", "'--block-size': 'inf' is not a whole number"),
    ("--cache-blocks", "1", "'--cache-blocks': 1 is too small: give whole numbers of at least 2"),
    ("--cache-blocks", "1.5", "'--cache-blocks': '1.5' is not a whole number"),
    ("--storage-tier", "file:-3", "--storage-tier 'file:-3': BLOCKS must be a whole number above 0"),
    ("--storage-tier", "file:0", "--storage-tier 'file:0': BLOCKS must be a whole number above 0"),
    ("--storage-tier", "file:2.5", "--storage-tier 'file:2.5': BLOCKS must be a whole number above 0"),
    ("--storage-tier", "file:", "--storage-tier 'file:': BLOCKS must be a whole number above 0"),
    ("--storage-tier", "none:4", "--storage-tier 'none:4': give none, file[:BLOCKS][@READ_GBPS[/LATENCY_US]]"),
    ("--storage-tier", "nvme", "--storage-tier 'nvme': give none, file[:BLOCKS][@READ_GBPS[/LATENCY_US]]"),
])
def test_whatif_refuses_bad_settings_before_reading(tmp_path, kvtrace_cli, option, value, words):
    # no dataset there: the setting is refused first (2), not the dataset (6)
    assert words in one_line(kvtrace_cli("whatif", str(tmp_path / "none"), option, value), 2)


def test_whatif_refuses_a_cache_it_cannot_allocate(tmp_path, kvtrace_cli):
    # 10^12 blocks: numpy would fail to allocate 7.3 TiB for the first array, with a traceback
    msg = one_line(kvtrace_cli("whatif", str(tmp_path / "none"), "--cache-blocks", "1000000000000"), 2)
    assert "--cache-blocks 1000000000000: the replay's block pool would need up to 112.8 TiB, more than the limit of " in msg
    assert "(50% of MemAvailable); give fewer blocks" in msg


def test_whatif_memory_bound_names_setting_bytes_and_limit(wds, monkeypatch):
    from kvtrace.analysis import whatif
    from kvtrace.units import human_bytes

    monkeypatch.setattr(whatif, "memory_limit", lambda: (1 << 20, "a test limit"))
    with pytest.raises(UsageError) as e:
        whatif.run(wds, chunk_sizes=[256], cache_blocks=[7, 100_000])
    need = whatif.BlockPool.bytes_for(100_000)
    assert str(e.value) == (f"--cache-blocks 100000: the replay's block pool would need up to {human_bytes(need)}, "
                            f"more than the limit of 1.0 MiB (a test limit); give fewer blocks")
    # the recorded cache size (the default) is bounded too: 10 free blocks + the null block
    monkeypatch.setattr(whatif, "memory_limit", lambda: (1000, "a test limit"))
    with pytest.raises(UsageError, match=r"^--cache-blocks 11: "):
        whatif.run(wds, chunk_sizes=[256])
    monkeypatch.setattr(whatif, "memory_limit", lambda: (whatif.BlockPool.bytes_for(7), "a test limit"))
    assert [p["cache_blocks"] for p in whatif.run(wds, chunk_sizes=[256], cache_blocks=[7])["predictions"]] == [7]


def test_whatif_memory_limit_is_half_of_memavailable(tmp_path):
    from kvtrace.analysis import whatif

    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    assert whatif.memory_limit(str(f)) == (8000000 * 1024 // 2, "50% of MemAvailable")
    assert whatif.memory_limit(str(tmp_path / "absent")) == (4 << 30, "the fixed limit without /proc/meminfo")


def test_block_pool_estimate_bounds_what_it_allocates(wds, monkeypatch):
    """BlockPool.bytes_for is an upper bound of what the pool's arrays take, measured (numpy
    reports its buffers to tracemalloc): a replay of a large cache, and a free queue made to
    compact again and again."""
    from kvtrace.analysis import whatif
    from kvtrace.analysis.whatif import FreeQueue

    compactions = []
    compact = FreeQueue._compact
    monkeypatch.setattr(FreeQueue, "_compact", lambda self: (compactions.append(1), compact(self)))
    wl = whatif.workload(wds)
    n = 200_000
    tracemalloc.start()
    try:
        whatif.Replay(wl, 256, 32, n).run()
        replay_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        fq = FreeQueue(n)
        for i in range(200):
            blocks = fq.pop(n // 50)
            (fq.extend_front if i % 3 == 0 else fq.extend)(blocks)
        queue_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(compactions) >= 2
    assert replay_peak <= whatif.BlockPool.bytes_for(n)
    assert queue_peak <= FreeQueue.bytes_for(n)


def test_tier_python_api_refuses_like_the_cli():
    from kvtrace.analysis.whatif import Tier

    assert (Tier("file:8").on, Tier("file:8").cap, Tier("file").cap, Tier("none").on) == (True, 8, None, False)
    with pytest.raises(UsageError, match="BLOCKS must be a whole number above 0"):
        Tier("file:-3")


# ---------------------------------------------------------------------------------------------
# --raw-out: mode 0600 like the dataset; a full disk is one line (exit 5)

def test_raw_out_is_created_0600_and_an_existing_file_gets_0600(tmp_path):
    from kvtrace.capture import rawfile
    from kvtrace.dataset.writer import FILE_MODE

    new = tmp_path / "new.raw"
    rawfile.create(new).close()
    assert stat.S_IMODE(new.stat().st_mode) == FILE_MODE == 0o600
    old = tmp_path / "old.raw"
    old.write_bytes(b"stale")
    old.chmod(0o644)
    rawfile.create(old).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o600 and old.read_bytes() == b""
    # attach creates it so, then the capture opens it "wb": the mode stays
    with open(new, "wb") as f:
        rawfile.append(f, {1: [b"\x01abc"]})
    assert stat.S_IMODE(new.stat().st_mode) == 0o600 and rawfile.read(new) == {1: [b"\x01abc"]}


def test_raw_out_to_a_device_leaves_its_mode(tmp_path):
    from kvtrace.capture import rawfile

    before = os.stat("/dev/null").st_mode
    rawfile.create("/dev/null").close()   # as root a chmod would lock every other user out of /dev/null
    assert os.stat("/dev/null").st_mode == before


def test_raw_out_not_writable_is_one_line_exit_5(tmp_path):
    from kvtrace.capture import rawfile

    with pytest.raises(OutputError) as e:
        rawfile.create(tmp_path / "no" / "such" / "dir" / "x.raw")
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
    assert str(e.value) == f"cannot write --raw-out {tmp_path}/no/such/dir/x.raw: No such file or directory; choose another file"


def test_raw_out_disk_full_is_one_line_exit_5():
    """/dev/full answers every write with ENOSPC: the disk-full path without root or a tmpfs."""
    from kvtrace.capture import rawfile

    with open("/dev/full", "wb", buffering=0) as f:
        with pytest.raises(OutputError) as e:
            rawfile.append(f, {1: [b"\x01" * 64]})
    assert e.value.exit_code == 5
    assert str(e.value) == "cannot write the --raw-out file: disk full; the records written before stay readable"


class _Full:
    """A raw file whose disk is full at the first write."""

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_raw_out_other_write_errors_name_the_error():
    from kvtrace.capture import rawfile

    class Broken(_Full):
        def write(self, b):
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OutputError, match=r"^cannot write the --raw-out file: Input/output error; "):
        rawfile.append(Broken(), {1: [b"\x01"]})
    with pytest.raises(OutputError, match=r"^cannot write the --raw-out file: disk full; "):
        rawfile.append(_Full(), {1: [b"\x01"]})


# ---------------------------------------------------------------------------------------------
# A full output disk during attach: the line once (kvtrace.cli prints every KvtraceError)

def test_flush_loop_leaves_the_disk_full_line_to_the_cli():
    from kvtrace.attach import session

    class Pipeline:
        def step(self):
            raise OutputError("output disk full writing /x: capture stopped writing; files already written stay readable")

    class Never:
        reason = None

        def check(self, source, watch=None):
            return None

    cap = SimpleNamespace(quiet=True, plan=SimpleNamespace(attached=[]), inject=False, flush_interval=0.1, tiers=[],
                          on_restart=None, out="/x")
    said: list[str] = []
    with pytest.raises(OutputError):
        session._loop(cap, None, Pipeline(), [], Never(), None, said.append)
    assert said == []
