"""What kvtrace writes as root lands only where it was told: an output directory that is a
link, another user's, or open to others' writes is refused in one line (exit 5); a link planted
at a temporary file's name or at an --html/--raw-out path is removed or refused, never followed;
the file at the other end stays byte-identical."""
from __future__ import annotations

import os

import pytest

from kvtrace.dataset import writer
from kvtrace.errors import OutputError


def _victim(tmp_path):
    v = tmp_path / "shadow"
    v.write_text("root:secret\n")
    os.chmod(v, 0o600)
    return v


def test_an_output_directory_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "etc"
    target.mkdir()
    (tmp_path / "run1").symlink_to(target)
    with pytest.raises(OutputError, match=r"output directory .*run1 not used: it is a symbolic link; choose a directory"):
        writer.DatasetWriter(tmp_path / "run1", "r1", "h")
    assert os.listdir(target) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_an_output_directory_of_another_user_or_open_to_all_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SUDO_UID", raising=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(OutputError, match=r"not used: it belongs to uid 12345"):
        writer.DatasetWriter(theirs, "r1", "h")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(OutputError, match=r"not used: others can write in it \(mode 0777\)"):
        writer.DatasetWriter(open_dir, "r1", "h")
    monkeypatch.setenv("SUDO_UID", "12345")          # sudo kvtrace attach --out ~/run: the caller's own
    writer.DatasetWriter(theirs, "r1", "h")


def test_a_link_at_a_temporary_name_is_removed_not_followed(tmp_path):
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    w = writer.DatasetWriter(out, "r1", "h")
    runs = w._dir("runs")
    runs.mkdir(parents=True)
    (runs / ".r1.parquet.tmp").symlink_to(victim)
    w.write_run({"run": "r1"})
    assert victim.read_text() == "root:secret\n" and oct(victim.stat().st_mode & 0o777) == "0o600"
    assert (runs / "r1.parquet").is_file() and not (runs / ".r1.parquet.tmp").exists()


def test_a_link_at_an_output_file_is_refused(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "report.html").symlink_to(victim)
    with pytest.raises(OutputError, match=r"cannot write .*report.html: Too many levels of symbolic links"):
        writer.write_text(tmp_path / "report.html", "<html>")
    assert victim.read_text() == "root:secret\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a file as another uid")
def test_another_users_file_is_not_taken_over(tmp_path):
    f = tmp_path / "theirs.html"
    f.write_text("theirs\n")
    os.chown(f, 12345, 12345)
    with pytest.raises(OutputError, match=r"cannot write .*theirs.html: it belongs to uid 12345"):
        writer.write_text(f, "<html>")
    assert f.read_text() == "theirs\n" and f.stat().st_uid == 12345


def test_dev_null_and_a_fifo_without_reader_neither_chmodded_nor_blocking(tmp_path):
    mode = os.stat("/dev/null").st_mode
    writer.write_text("/dev/null", "x")
    assert os.stat("/dev/null").st_mode == mode
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OutputError, match=r"cannot write .*fifo: No such device or address"):
        writer.write_text(tmp_path / "fifo", "x")
